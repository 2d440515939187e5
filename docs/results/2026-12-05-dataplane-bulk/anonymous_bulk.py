"""What one message from a local process costs a real ``orbitkv-cache-manager``: for each shape below, a fresh
manager (the tree on ``PYTHONPATH``), one registered engine probing it with lease-free lookups, then one
message from a connection without the engine's credential (``blocks-engine*``: with it). Prints, per shape:
the reply, how long the manager took to answer, how much its peak RSS (``VmHWM``) grew, and the engine's
longest lookup while the message was being handled (the GIL the decode holds).

Shapes (each near the 64 MiB message limit):
  chunks   a save naming the engine: 16 million empty chunks (4 bytes each on the wire)
  blocks   a save naming the engine: 60,000 chunks of 1,000 one-byte block ids
  blocks-engine  the same with the engine's credential
  blocks-engine-fits  18,000 such chunks (16-byte keys) with the credential: the most an engine's message may
           build under the default --data-plane-max-buffered (256 MiB)
  keys     a lookup naming the engine: 30 million empty chunk keys
  register a registration of 200,000 tensors (anyone may register)
  table    a registration naming the sender's own pages file, its table 256 MiB of tensors

Usage: python anonymous_bulk.py [shape ...]  (run from the repository root, or with PYTHONPATH=<tree>)"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time

import msgspec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
from manager_process import ManagerProcess  # noqa: E402
from orbitkv_fs import dataplane as dp  # noqa: E402
from orbitkv_fs.dataplane import RemoteClient  # noqa: E402
from orbitkv_fs.geometry import EngineRegistration  # noqa: E402
from orbitkv_fs.pages import host_engine_pages  # noqa: E402

MIB = 1 << 20


def _body(shape: str, eid: str, cred: str, shm: str, descs: list) -> bytes:
    enc = msgspec.msgpack.encode
    if shape == "chunks":
        n = 16_000_000
        return b"\x94\xa4save" + enc(eid) + b"\xdd" + n.to_bytes(4, "big") + b"\x92\xc4\x00\x90" * n + b"\xa0"
    if shape in ("blocks", "blocks-engine"):
        n = 60_000
        return (b"\x94\xa4save" + enc(eid) + b"\xdc" + n.to_bytes(2, "big") +
                (b"\x92\xc4\x00\xdc\x03\xe8" + b"\x01" * 1000) * n +
                (enc(cred) if shape == "blocks-engine" else b"\xa0"))
    if shape == "blocks-engine-fits":  # the most block ids an engine's message may carry under the default bound
        n = 18_000
        return (b"\x94\xa4save" + enc(eid) + b"\xdc" + n.to_bytes(2, "big") +
                (b"\x92\xc4\x10" + bytes(16) + b"\xdc\x03\xe8" + b"\x01" * 1000) * n + enc(cred))
    if shape == "keys":
        n = 30_000_000
        return b"\x95\xa6lookup" + enc(eid) + b"\xdd" + n.to_bytes(4, "big") + b"\xc4\x00" * n + b"\xc3\xa0"
    reg = {"model": "m", "num_layers": 1, "layer_start": 0, "layer_end": 1, "block_size": 16, "num_heads": 1,
           "head_dim": 64, "dtype": "bfloat16"}
    if shape == "register":
        t = {"layer": 0, "role": "kv", "layout": "vllm_packed", "shape": [1], "strides": [1], "dtype": "bfloat16",
             "handle": {"type": "host", "path": "/nope", "offset": 0}}
        return enc(["register", dict(reg, tensors=[t] * 200_000)])
    if shape == "table":
        from orbitkv_fs.pages import _HDR, MAGIC, VERSION

        entry = enc({"name": "", "offset": 0, "shape": [], "strides": [], "dtype": "", "role": ""})
        n = (256 * MIB) // len(entry)
        table = b"\xdd" + n.to_bytes(4, "big") + entry * n
        path = os.path.join(shm, "forged-pages")
        with open(path, "wb") as f:
            f.write(_HDR.pack(MAGIC, VERSION, len(table)) + table)
            f.truncate(len(table) + (1 << 20))
        # the engine's own tensors, as if they lay in the forged file: the geometry passes, the file is opened
        ts = [msgspec.to_builtins(msgspec.structs.replace(d, handle=msgspec.structs.replace(d.handle, path=path)))
              for d in descs]
        return enc(["register", dict(reg, tensors=ts)])
    raise SystemExit(f"unknown shape {shape!r}")


def run(shape: str) -> None:
    with tempfile.TemporaryDirectory() as shm:
        mgr = ManagerProcess(shm_dir=shm, endpoint=f"ipc://{shm}/dp.sock")
        pages, descs = host_engine_pages(num_layers=1, num_blocks=8, block_size=16, num_heads=1, head_dim=64,
                                         directory=shm)
        try:
            engine = RemoteClient(mgr.endpoint, timeout=120)
            info = engine.register(EngineRegistration(
                model="m", num_layers=1, layer_start=0, layer_end=1, block_size=16, num_heads=1, head_dim=64,
                dtype="bfloat16", tensors=descs))
            eid = info.engine_id
            body = _body(shape, eid, info.credential, shm, descs)
            stop = threading.Event()
            lat: list[tuple[float, float]] = []

            def probe() -> None:
                while not stop.is_set():
                    t = time.perf_counter()
                    engine.lookup(eid, [bytes(16)], lease=False)
                    lat.append((t, time.perf_counter() - t))
                    time.sleep(0.001)

            p = threading.Thread(target=probe)
            p.start()
            time.sleep(0.5)
            base = mgr.rss("VmHWM")
            fam, addr = dp._parse_endpoint(mgr.endpoint)
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.settimeout(300)
            s.connect(addr)
            rfile = s.makefile("rb")
            dp._handshake(s, rfile, b"REQ", (b"ROUTER",))
            t0 = time.perf_counter()
            s.sendall(dp._DELIMITER + dp._frame(body))
            sent = time.perf_counter()
            _, reply = dp._read_message(rfile)
            answered = time.perf_counter()
            time.sleep(0.2)
            stop.set()
            p.join()
            s.close()
            err = msgspec.msgpack.decode(reply[1:], type=dp.WireError) if reply[:1] == b"\x01" else None
            worst = max((d for t, d in lat if t >= t0 - 0.01), default=0.0)
            why = f"{err.type}: {err.message[:70]}" if err else "ok"
            print(f"{shape:9s} {len(body) / MIB:5.1f} MiB  answered {answered - sent:6.2f} s after the last byte "
                  f"(sent in {sent - t0:5.2f} s)  peak RSS +{(mgr.rss('VmHWM') - base) / MIB:6.0f} MiB  "
                  f"engine's longest lookup {worst * 1e3:7.1f} ms  -> {why}", flush=True)
            engine.close()
        finally:
            pages.close()
            mgr.stop()


if __name__ == "__main__":
    for shape in sys.argv[1:] or ["chunks", "blocks", "keys", "register", "table"]:
        run(shape)
