"""test_b_keeps_serving_when_a_is_killed_mid_transfer's scenario: Manager B restores a prefix from Manager A,
which is killed 20 ms after granting the lease; how long B's reads to A stay parked (and their arena
reserved) with nothing else asked of B, polled by ``stats`` only.

``python probe.py TRIALS SECONDS OUT.json``: prints one line per trial and writes the trials as JSON."""
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests"))
from json_child import spawner  # noqa: E402
from peer_manager_child import Mgr  # noqa: E402

from orbitkv_fs.provenance import code_identity  # noqa: E402

big = {"layers": 4, "slots": 64, "heads": 32}
trials = []
for trial in range(int(sys.argv[1])):
    with spawner(Mgr) as make:
        a = make(die_after_lease_ms=20, **big)
        c = make(**big)
        b = make(peers=[a.address, c.address], budget=1.0, **big)
        names, blocks = [f"big{i}" for i in range(64)], list(range(64))
        a("fill", seed=4, blocks=blocks)
        a("save", names=names, blocks=blocks)
        b("restore", names=names, blocks=blocks)
        t0 = time.monotonic()
        first = b("stats")["peer"]["abandoned_reads"]
        while True:
            st = b("stats")
            n = st["peer"]["abandoned_reads"]
            if n == 0 or time.monotonic() - t0 > float(sys.argv[2]):
                break
            time.sleep(0.05)
        t = {"parked": first, "left": n, "seconds": round(time.monotonic() - t0, 2),
             "reserved_bytes": st["reserved_bytes"], "staging_used_bytes": st["peer"]["staging_used_bytes"]}
        trials.append(t)
        print(f"trial {trial}: {first} parked after the restore; {n} left after {t['seconds']:.2f} s; "
              f"reserved {t['reserved_bytes']}, staging used {t['staging_used_bytes']}", flush=True)
pathlib.Path(sys.argv[3]).write_text(json.dumps({"code": code_identity(), "trials": trials}, indent=1) + "\n")
