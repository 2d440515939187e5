"""Pins' share of the pool: a lookup's lease pins its chunks until the restore that follows, and anyone may
register an engine and save chunks of its own. Before the share, a process that saved chunks until the pool was
full and looked them all up (within the lease bounds) held the whole pool: another engine's save of 512 chunks
took 12.6 s (each segment's reservation walked every pinned object, under the tier's lock) and kept none of them
(docs/results/2026-12-06-pinned-pool). Pins now keep at most ``max_pinned_share`` of the pool from eviction,
all engines together; past it an eviction takes pinned objects too, the least recent first (their restores miss,
as after any eviction). Reads in progress (a restore's hold, a peer's lease) never give way."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from orbitkv_fs.client import connect
from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineRegistration, Manager, ManagerConfig
from orbitkv_fs.pages import HostPages, PageTensor
from orbitkv_fs.segment import Role
from orbitkv_fs.server.cli import build_parser
from orbitkv_fs.tiers.dram import UNIT, DramTier
from manager_process import ATTACKER_ENGINE, ManagerProcess


def _key(chunk: int, layer: int = 0, ns: bytes = b"n") -> bytes:
    return ObjectKey(ns * 16, chunk.to_bytes(16, "little"), layer, Role.KEY).pack()


def _fill(t: DramTier, chunks: range, layers: int = 1, n: int = 1000) -> None:
    for c in chunks:
        for layer in range(layers):
            off = t.reserve(n)
            assert off is not None
            assert t.publish(_key(c, layer), off, n, n, 0) is not None


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_pins_keep_their_share_of_the_pool_and_no_more(policy):
    t = DramTier(64 * UNIT, policy=policy, pin_share=0.25)  # 32 objects of 2 units; pins keep 16 units
    try:
        _fill(t, range(16), layers=2)
        t.pin_chunks([_key(c)[:32] for c in range(16)])  # everything
        assert (t.pinned_units, t.pin_allowance) == (64, 16)
        _fill(t, range(100, 132))  # another engine's 32 objects: the whole pool again
        assert t.pinned_units == 16 and t.pins_evicted == 24
        assert sum(t.index.chunk_count(_key(c)[:32]) for c in range(16)) == 8  # four whole chunks, 16 units
        _fill(t, range(200, 400))  # and on: the pins keep their share, the rest turns over
        assert (t.pinned_units, t.pins_evicted) == (16, 24)
        assert all(t.contains(_key(c)) for c in range(376, 400))
        t.unpin_chunks([_key(c)[:32] for c in range(16)])
        assert (t.pinned_units, t.pin_units, len(t.chunk_pins)) == (0, {}, 0)
    finally:
        t.close()


def test_reads_in_progress_never_give_way_and_a_full_pool_of_them_is_not_walked_per_segment():
    t = DramTier(32 * UNIT, pin_share=0.0)
    try:
        _fill(t, range(16))
        held = t.lease([_key(c) for c in range(16)])  # a restore's hold on every object
        takes = []
        take = t.policy.take
        t.policy.take = lambda *a: takes.append(a[0]) or take(*a)
        assert t.reserve_many([1000] * 64) == [None] * 64
        # One walk found nothing to take; the other 63 pieces were not each given a walk of their own.
        assert len(takes) == 2 and all(t.contains(_key(c)) for c in range(16))
        t.unlease([f[:2] for f in held])
        offs = t.reserve_many([1000] * 8)
        assert None not in offs and t.evictions == 8
    finally:
        t.close()


def test_pinned_units_follow_pins_unpins_invalidation_and_eviction():
    t = DramTier(64 * UNIT, pin_share=1.0)
    try:
        _fill(t, range(4), layers=3)  # 6 units a chunk
        a, b = _key(0)[:32], _key(1)[:32]
        t.pin_chunks([a, a, b])  # a twice in one lookup, b once
        t.pin_chunks([a])
        assert (t.pinned_units, t.pin_units) == (12, {a: 6, b: 6})
        t.unpin_chunks([a, b])
        assert (t.pinned_units, t.pin_units) == (6, {a: 6})  # a still holds two pins
        assert t.invalidate_keys([_key(0, 1)]) == (1, 1000)
        assert (t.pinned_units, t.pin_units) == (4, {a: 4})
        assert t.leading_complete([a, _key(2)[:32], _key(3)[:32]], 2, pin=True) == 3
        assert t.pinned_units == 16
        t.unpin_chunks([a, a, a, _key(2)[:32], _key(3)[:32]])
        assert (t.pinned_units, t.pin_units, len(t.chunk_pins)) == (0, {}, 0)
    finally:
        t.close()


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_a_share_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError):
        Manager(ManagerConfig(pool_size=8 << 20, device="cpu", max_pinned_share=bad))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-pinned-share", str(bad)])
    assert build_parser().parse_args(["--max-pinned-share", "0.25"]).max_pinned_share == 0.25


ATTACKER = ATTACKER_ENGINE + """
leased = 0
for r in range(int(args[0])):  # the pool many times over, each round's chunks leased in runs of 64 as they are saved
    chunks = [ChunkBlocks(chunk_key(f"a{r}-{i}"), [i]) for i in range(n)]
    c.save("attacker", chunks)
    for j in range(0, n, 64):
        leased += c.lookup("attacker", [ch.key for ch in chunks[j:j + 64]]).lease_id != 0
