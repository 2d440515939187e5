"""The SSD tier and a Manager on a disk that fails, for one tree: the figures of
docs/results/2026-12-05-bad-disk (before: the tree at 637019d; after: 0f9e4a4). Mounts tests/faultyfs.py of
this repository (FUSE; root) and runs, each in a child process with PYTHONPATH=TREE:

* recover: 40 records written and checkpointed, then the block of the 21st made unreadable (EIO); a
  recovery (``SsdTier(recover=True)``) in a child of its own: its exit status and what it serves;
* neighbours: one unreadable block inside one record; a demand read of all 40: how many miss;
* hung: a Manager with 8 chunks (96 segments) on the SSD only, then the disk stops answering (reads, writes,
  syncs): how long a leased lookup of 4 chunks, a second lookup of them, a restore of 2 others take; in a
  second Manager, a restore of 2 chunks as its first call; in a third, a DRAM flush of 4 new chunks saved
  since; in a fourth, close with them in DRAM. A timer makes
  the disk answer again 12 s after it stopped: an operation still waiting then shows as about 12 s.

Usage: python bad_disk.py TREE OUT.json"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

COMMON = """
import json, os, sys, threading, time, inspect
sys.path.insert(0, os.path.join(TREE, "tests"))
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from test_ssd_common import key, segment
def ctl(**kw):
    tmp = CONTROL + ".tmp"
    json.dump(kw, open(tmp, "w")); os.replace(tmp, CONTROL); time.sleep(0.05)
def cfg(path, cap=32 << 20, **kw):
    # the settings the tree knows (the tree before this change has no deadlines)
    have = SsdConfig.__dataclass_fields__
    return SsdConfig(paths=(path,), capacity=cap, **{k: v for k, v in kw.items() if k in have})
"""

FILL = """
ctl()
t = SsdTier(cfg(SHARD))
for i in range(40):
    assert t.submit(key(i), segment(i))
t.flush(); t.checkpoint()
recs = sorted(t.iter_records(), key=lambda o: o.offset)
print(json.dumps({"offsets": [o.offset for o in recs]}))
t.close()
"""

RECOVER = """
t0 = time.monotonic()
t = SsdTier(cfg(SHARD, recover=True))
got = [t.read(key(i)) for i in range(40)]
print(json.dumps({"served": sum(g == segment(i) for i, g in enumerate(got)),
                  "wrong": sum(g is not None and g != segment(i) for i, g in enumerate(got)),
                  "seconds": round(time.monotonic() - t0, 2)}))
t.close()
"""

NEIGHBOURS = """
ctl()
t = SsdTier(cfg(SHARD))
for i in range(40):
    assert t.submit(key(i), segment(i))
t.flush()
recs = sorted(t.iter_records(), key=lambda o: o.offset)
ctl(read_eio=[[os.path.basename(SHARD), recs[7].offset + 4096, 1]])
got = t.read_many([o.key for o in recs])
ctl()
again = t.read_many([o.key for o in recs])
print(json.dumps({"missed": sum(g is None for g in got), "missed_after_the_disk_heals": sum(g is None for g in again)}))
t.close()
"""

HUNG = """
from orbitkv_fs.manager import Manager
from orbitkv_fs.manager import ManagerConfig
from test_manager import chunks_for, make_engine
ctl()
pages, reg = make_engine()
chunks = chunks_for(12); keys = [c.key for c in chunks]
tier = SsdTier(cfg(SHARD, 64 << 20, read_timeout=1.0, close_timeout=2.0))
m = Manager(ManagerConfig(pool_size=512 << 10), lower_tier=tier)
e = m.register_engine(reg)
m.save(e.engine_id, chunks[:8]); m.flush_dram(); m.lower.checkpoint()
ctl(hang=True)
threading.Timer(12.0, ctl).start()
out = {}
def timed(name, fn):
    t0 = time.monotonic(); r = fn(); out[name] = {"seconds": round(time.monotonic() - t0, 2), "result": r}
if WHAT == "reads":
    timed("lookup", lambda: m.lookup(e.engine_id, keys[:4]).count)
    timed("lookup_again", lambda: m.lookup(e.engine_id, keys[:4], lease=False).count)
    timed("restore", lambda: m.restore(e.engine_id, chunks[4:6]).restored)
elif WHAT == "restore":
    timed("restore_first", lambda: m.restore(e.engine_id, chunks[4:6]).restored)
elif WHAT == "flush":
    m.save(e.engine_id, chunks[8:])
    flush_kw = {"timeout": 2.0} if "timeout" in inspect.signature(m.flush_dram).parameters else {}
    timed("flush_dram", lambda: getattr(m.flush_dram(**flush_kw), "complete", None))
else:
    m.save(e.engine_id, chunks[8:])
    timed("close", lambda: m.close())
print(json.dumps(out))
m.close(); pages.close()
"""


def child(tree: str, control: str, shard: str, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    code = f"TREE = {tree!r}\nCONTROL = {control!r}\nSHARD = {shard!r}\n" + COMMON + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": tree})


def last_json(p: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main() -> None:
    tree, out_path = os.path.abspath(sys.argv[1]), sys.argv[2]
    base = Path(tempfile.mkdtemp(prefix="bad-disk-"))
    backing, mnt, control = base / "backing", base / "disk", str(base / "faults.json")
    backing.mkdir()
    mnt.mkdir()
    Path(control).write_text("{}")
    fs = subprocess.Popen([sys.executable, str(REPO / "tests" / "faultyfs.py"), str(backing), str(mnt), control],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(150):
        if os.path.ismount(mnt):
            break
        time.sleep(0.1)
    result: dict = {"tree": tree}
    try:
        shard = str(mnt / "a.okv")
        filled = last_json(child(tree, control, shard, FILL))
        bad = filled["offsets"][20]
        Path(control).write_text(json.dumps({"read_eio": [["a.okv", bad, 4096]]}))
        time.sleep(0.1)
        p = child(tree, control, shard, RECOVER)
        result["recover"] = {"returncode": p.returncode, **last_json(p),
                             "newer_than_the_bad_block": sum(o > bad for o in filled["offsets"])}
        Path(control).write_text("{}")
        result["neighbours"] = last_json(child(tree, control, str(mnt / "b.okv"), NEIGHBOURS))
        result["hung"] = {}
        for what in ("reads", "restore", "flush", "close"):
            p = child(tree, control, str(mnt / f"{what}.okv"), f"WHAT = {what!r}\n" + HUNG)
            result["hung"].update(last_json(p) or {what: {"returncode": p.returncode, "stderr": p.stderr[-500:]}})
    finally:
        Path(control).write_text("{}")
        subprocess.run(["umount", "-l", str(mnt)])
        fs.terminate()
    print(json.dumps(result, indent=1))
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
