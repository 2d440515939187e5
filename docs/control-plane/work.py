"""Save 4 chunks and restore them through the data plane, as the engine's connector would
(``restore``: look them up and restore them only)."""
import json
import sys

from orbitkv_fs.client import connect
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks

c = connect("tcp://127.0.0.1:9092")
with open("registered.json") as f:  # the registration's answer: every call for the engine carries its credential
    c.set_credential("vllm-tp0", json.loads(f.readline())["credential"])
chunks = [ChunkBlocks(chunk_key(f"prompt-{i}"), [2 * i, 2 * i + 1]) for i in range(4)]
if sys.argv[1:] != ["restore"]:
    print(c.save("vllm-tp0", chunks))
lk = c.lookup("vllm-tp0", [x.key for x in chunks])
print(lk)
print(c.restore("vllm-tp0", chunks, lease_id=lk.lease_id))