print(leased, flush=True)
sys.stdin.readline()  # hold every lease until told
"""


class _Victim:
    """An engine of this process over host pages of random BF16 words: ``n`` chunks of one block, two layers."""

    def __init__(self, endpoint: str, shm: str, n: int) -> None:
        tensors = [PageTensor(f"L{l}.{r}", 0, [n, 16, 2, 64], [], "bfloat16", r, l, "separate")
                   for l in range(2) for r in ("key", "value")]
        self.pages = HostPages.create(tensors, path=f"{shm}/orbitkv-pages-victim")
        rng = np.random.default_rng(7)
        for name in self.pages.tensors:
            raw = self.pages.array(name).view(np.uint16)
            raw[...] = rng.integers(0, 1 << 16, size=raw.shape, dtype=np.uint16)
        self.want = {name: self.pages.array(name).view(np.uint16).copy() for name in self.pages.tensors}
        reg = EngineRegistration(model="victim", num_layers=2, layer_start=0, layer_end=2, block_size=16,
                                 num_heads=2, head_dim=64, dtype="bfloat16",
                                 tensors=[self.pages.descriptor(t) for t in self.pages.tensors], engine_kind="sample",
                                 engine_id="victim")
        self.client = connect(endpoint, timeout=60)
        self.client.register(reg)
        self.chunks = [ChunkBlocks(chunk_key(f"v{i}"), [i]) for i in range(n)]

    def zero(self) -> None:
        for name in self.pages.tensors:
            self.pages.array(name).view(np.uint16)[...] = 0

    def exact(self) -> bool:
        return all(np.array_equal(self.pages.array(name).view(np.uint16), self.want[name])
                   for name in self.pages.tensors)

    def close(self) -> None:
        self.pages.close()


def test_a_process_that_pins_the_whole_pool_leaves_other_engines_their_share(tmp_path):
    """A second OS process, no token, registers over its own pages and saves 16 KiB chunks (four 4 KiB
    segments) until it has passed a 64 MiB pool twice, looking up every chunk as it goes, and holds those
    leases (64 chunks each, within the lease bounds). Another engine then saves 1,024 chunks (16 MiB) and
    restores every one of them byte for byte; the pins kept half the pool."""
    mgr = ManagerProcess(shm_dir=str(tmp_path), pool="64mb")
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, mgr.endpoint, str(tmp_path), "2048", "4"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pages = None
    try:
        leased = int(attacker.stdout.readline())
        pinned = mgr.metric("orbitkv_pinned_chunks")
        print(f"attacker: {leased} leases, {pinned:.0f} chunks pinned, "
              f"{mgr.metric('orbitkv_pinned_evictions_total'):.0f} pinned segments evicted")
        # Its later rounds' saves evicted its own pinned chunks past the share (their lookups found fewer).
        assert leased > 64 and mgr.metric("orbitkv_pinned_evictions_total") > 0
        n = 1024
        pages = _Victim(mgr.endpoint, str(tmp_path), n)
        c, chunks = pages.client, pages.chunks
        t0 = time.monotonic()
        saved = c.save("victim", chunks)
        took = time.monotonic() - t0
        assert saved.dropped_segments == 0 and saved.chunks_saved == n, saved
        pages.zero()
        lk = c.lookup("victim", [ch.key for ch in chunks])
        assert lk.count == n
        assert all(c.restore("victim", chunks, lease_id=lk.lease_id).restored)
        assert pages.exact()
        assert mgr.metric("orbitkv_pinned_chunks") <= pinned  # the victim's own lease ended with its restore
        assert 1 <= mgr.log.count("more than their share (--max-pinned-share)") <= 2  # rate-limited
        print(f"victim save of {n} chunks: {took:.3f} s")
    finally:
        if pages is not None:
            pages.close()
        attacker.communicate("\n", timeout=60)
        assert mgr.stop() == 0


def test_an_object_published_after_its_chunk_was_pinned_never_takes_the_count_below_zero():
    t = DramTier(64 * UNIT, pin_share=1.0)
    try:
        a = _key(0)[:32]
        t.pin_chunks([a])  # pinned before any of its objects is there: nothing counted
        _fill(t, range(1), layers=2)
        assert (t.pinned_units, t.pin_units) == (0, {a: 0})
        assert t.invalidate_chunks([a]) == (2, 2000)
        assert (t.pinned_units, t.pin_units) == (0, {a: 0})
        t.unpin_chunks([a])
        assert (t.pinned_units, t.pin_units) == (0, {})
    finally:
        t.close()


def test_evictions_past_the_share_take_the_pins_of_the_namespaces_over_an_equal_part():
    """Past the share an eviction takes pinned objects only from the namespaces whose pins hold more than an
    equal part of it, each down to that part: another namespace's few pins, older than the big one's, stay."""
    t = DramTier(64 * UNIT, pin_share=0.5)  # pins keep 32 units; two namespaces: 16 each
    try:
        for c in range(4):  # the victim: 4 chunks of 2 units, looked up first (the least recent pins)
            assert t.publish(_key(c, ns=b"v"), t.reserve(1000), 1000, 1000, 0) is not None
        t.pin_chunks([_key(c, ns=b"v")[:32] for c in range(4)])
        for c in range(24):  # the big one: 48 units pinned
            assert t.publish(_key(c, ns=b"a"), t.reserve(1000), 1000, 1000, 0) is not None
        t.pin_chunks([_key(c, ns=b"a")[:32] for c in range(24)])
        assert (t.pinned_units, dict(t.ns_pinned)) == (56, {b"v" * 16: 8, b"a" * 16: 48})
        for c in range(100, 132):  # a third engine's saves, unpinned: 64 units
            assert t.publish(_key(c, ns=b"x"), t.reserve(1000), 1000, 1000, 0) is not None
        assert all(t.contains(_key(c, ns=b"v")) for c in range(4))  # under its part: kept
        assert t.pinned_units <= 32 and t.ns_pinned[b"a" * 16] <= 24 and t.pins_evicted >= 12
        assert sum(t.ns_pinned.values()) == t.pinned_units
        t.unpin_chunks([_key(c, ns=b"v")[:32] for c in range(4)] + [_key(c, ns=b"a")[:32] for c in range(24)])
        assert (t.pinned_units, len(t.ns_pinned)) == (0, 0)
    finally:
        t.close()


def test_when_every_namespace_is_over_its_part_each_is_cut_down_to_it():
    t = DramTier(64 * UNIT, pin_share=0.5)
    try:
        for ns, count in ((b"v", 10), (b"a", 14)):  # 20 and 28 units, both over 16
            for c in range(count):
                assert t.publish(_key(c, ns=ns), t.reserve(1000), 1000, 1000, 0) is not None
        # one call, two namespaces
        t.pin_chunks([_key(c, ns=b"v")[:32] for c in range(10)] + [_key(c, ns=b"a")[:32] for c in range(14)])
        assert (t.pinned_units, dict(t.ns_pinned)) == (48, {b"v" * 16: 20, b"a" * 16: 28})
        for c in range(100, 140):
            assert t.publish(_key(c, ns=b"x"), t.reserve(1000), 1000, 1000, 0) is not None
        assert t.pinned_units <= 32 and t.ns_pinned[b"v" * 16] >= 16 and t.ns_pinned[b"a" * 16] >= 16
        assert sum(t.ns_pinned.values()) == t.pinned_units
    finally:
        t.close()


VICTIM_FIRST = ATTACKER_ENGINE + """
for r in range(int(args[0])):
    chunks = [ChunkBlocks(chunk_key(f"a{r}-{i}"), [i]) for i in range(n)]
    c.save("attacker", chunks)
    for j in range(0, n, 64):
        c.lookup("attacker", [ch.key for ch in chunks[j:j + 64]])
