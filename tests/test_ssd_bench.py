"""``orbitkv-bench ssd`` runs end to end at a tiny size and reports every figure (no timing asserted)."""

from __future__ import annotations

import json
import shutil

import pytest

from orbitkv_fs.tools.bench_ssd import main
from test_ssd_common import direct_io_dir


@pytest.mark.parametrize("fio", [False, True])
def test_bench_smoke(tmp_path, capsys, fio):
    if fio and shutil.which("fio") is None:
        pytest.skip("fio not installed")
    d = direct_io_dir(tmp_path)
    argv = ["--dir", str(d), "--bs", "64k", "--qd", "8", "--size", "4m", "--latency-fill", "2m",
            "--latency-saturate", "8m", "--latency-samples", "20", "--json", "--out", str(tmp_path / "r.json")]
    assert main(argv + ([] if fio else ["--no-fio"])) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((tmp_path / "r.json").read_text())
    (row,) = doc["throughput"]
    assert row["tier_write_GBps"] > 0 and row["tier_read_GBps"] > 0 and row["records"] == 64
    assert ("fio_write_GBps" in row) == fio and ("fio_saturated_read_p99_us" in doc["latency"]) == fio
    assert doc["latency"]["saturated_read_p99_us"] > 0 and doc["latency"]["saturated_switch500us_samples"] > 0
