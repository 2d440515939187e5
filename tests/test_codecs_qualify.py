"""``orbitkv-qualify``: its figures agree with a direct computation, and bad input is a clean exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.codecs import decode_segment, encode_segment
from orbitkv_fs.tools.qualify import load_kv, main, qualify_array

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def dumps(tmp_path):
    rng = np.random.default_rng(3)
    k = rng.standard_normal((256, 2, 64)).astype(BF16)
    v = rng.standard_normal((256, 2, 64)).astype(np.float32)
    bad = k.copy()
    bad[0, 0, 0] = np.nan
    paths = {}
    for name, arr in (("k", k), ("v", v), ("bad", bad)):
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], arr)
    return paths, k, v


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_figures_match_a_direct_computation(dumps, capsys):
    paths, k, _ = dumps
    out = run_json(capsys, [str(paths["k"]), "--codec", "turboquant-3", "--role", "key", "--layer", "4"])
    got = out["files"][str(paths["k"])]
    y = decode_segment(encode_segment(k.reshape(-1, 64), "turboquant-3", role="key", layer=4))
    x = k.astype(np.float64).reshape(-1, 64)
    y = y.astype(np.float64).reshape(-1, 64)
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    assert got["relative_mse"] == pytest.approx(((x - y) ** 2).sum() / (x**2).sum(), rel=1e-9)
    assert got["mean_cosine"] == pytest.approx(cos.mean(), rel=1e-9)
    assert got["min_cosine"] == pytest.approx(cos.min(), rel=1e-9)
    assert got["max_abs_error"] == pytest.approx(np.abs(x - y).max())
    assert got["logical_bytes"] == k.nbytes and got["stored_bytes"] == 64 + 512 * 26
    assert got["raw_segments"] == {} and got["vectors"] == 512


def test_bf16_npy_float32_dumps_segments_and_raw_fallbacks(dumps, capsys):
    paths, k, v = dumps
    assert load_kv(paths["k"]).dtype == BF16 and np.array_equal(load_kv(paths["k"]), k)
    assert load_kv(paths["v"], "fp16").dtype == np.float16
    out = run_json(capsys, [str(p) for p in paths.values()] + ["--codec", "fp8", "--role", "value",
                                                                "--segment-bytes", "16384"])
    assert out["files"][str(paths["bad"])]["raw_segments"] == {"nonfinite": 1}
    assert out["files"][str(paths["k"])]["segments"] == 4
    total = out["total"]
    assert total["segments"] == 12 and total["raw_segments"] == {"nonfinite": 1}
    assert total["logical_bytes"] == 3 * k.nbytes


def test_none_is_exact(dumps):
    paths, k, _ = dumps
    q = qualify_array(load_kv(paths["k"]), "none", "key")
    assert q.relative_mse == 0 and q.max_abs_error == 0 and q.min_cosine == pytest.approx(1.0)


def test_table_output_and_bad_input(dumps, tmp_path, capsys):
    paths, _, _ = dumps
    cmd = [sys.executable, "-m", "orbitkv_fs.tools.qualify"]
    ok = subprocess.run(cmd + [str(paths["k"]), str(paths["v"]), "--codec", "turboquant-4", "--role", "value"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "total" in ok.stdout and "rel MSE" in ok.stdout, ok.stderr
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    np.save(tmp_path / "ints.npy", np.arange(10))
    for bad in ("junk.npy", "ints.npy", "missing.npy"):
        assert main([str(tmp_path / bad), "--codec", "fp8", "--role", "key"]) == 2
        assert capsys.readouterr().err.startswith(f"orbitkv-qualify: {tmp_path / bad}")
    assert main([str(paths["k"]), "--codec", "fp8", "--role", "key", "--layer", "70000"]) == 2


def test_float32_dumps_read_as_the_16_bit_type_they_hold(tmp_path):
    """``--dtype auto``: a float32 file of BF16 values (``orbitkv-inspect dump``, ``tensor.float()``) is
    read back as exactly that BF16, one of FP16 values as exactly that FP16; other float32 is rounded to
    BF16; an explicit ``--dtype`` rounds to what it names."""
    rng = np.random.default_rng(9)
    bf = rng.standard_normal((64, 64)).astype(BF16)
    fp = (rng.standard_normal((64, 64)) * 3).astype(np.float16)
    raw = rng.standard_normal((64, 64)).astype(np.float32)
    for name, arr in (("bf", bf), ("fp", fp), ("raw", raw)):
        np.save(tmp_path / f"{name}.npy", arr.astype(np.float32))
    got = load_kv(tmp_path / "bf.npy")
    assert got.dtype == BF16 and got.tobytes() == bf.tobytes()
    got = load_kv(tmp_path / "fp.npy")
    assert got.dtype == np.float16 and got.tobytes() == fp.tobytes()
    got = load_kv(tmp_path / "raw.npy")
    assert got.dtype == BF16 and np.array_equal(got, raw.astype(BF16))
    assert load_kv(tmp_path / "bf.npy", "fp16").dtype == np.float16


def test_progress_bar_on_stderr_only_when_asked(dumps, capsys, monkeypatch):
    paths, _, _ = dumps
    monkeypatch.setenv("ORBITKV_PROGRESS", "1")
    assert main([str(paths["k"]), "--codec", "fp8", "--role", "key", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["total"]["segments"] == 1
    assert "k.npy (fp8)" in err and "100%" in err and "64.0k/64.0k" in err
    monkeypatch.setenv("ORBITKV_PROGRESS", "0")
    assert main([str(paths["k"]), "--codec", "fp8", "--role", "key", "--json"]) == 0
    assert capsys.readouterr().err == ""
