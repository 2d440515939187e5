"""A Manager restarted with --ssd-recover over a disk that stops answering reads: does it serve?

Mounts tests/faultyfs.py (a FUSE file system over a backing directory: a real kernel file system whose reads
can be made to hang), runs one tree's ``orbitkv-cache-manager`` (PYTHONPATH=PKG, a directory whose
``orbitkv_fs`` is the tree's, with ``server``, ``tools`` and ``gpu`` inside it) with an SSD shard on it, has
``orbitkv-sample-engine`` save four chunks, stops it (SIGTERM: a clean checkpoint), makes the disk's reads
hang, and starts the Manager again with ``--ssd-recover`` (and the extra flags given). Recorded: whether it
became ready within 60 s and when, its log's errors, ``/readyz``, a sample engine's round trip, what happens
once the disk answers, and how long SIGTERM takes to stop it.

Usage: python hung_start.py PKG OUT.json [EXTRA_FLAGS...]   (run as root, or a user allowed to mount FUSE)"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tests"))


def main() -> None:
    pkg, out_path, extra = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3:]
    os.environ["PYTHONPATH"] = pkg  # the Manager and the sample engine run the tree under test
    from manager_process import ManagerProcess, sample_engine_round_trip
    from test_ssd_bad_disk import FaultyDisk

    base = pathlib.Path(tempfile.mkdtemp())
    shm = tempfile.mkdtemp(prefix="hung-start-", dir="/dev/shm")
    disk = FaultyDisk(base)
    flags = ("--ssd-cache-path", str(disk.path / "a.okv"), "--ssd-cache-capacity", "64mb")
    out: dict = {"pkg": pkg, "extra_flags": extra}
    try:
        first = ManagerProcess(*flags, shm_dir=shm, pool="64mb")
        sample_engine_round_trip(first.endpoint, shm)
        out["first_run_stop_rc"] = first.stop()
        disk.set(hang_reads=True)
        t0 = time.monotonic()
        try:
            m = ManagerProcess(*flags, "--ssd-recover", *extra, shm_dir=shm, pool="64mb", timeout=60)
        except RuntimeError as e:
            out["ready"] = False
            out["waited_s"] = round(time.monotonic() - t0, 1)  # 60 s, then up to 30 s for SIGTERM, then SIGKILL
            out["log_tail"] = str(e).splitlines()[-3:]
            return
        out["ready"] = True
        out["ready_after_s"] = round(time.monotonic() - t0, 1)
        out["log_errors"] = [ln.strip()[:300] for ln in m.lines if " ERROR " in ln]
        with urllib.request.urlopen(m.http + "/readyz", timeout=10) as r:
            out["readyz"] = json.loads(r.read())
        try:
            sample_engine_round_trip(m.endpoint, shm)
            out["sample_engine_round_trip"] = "identical to what was saved"
        except AssertionError as e:
            out["sample_engine_round_trip"] = str(e)[-300:]
        disk.set()
        time.sleep(5)
        out["after_the_disk_answers"] = [ln.strip()[:300] for ln in m.lines if "given up" in ln]
        t1 = time.monotonic()
        out["stop_rc"] = m.stop()
        out["stop_s"] = round(time.monotonic() - t1, 2)
    finally:
        disk.close()
        shutil.rmtree(shm, ignore_errors=True)
        json.dump(out, open(out_path, "w"), indent=1)
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