print("done", flush=True)
sys.stdin.readline()  # hold every lease until told
"""


def test_an_engine_that_looked_up_before_a_pinning_flood_still_restores(tmp_path):
    """An engine looks up 64 of its chunks; before its restore, another process saves past a 64 MiB pool twice and
    looks up everything it saves (its pins far over the share). The eviction that must then take pinned chunks
    takes the flood's, not the engine's older and smaller pins: its restore gets every chunk, byte for byte.
    Before, the least recent pins went first: the engine's."""
    mgr = ManagerProcess(shm_dir=str(tmp_path), pool="64mb")
    victim = attacker = None
    try:
        victim = _Victim(mgr.endpoint, str(tmp_path), 64)
        c, chunks = victim.client, victim.chunks
        assert c.save("victim", chunks).chunks_saved == 64
        lk = c.lookup("victim", [ch.key for ch in chunks])
        assert lk.count == 64
        attacker = subprocess.Popen([sys.executable, "-c", VICTIM_FIRST, mgr.endpoint, str(tmp_path), "2048", "4"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert attacker.stdout.readline().strip() == "done"
        assert mgr.metric("orbitkv_pinned_evictions_total") > 0  # the share was passed, pinned chunks taken
        victim.zero()
        got = c.restore("victim", chunks, lease_id=lk.lease_id)
        assert got.restored == [True] * 64, got.misses
        assert victim.exact()
    finally:
        if attacker is not None:
            attacker.communicate("\n", timeout=60)
        if victim is not None:
            victim.close()
        assert mgr.stop() == 0
