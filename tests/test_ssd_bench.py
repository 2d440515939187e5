"""``orbitkv-bench ssd`` runs end to end at a tiny size and reports every figure (no timing asserted)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from orbitkv_fs.tools.bench_ssd import main
from test_ssd_common import direct_io_dir


@pytest.mark.parametrize("fio", [False, True])
def test_bench_smoke(tmp_path, capsys, fio):
    if fio and shutil.which("fio") is None:
        pytest.skip("fio not installed")
    d = direct_io_dir(tmp_path)
    argv = ["--dir", str(d), "--bs", "64k", "--qd", "8", "--size", "4m", "--latency-fill", "2m",
            "--latency-saturate", "8m", "--latency-samples", "20", "--promotion-size", "8m", "--json",
            "--out", str(tmp_path / "r.json")]
    assert main(argv + ([] if fio else ["--no-fio"])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((tmp_path / "r.json").read_text())
    (row,) = doc["throughput"]
    assert row["tier_write_GBps"] > 0 and row["tier_read_GBps"] > 0 and row["records"] == 64
    assert ("fio_write_GBps" in row) == fio and ("fio_saturated_read_p99_us" in doc["latency"]) == fio
    lat = doc["latency"]
    assert [r["throttled"] for r in lat["runs"]] == [False, True]
    assert all(r["saturated_samples"] > 0 and r["saturated_read_p99_us"] > 0 for r in lat["runs"])
    assert lat["unthrottled_saturated_read_p50_us"] > 0 and lat["throttled_saturated_read_p50_us"] > 0
    pr = doc["promotion"]
    assert pr["segments"] == 16 and pr["promotion_GBps"] > 0 and pr["tier_read_GBps"] > 0


def test_bench_only_promotion(tmp_path, capsys):
    d = direct_io_dir(tmp_path)
    assert main(["--dir", str(d), "--only", "promotion", "--promotion-size", "16m", "--repeat", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "command" in doc and "throughput" not in doc and "latency" not in doc
    pr = doc["promotion"]
    assert pr["logical_bytes"] == 16 << 20 and len(pr["promotion_s"]) == len(pr["tier_read_s"]) == 2
    assert list(d.iterdir()) == []  # scratch shard removed


def test_bench_only_latency(tmp_path, capsys):
    d = direct_io_dir(tmp_path)
    assert main(["--dir", str(d), "--only", "latency", "--no-fio", "--latency-fill", "2m", "--latency-saturate",
                 "8m", "--latency-samples", "10", "--latency-repeat", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "throughput" not in doc and len(doc["latency"]["runs"]) == 4
    assert list(d.iterdir()) == []  # scratch shards removed


def test_bench_default_dir_outside_cwd(tmp_path, capsys, monkeypatch):
    # A killed run must not leave a scratch shard in the working tree (the repository, typically).
    try:
        with tempfile.NamedTemporaryFile() as f:
            os.close(os.open(f.name, os.O_RDWR | os.O_DIRECT))
    except OSError:
        pytest.skip("the system temporary directory does not take O_DIRECT")
    made = []
    real = tempfile.mkdtemp

    def spy(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    assert main(["--only", "throughput", "--no-fio", "--bs", "64k", "--qd", "8", "--size", "1m", "--json"]) == 0
    assert made and not os.path.commonpath([made[0], str(tmp_path)]) == str(tmp_path)
    assert list(tmp_path.iterdir()) == [] and not os.path.exists(made[0])
