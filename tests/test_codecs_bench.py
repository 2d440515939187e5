"""``orbitkv-bench``: the dispatcher's contract (benchmarks print figures; tests do not time anything)."""

from __future__ import annotations

import sys

import pytest

from orbitkv_fs.tools import bench


def test_usage_and_unknown_subcommand(capsys):
    assert bench.main(["--help"]) == 0
    assert "codecs" in capsys.readouterr().out
    assert bench.main([]) == 2
    assert bench.main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err


def test_missing_module_is_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(bench.SUBCOMMANDS, "zzz", "not written")
    assert bench.main(["zzz"]) == 2
    assert "orbitkv_fs.tools.bench_zzz missing" in capsys.readouterr().err


def test_codecs_subcommand_parses(capsys):
    from orbitkv_fs.tools import bench_codecs

    args = bench_codecs.build_parser().parse_args(["--device", "cpu", "--json", "--repeat", "2"])
    assert (args.device, args.json, args.repeat) == ("cpu", True, 2)


@pytest.mark.parametrize("cupy_blocked", [False, True], ids=["this host", "no cupy"])
@pytest.mark.parametrize("sub", [["codecs", "--device", "gpu"],
                                 ["pipeline", "--device", "gpu", "--only", "throughput", "--blocks", "128"]])
def test_gpu_benches_without_a_usable_gpu_say_why(sub, cupy_blocked, monkeypatch, capsys):
    """Where the GPU stack cannot run (cupy absent; or cupy present with no driver or no device, as in CI),
    a GPU bench exits 2 with one sentence saying why, before it starts any process or CUDA call."""
    from orbitkv_fs.gpu import unusable_reason

    if cupy_blocked:
        monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    why = unusable_reason()
    if why is None:
        pytest.skip("a CUDA device is usable here: the GPU benches run (the device's own tests)")
    if cupy_blocked:
        assert why.startswith("cupy is not importable")
    assert bench.main(sub) == 2
    err = capsys.readouterr().err
    assert f"orbitkv-bench {sub[0]} --device gpu: the GPU stack is not usable here ({why})" in err
    assert "Traceback" not in err


def test_unusable_reason_answers_whatever_a_broken_cupy_raises(monkeypatch):
    """A cupy whose import or device query fails in any way (a half-installed wheel, a driver mismatch) makes the
    GPU unusable, said in words: the Manager's start-up asks this and must not die of it."""
    import types

    from orbitkv_fs.gpu import unusable_reason

    class _Broken(types.ModuleType):
        def __getattr__(self, name):
            raise OSError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setitem(sys.modules, "cupy", _Broken("cupy"))
    assert unusable_reason() == "no usable CUDA driver (libcudart.so.13: cannot open shared object file)"
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert unusable_reason() == "no CUDA device"

    class _FailingLoad:  # a finder whose cupy raises while loading, as a wheel built for another CUDA does
        def find_spec(self, name, path=None, target=None):
            if name == "cupy":
                raise RuntimeError("CUDA path could not be detected")
            return None

    monkeypatch.delitem(sys.modules, "cupy")
    monkeypatch.setattr(sys, "meta_path", [_FailingLoad()] + sys.meta_path)
    assert unusable_reason() == "cupy is not importable (CUDA path could not be detected)"


def test_gpu_probes_without_the_gpu_package_say_no_gpu(monkeypatch):
    """Run from a source tree without setup.py's mapping, ``orbitkv_fs.gpu`` does not exist: the Manager's device
    probe and the tests' ``gpu`` skip answer "no GPU" instead of raising (the skip runs during collection, where
    an exception aborts the whole session)."""
    import conftest
    from orbitkv_fs.manager.device import _gpu_present

    monkeypatch.setitem(sys.modules, "orbitkv_fs.gpu", None)  # import of it raises ImportError
    assert _gpu_present() is False
    assert conftest.gpu_available.__wrapped__() is False
