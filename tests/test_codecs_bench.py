"""``orbitkv-bench``: the dispatcher's contract (benchmarks print figures; tests do not time anything)."""

from __future__ import annotations

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


def test_codecs_subcommand_parses_and_gpu_without_stack_says_so(capsys):
    from orbitkv_fs.tools import bench_codecs

    args = bench_codecs.build_parser().parse_args(["--device", "cpu", "--json", "--repeat", "2"])
    assert (args.device, args.json, args.repeat) == ("cpu", True, 2)
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert bench.main(["codecs", "--device", "gpu"]) == 2
        assert "GPU stack is not usable" in capsys.readouterr().err
    else:
        pytest.skip("cupy is installed: the GPU path is the GPU helper's test")
