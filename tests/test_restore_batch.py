"""The restore's batch operations against their one-at-a-time definitions: keys (pack_key), index look-ups
(get), leases (lease of one key at a time), policy touches (touch) and header checks (_verify_header), on
random inputs and random corruptions."""

from __future__ import annotations

import random
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from eviction_lists import queue_order

from orbitkv_fs.codecs import encode_segment, raw_segment
from orbitkv_fs.errors import SegmentError
from orbitkv_fs.index import ObjectIndex, _scan_keys
from orbitkv_fs.keys import key_tails, pack_key, segment_keys
from orbitkv_fs.manager.api import ChunkBlocks
from orbitkv_fs.manager.batching import Batching
from orbitkv_fs.manager.leases import Spans
from orbitkv_fs.manager.restore import RestorePipeline, _Rows
from orbitkv_fs.manager.verify import (
    _header_rows,
    _verify_header,
    _verify_headers,
    header_fields,
    header_of,
    read_sizes,
)
from orbitkv_fs.segment import HEADER_DTYPE, HEADER_SIZE, MAX_STORED_BYTES, AnsType, Format, RawReason, Role
from orbitkv_fs.segment import SegmentHeader, pack_header, parse_header
from orbitkv_fs.tiers.dram import UNIT, DramTier
from orbitkv_fs.tiers.eviction import LruPolicy, S3FifoPolicy

NS = bytes(range(16))


def test_segment_keys_are_pack_key():
    rng = random.Random(3)
    pairs = [(rng.randrange(1 << 16), rng.choice(list(Role))) for _ in range(72)] + [(0, Role.OPAQUE), (65535, Role.VALUE)]
    tails = key_tails(pairs)
    for _ in range(32):
        chunk = rng.randbytes(16)
        assert segment_keys(NS, chunk, tails) == [pack_key(NS, chunk, layer, role) for layer, role in pairs]


def _fill(ix: ObjectIndex, rng: random.Random) -> list[bytes]:
    keys = []
    for c in range(20):
        chunk = bytes([c]) * 16
        layers = rng.sample(range(40), rng.choice([1, 2, 5, 30]))  # one-slot, sparse and dense chunks
        for layer in layers:
            for role in rng.sample([Role.KEY, Role.VALUE, Role.OPAQUE], rng.randrange(1, 4)):
                k = pack_key(NS, chunk, layer, role)
                ix.add(k, len(keys), 1, 100, 100, 0)
                keys.append(k)
    return keys


def test_get_many_is_get_of_each_key():
    rng = random.Random(5)
    ix = ObjectIndex()
    keys = _fill(ix, rng)
    for k in rng.sample(keys, 40):  # holes, and chunks back to one slot or gone
        ix.hide(ix.get(k))
    probes = [pack_key(NS, bytes([c]) * 16, layer, role) for c in range(22) for layer in range(42)
              for role in Role]
    probes += [k[:35] + b"\x01" for k in keys[:5]] + [b"short", keys[0] + b"x"]  # not packed keys
    packed = probes[:-2]  # every key 36 bytes: the array path (the two others send a call to the per-key one)
    # Keys of 35 and 37 bytes whose bytes, joined, are two stored keys: found by neither
    split = [keys[0][:35], keys[0][35:] + keys[1]] * 8
    for order in (probes, sorted(probes), rng.sample(probes, len(probes)), probes[:7], packed, sorted(packed),
                  rng.sample(packed, len(packed)), keys, sorted(keys), split):
        assert ix.get_many(order).tolist() == [-1 if (s := ix.get(k)) is None else s for k in order]
    for order in (sorted(packed), keys, sorted(keys)):  # a caller's own scan, its runs not the longest
        sub, starts = _scan_keys(order)
        runs = (sub, sorted(set(starts) | {starts[-1] // 2, starts[-1] // 3}))
        assert ix.get_many(order, runs=runs).tolist() == [-1 if (s := ix.get(k)) is None else s for k in order]


def _lru_order(p: LruPolicy) -> list[int]:
    return queue_order(p._l)


@pytest.mark.parametrize("seed", range(6))
def test_touch_many_is_touch_of_each_slot(seed):
    rng = random.Random(seed)
    for _ in range(60):
        one, many, arrayed = LruPolicy(), LruPolicy(), LruPolicy()  # arrayed: the slots as an int64 array
        s3one, s3many = S3FifoPolicy(), S3FifoPolicy()
        n = rng.randrange(1, 200)
        for s in range(n):
            if rng.random() < 0.9:
                for p in (one, many, arrayed, s3one, s3many):
                    p.insert(s, 1, s)
        for s in rng.sample(range(n), n // 10):
            for p in (one, many, arrayed, s3one, s3many):
                p.remove(s)
        order = _lru_order(one)
        k, j = rng.randrange(0, 120), rng.randrange(0, max(len(order), 1))
        touches = rng.choice([
            [rng.randrange(n + 5) for _ in range(k)],  # duplicates, unlinked and unknown slots
            order[::-1][j:j + k],  # a run in the order the batch path moves at once
            order[::-1][:k],  # the same from the tail
            order[j:j + k],  # a run the other way round
            order[::-1][j:j + k] + order[:2],
        ])
        for s in touches:
            one.touch(s)
            s3one.touch(s)
        many.touch_many(touches)
        arrayed.touch_many(np.asarray(touches, dtype=np.int64))
        s3many.touch_many(touches)
        assert _lru_order(many) == _lru_order(one) == _lru_order(arrayed)
        assert list(s3many._l.freq) == list(s3one._l.freq)


def _lease_one(t: DramTier, key: bytes):
    """The lease of one key as DramTier.lease made it before batches: the reference."""
    ix = t.index
    slot = ix.get(key)
    if slot is None:
        return None
    if slot in t.prefetched:
        t.prefetched.discard(slot)
        t.prefetch_hits += 1
    ix.leases[slot] += 1
    t.leases_active += 1
    t.leased_bytes += ix.units[slot] * UNIT
    t.policy.touch(slot)
    return slot, ix.generation[slot], ix.offset[slot] * UNIT, ix.length[slot]


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_lease_of_a_batch_is_lease_of_each_key(tmp_path, policy):
    rng = random.Random(7)
    tiers = [DramTier(1 << 20, shm_dir=str(tmp_path), pin=False, policy=policy) for _ in range(2)]
    try:
        keys = [pack_key(NS, bytes([c]) * 16, layer, role) for c in range(8) for layer in range(6) for role in (1, 2)]
        for t in tiers:
            for i, k in enumerate(keys):
                off = t.reserve(100 + i)
                t.publish(k, off, 100 + i, 200, 0, prefetched=i % 3 == 0)
        batch, single = tiers
        for _ in range(5):
            probe = rng.sample(keys, 40) + [pack_key(NS, b"z" * 16, 0, 1)] + keys[:3]  # absent, twice
            if rng.random() < 0.5:
                probe = keys[::-1]  # one run of the LRU list
            got = batch.lease(probe)
            want = [_lease_one(single, k) for k in probe]
            assert got == want
            for a in ("leases_active", "leased_bytes", "prefetch_hits", "prefetched"):
                assert getattr(batch, a) == getattr(single, a), a
            assert list(batch.index.leases) == list(single.index.leases)
            if policy == "lru":
                assert _lru_order(batch.policy) == _lru_order(single.policy)
            else:
                assert list(batch.policy._l.freq) == list(single.policy._l.freq)
        assert batch.lease([]) == [] and batch.lease([b"x" * 36]) == [None]
        before = list(batch.index.leases)
        for bad in ([0, len(before)], [-1]):  # not rows: nothing leased
            with pytest.raises(IndexError):
                batch.index.lease_slots(np.asarray(bad, dtype=np.int64))
        assert list(batch.index.leases) == before
        gone = set(rng.sample(keys, 10))
        for t in tiers:  # leased objects hidden: freed when their last lease goes
            assert t.invalidate_keys(gone)[0] == 10
        held = [(s, g) for s, g in zip(range(len(batch.index.leases)), batch.index.generation)
                for _ in range(batch.index.leases[s])]
        rng.shuffle(held)
        batch.unlease(held[:50])
        batch.unlease(iter(held[50:]))
        for slot, gen in held:  # the reference: one at a time, as unlease was
            ix = single.index
            assert ix.generation[slot] == gen and ix.leases[slot] > 0
            ix.leases[slot] -= 1
            single.leases_active -= 1
            single.leased_bytes -= ix.units[slot] * UNIT
            if ix.leases[slot] == 0 and ix.state[slot] == 2:
                single._free_slot(slot)
        for t in tiers:
            assert t.leases_active == 0 and t.leased_bytes == 0
        assert list(batch.index.state) == list(single.index.state)
        assert batch.alloc.used == single.alloc.used < len(keys)  # the hidden ones' extents are free
        with pytest.raises(AssertionError):
            batch.unlease(held[:1])  # no lease is left to drop
    finally:
        for t in tiers:
            t.close()


def _segments(rng: random.Random) -> list[tuple[bytes, bytes]]:
    """(key, segment) pairs of every kind the restore meets."""
    out = []
    for layer in range(6):
        for role in (Role.KEY, Role.VALUE):
            x = rng.normalvariate(0, 1) * np.random.default_rng(layer).standard_normal(2048)
            x16 = x.astype(np.float16).reshape(16, 128)
            kb = pack_key(NS, b"c" * 16, layer, role)
            out.append((kb, raw_segment(x16, role=role, layer=layer, reason=RawReason.POLICY)))
            out.append((kb, encode_segment(x16, "fp8", role=role, layer=layer)))
            out.append((kb, encode_segment(x16.astype(ml_dtypes.bfloat16), "turboquant-4", role=role, layer=layer)))
            # ANS (its bytes need no nvCOMP here: only the header is checked), a payload length of its own each
            payload = rng.randbytes(rng.randrange(1, x16.nbytes))
            out.append((kb, pack_header(SegmentHeader(Format.ANS, np.dtype(np.float16), x16.nbytes, len(payload),
                                                      rng.getrandbits(32), role=role, layer=layer,
                                                      ans_type=AnsType.FLOAT16)) + payload))
    return out


def _outcome(kb: bytes, blob: bytes):
    try:
        return _verify_header(kb, blob)
    except SegmentError as e:
        return f"{type(e).__name__}: {e}"


def _check(pairs):
    heads = _header_rows([b for _, b in pairs])
    layers = np.asarray([int.from_bytes(kb[32:34], "little") for kb, _ in pairs])
    roles = np.asarray([kb[34] for kb, _ in pairs])
    ok, tid, templates = _verify_headers(heads, layers, roles, np.asarray([len(b) for _, b in pairs]))
    h = heads.view(HEADER_DTYPE).reshape(-1)
    for i, (kb, blob) in enumerate(pairs):
        want = _outcome(kb, blob)
        assert ok[i] == (not isinstance(want, str)), (i, want)
        if ok[i]:
            assert templates[tid[i]].__class__ is want.__class__
            assert header_of(templates[tid[i]], h[i]) == want
    return ok


def test_header_checks_of_a_batch_are_verify_header_of_each():
    rng = random.Random(11)
    good = _segments(rng)
    assert _check(good).all()
    bad = []
    for kb, blob in good:
        for at in range(HEADER_SIZE):  # every header byte, the CRCs among them
            b = bytearray(blob)
            b[at] ^= 1 << rng.randrange(8)
            bad.append((kb, bytes(b)))
        bad.append((pack_key(NS, b"c" * 16, int.from_bytes(kb[32:34], "little") + 1, kb[34]), blob))  # wrong key
        bad.append((kb[:34] + bytes([3 - kb[34]]) + kb[35:], blob))
        bad.append((kb, blob[:-1]))  # truncated payload, and a header cut short
        bad.append((kb, blob + b"\0"))
        bad.append((kb, blob[:40]))
    kb = pack_key(NS, b"c" * 16, 2, Role.KEY)
    from orbitkv_fs.segment import _crc32c

    for orig, stored in ((0, 0), (4096, 0), (4096, MAX_STORED_BYTES + 1)):  # empty, empty but not, too long
        b = bytearray(pack_header(SegmentHeader(Format.ANS, np.dtype(np.float16), orig, 1, 0, role=Role.KEY, layer=2,
                                                ans_type=AnsType.FLOAT16)))
        b[20:24] = stored.to_bytes(4, "little")  # a length pack_header refuses, signed as a writer could
        b[60:64] = _crc32c.crc32c(bytes(b[:60])).to_bytes(4, "little")
        bad.append((kb, bytes(b) + bytes(stored)))  # the payload its header claims
    mixed = good + bad
    rng.shuffle(mixed)
    ok = _check(mixed)
    assert 0 < ok.sum() < len(mixed)
    # A header whose own CRC is right but whose fields are not (re-signed corruptions): its template fails.
    from orbitkv_fs.segment import _crc32c

    resigned = []
    for kb, blob in good[:12]:
        for at in (4, 6, 7, 8, 15, 16, 20, 32, 33, 34, 40):
            b = bytearray(blob)
            b[at] ^= 0x5
            b[60:64] = _crc32c.crc32c(bytes(b[:60])).to_bytes(4, "little")
            resigned.append((kb, bytes(b)))
    _check(resigned)


def test_header_checks_group_by_bytes_when_the_mix_collides(monkeypatch):
    """The batch check groups headers on a 64-bit mix of their fixed bytes and compares each with its group's
    first: with a mix that sends every header to one group (a collision on every row), the groups come
    from the bytes themselves and every verdict still equals ``_verify_header`` 's."""
    from orbitkv_fs.manager import verify

    monkeypatch.setattr(verify, "_MIX", np.zeros(8, dtype=np.uint64))
    monkeypatch.setattr(verify, "_GROUPS", {})  # grouped here, not answered from an earlier test's batch
    rng = random.Random(5)
    good = _segments(rng)
    bad = []
    for kb, blob in good[::3]:
        for at in (0, 9, 16, 24, 33, 44, 60):
            b = bytearray(blob)
            b[at] ^= 1 << rng.randrange(8)
            bad.append((kb, bytes(b)))
    mixed = good + bad
    rng.shuffle(mixed)
    ok = _check(mixed)
    assert ok.sum() == len(good)
    assert len(verify._GROUPS) == 1  # the same batch again (its CRCs aside) is answered from the memo
    resigned = []
    for kb, blob in mixed:
        b = bytearray(blob)
        b[HEADER_DTYPE.fields["payload_crc"][1]] ^= 1  # another payload CRC: a header CRC mismatch, mostly
        resigned.append((kb, bytes(b)))
    assert _check(resigned).sum() < len(good) and len(verify._GROUPS) == 1  # each verdict _verify_header's


def test_size_fields_read_from_an_arena_and_header_fields():
    """read_sizes (a restore's size checks, compiled) against the parsed headers: each placed row's header bytes,
    its sizes, and whether its dtype, original length and extent fit, at offsets that are multiples of 64 and
    offsets that are not (multiples of 8, copied by words, and odd ones, copied by bytes); an extent whose header
    lies outside the arena raises and reads nothing."""
    rng = random.Random(2)
    segs = [b for _, b in _segments(rng)[:6]]
    nseg = 2  # 4 chunks: 8 rows, 6 of them placed
    rows = [0, 1, 2, 4, 6, 7]
    h0 = parse_header(segs[0])
    codes = np.asarray([header_fields(segs[:1])[0]["dtype"], 99], dtype=np.int64)  # 99: no dtype has it
    block_bytes = np.asarray([h0.original_length // 2, 1024], dtype=np.int64)
    nblocks = np.asarray([2, 2, 1, 2], dtype=np.int64)
    for shift in (0, 8, 3):  # offsets that are multiples of 64, of 8 only, of neither
        buf = np.zeros((1 << 16) + shift, dtype=np.uint8)
        offs, lens, pos = [], [], shift
        for i, b in enumerate(segs):
            buf[pos:pos + len(b)] = np.frombuffer(b, np.uint8)
            offs.append(pos)
            lens.append(len(b) - (i == 2))  # one extent shorter than its header says
            pos += -(-len(b) // 512) * 512
        at = np.asarray(rows, dtype=np.int64)
        fit, heads, sizes = read_sizes(buf, at, np.asarray(offs), np.asarray(lens), codes, block_bytes, nblocks)
        assert (heads[at] == _header_rows(segs)).all() and not heads[[3, 5]].any() and not sizes[[3, 5]].any()
        for k, (r, b) in enumerate(zip(rows, segs)):
            h, ci, si = parse_header(b), r // nseg, r % nseg
            code = header_fields([b])[0]["dtype"]
            assert fit[r] == (code == codes[si] and h.original_length == nblocks[ci] * block_bytes[si]
                              and lens[k] == HEADER_SIZE + h.stored_length), r
            assert sizes[r].tolist() == [h.stored_length, h.original_length, HEADER_SIZE + h.stored_length,
                                         lens[k], offs[k]]
        assert fit[0] and not fit[1] and not fit[[3, 5]].any()
        with pytest.raises(IndexError):
            read_sizes(buf, at, np.asarray(offs[:-1] + [len(buf) - HEADER_SIZE + 1]), np.asarray(lens), codes,
                       block_bytes, nblocks)
        with pytest.raises(IndexError):
            read_sizes(buf, at + 2, np.asarray(offs), np.asarray(lens), codes, block_bytes, nblocks)
    f = header_fields(segs + [b"short"])
    for row, b in zip(f[:-1], segs):
        h = parse_header(b)
        assert (row["original_length"], row["stored_length"], row["payload_crc"], row["layer"]) == \
            (h.original_length, h.stored_length, h.payload_crc, h.layer)
    assert f[-1]["magic"] == b""


class _Pipeline(RestorePipeline, Batching):
    """The restore pipeline's batch helpers on a DRAM tier, without a Manager around them."""

    def __init__(self, dram, budget: int, batch_segments: int, gpu: bool) -> None:
        self.dram = dram
        self._config = SimpleNamespace(storage_codec_budget=budget, batch_segments=batch_segments)
        self._gpu_codecs = object() if gpu else None


def _segs(n: int, block_bytes: int = 16 << 10) -> list:
    return [SimpleNamespace(block_bytes=block_bytes)] * n


def _chunks(n: int, blocks: int = 2) -> list:
    return [SimpleNamespace(blocks=list(range(blocks)))] * n


def test_early_head_is_the_first_batch_of_a_longer_restore_and_spans_join():
    """A restore's early first batch (``_start_early``) covers the chunks of its first batch of ``batch_segments``
    segments (whole chunks where the next would give it a quarter or less), or fewer where their decoded bytes
    reach the source cap first, only when the request holds more and the arena is pinned; the early parts are
    the first two batches' (``EARLY_BATCHES``) that leave a rest; a request leased in parts has the spans of
    one."""
    segs = _segs(72)
    chunks = _chunks(32)
    p = _Pipeline(SimpleNamespace(arena=SimpleNamespace(pinned=True)), 256 << 20, 512, True)
    assert p._early_head(chunks, segs) == 7  # 504 segments: the eighth chunk would give 8 of 512
    assert p._early_head(chunks[:7], segs) == 0  # one batch holds the whole request
    assert p._early_head(chunks, _segs(300)) == 2  # a batch of 512: 212 of the second chunk
    assert p._early_head(chunks, _segs(128)) == 4 and p._early_head(chunks, _segs(600)) == 1
    for nseg in range(1, 700):  # the head covers the first cut of a request of whole chunks
        count = 512 // nseg + 2
        nb = np.full(nseg * count, 1 << 10)
        head = p._early_head(_chunks(count), _segs(nseg, 1 << 9))
        _, j = next(p._cuts(nb, nb, 1, nseg))
        assert head * nseg >= j and (head - 1) * nseg < j, nseg
    # 4 MiB segments (two blocks of 2 MiB): the source cap, 4 flights of 127 MiB, ends the batch in the second chunk
    big = _segs(72, 2 << 20)
    assert p._early_head(chunks, big) == 2
    for nchunks, blocks in ((4, 2), (3, 1), (9, 5), (12, 1)):
        head = p._early_head(_chunks(nchunks, blocks), big)
        row = blocks * (2 << 20)
        nb = np.full(72 * nchunks, row)
        _, j = next(p._cuts(nb // 4, nb, 1, 72))  # stored bytes a quarter of the decoded: the cap cuts first
        if not head:  # one batch holds the whole request
            assert j == len(nb)
            continue
        assert head * 72 >= j and (head - 1) * 72 < j, (nchunks, blocks, head, j)
    assert p._early_head(chunks * 10, segs[:2]) == 256 and p._early_head(chunks, []) == 0  # one layer: K, V
    assert p._early_heads(chunks, segs) == [7, 14]
    assert p._early_heads(chunks[:14], segs) == [7] and p._early_heads(chunks[:8], segs) == [7]
    assert p._early_heads(chunks[:7], segs) == [] and p._early_heads(_chunks(4), big) == [2]
    p.dram.arena.pinned = False
    assert p._early_head(chunks, segs) == 0 and p._early_heads(chunks, segs) == []
    rng = np.random.default_rng(2)
    keys = [bytes([i]) * 36 for i in range(20)]
    hit = rng.random(20) < 0.7
    offs, lens = rng.integers(0, 1 << 30, 20), rng.integers(1, 1 << 20, 20)
    whole, a, b = Spans(), Spans(), Spans()
    whole.fill(keys, hit, offs[hit], lens[hit])
    a.fill(keys[:7], hit[:7], offs[:7][hit[:7]], lens[:7][hit[:7]])
    b.fill(keys[7:], hit[7:], offs[7:][hit[7:]], lens[7:][hit[7:]])
    j = a.joined(b)
    assert list(j.keys) == keys and len(j) == len(whole)
    for x, y in ((j.hit, whole.hit), (j.offs, whole.offs), (j.lens, whole.lens)):
        assert np.array_equal(x, y)
    assert all(j.get(k) == whole.get(k) for k in keys)


def _chunk_cuts(p, nb: list, lg: list, per: int, start: int) -> list:
    """A restore's batches of rows in chunks of ``per`` (from row ``start``), one row at a time: as
    ``_codec_batches`` (at most ``batch_segments``, the budget, the source cap), except that a batch closed at
    ``batch_segments`` inside a chunk that one batch holds whole, with a quarter of its rows or less from that
    chunk, ends before the chunk."""
    budget, most, cap = p._batch_budget(1), p._source_cap(), p._config.batch_segments
    out, i, n = [], 0, len(nb)
    while i < n:
        j, size, total = i, 0, 0
        while j < n and (j == i or (j - i < cap and size + nb[j] <= budget and total + lg[j] <= most)):
            size, total, j = size + nb[j], total + lg[j], j + 1
        if j - i == cap and j < n:
            c0 = j - (start + j) % per
            c1 = min(c0 + per, n)
            if i < c0 and 4 * (j - c0) <= j - i and c1 - c0 <= cap and sum(nb[c0:c1]) <= budget \
                    and sum(lg[c0:c1]) <= most:
                j = c0
        out.append(list(range(i, j)))
        i = j
    return out


@pytest.mark.parametrize("seed", range(4))
def test_cuts_are_codec_batches(seed):
    """``_cuts`` (a restore's batches, on the running sums) makes ``_codec_batches`` ' cuts, and with chunks of
    ``per`` rows from row ``start`` no batch cut at ``batch_segments`` splits a chunk for a sliver of it
    (:func:`_chunk_cuts`); a batch the bytes cut is not moved."""
    rng = random.Random(seed)
    aligned = 0
    for _ in range(80):
        p = _Pipeline(None, rng.choice([1 << 20, 4 << 20, 64 << 20]), rng.choice([1, 3, 8, 16, 256]),
                      rng.random() < 0.5)
        n = rng.randrange(1, 300)
        nb = [rng.choice([0, 1 << 10, 256 << 10, 1 << 20, 9 << 20]) for _ in range(n)]
        lg = [x * rng.choice([1, 2, 4, 9]) for x in nb]
        want = [[i for i, _, _ in b] for b in p._codec_batches(zip(range(n), nb, lg), lambda t: t[1], lambda t: t[2])]
        got = [list(range(i, j)) for i, j in p._cuts(np.asarray(nb), np.asarray(lg))]
        assert got == want
        per, start = rng.choice([1, 2, 5, 12, 72]), rng.randrange(0, 80)
        got = [list(range(i, j)) for i, j in p._cuts(np.asarray(nb), np.asarray(lg), 1, per, start)]
        assert got == _chunk_cuts(p, nb, lg, per, start)
        aligned += got != want
    assert aligned  # the chunks changed some cuts
    # the bench's shape: 32 chunks of 72 segments in batches of 512 are seven whole chunks each ...
    p = _Pipeline(None, 256 << 20, 512, True)
    ones = np.ones(32 * 72, dtype=np.int64)
    assert [j - i for i, j in p._cuts(ones, ones, 1, 72)] == [504] * 4 + [288]
    assert [j - i for i, j in p._cuts(ones[504:], ones[504:], 1, 72, 504)] == [504] * 3 + [288]
    # ... but batches the budget cuts (ANS's decoded bytes) are not: 230 rows fit, the last 14 of a chunk
    big = np.full(32 * 72, p._batch_budget(1) // 230, dtype=np.int64)
    assert {j - i for i, j in p._cuts(big, big, 1, 72)} == {230, 2304 % 230}


def test_device_batch_checks_are_the_per_segment_checks(tmp_path):
    """_check_device_batch (phase 1: size fields) then _verified_rows (a decode batch's headers as one
    array, in two cuts) and _row_items against what the restore's per-segment path decides for each segment: a header that passes
    _verify_header and fits its destination is decoded with exactly that header; one that fails
    _verify_header is a miss for its chunk with that reason (or goes to the per-segment path in phase 1); a
    valid header that does not fit goes to the per-segment path in phase 1 (a wrong request)."""
    rng = random.Random(9)
    dram = DramTier(8 << 20, shm_dir=str(tmp_path), pin=False)
    try:
        p = _Pipeline(dram, 4 << 20, 8, True)
        p.failures = 0
        p._add = lambda decode_failures=0: setattr(p, "failures", p.failures + decode_failures)
        segs = [SimpleNamespace(layer=layer, role=role, dtype_code=3, dtype=np.dtype(np.float16), block_bytes=2048)
                for layer in range(4) for role in (Role.KEY, Role.VALUE)]
        chunks = [ChunkBlocks(bytes([c]) * 16, [2 * c, 2 * c + 1]) for c in range(12)]
        keys = [[pack_key(NS, ch.key, s.layer, s.role) for s in segs] for ch in chunks]
        spans = {}
        for ci, ks in enumerate(keys):
            for s, kb in zip(segs, ks):
                x = np.random.default_rng(ci).standard_normal(2048).astype(np.float16)
                blob = bytearray(rng.choice([raw_segment(x, role=s.role, layer=s.layer, reason=RawReason.NONE),
                                             encode_segment(x, "fp8", role=s.role, layer=s.layer)]))
                what = rng.randrange(16)
                if what == 0:
                    blob[rng.randrange(HEADER_SIZE)] ^= 1 << rng.randrange(8)
                elif what == 1:
                    blob = blob[:-2]  # the extent is shorter than its header says
                if ci == 4 and s.layer == 0:
                    continue  # not in DRAM
                off = dram.reserve(len(blob))
                dram.view(off, len(blob))[:] = np.frombuffer(bytes(blob), np.uint8)
                dram.publish(kb, off, len(blob), 4096, 0)
                spans[kb] = (off, len(blob))
        chunks[5] = ChunkBlocks(chunks[5].key, [10, 11, 12])  # every segment of it too small for 3 blocks
        flat = [kb for ks in keys for kb in ks]
        hit = np.asarray([kb in spans for kb in flat])
        leased = Spans()
        leased.fill(flat, hit, np.asarray([spans[kb][0] for kb in flat if kb in spans], dtype=np.int64),
                    np.asarray([spans[kb][1] for kb in flat if kb in spans], dtype=np.int64))
        assert len(leased) == len(spans) and all(leased.get(kb) == spans.get(kb) for kb in flat)
        fit, heads, sizes = p._check_device_batch(chunks, segs, keys, leased)
        assert sum(fit) > len(fit) // 3
        truth = {}
        for ci, (ch, ks) in enumerate(zip(chunks, keys)):
            for si, (s, kb) in enumerate(zip(segs, ks)):
                r = ci * len(segs) + si
                if kb not in spans:
                    assert not fit[r]
                    with pytest.raises(SegmentError) as no:  # what the batch check reports for a row not there
                        _verify_header(kb, b"")
                    truth[(ci, si)] = no.value
                    continue
                blob = memoryview(dram.view(*spans[kb]))
                try:
                    h = _verify_header(kb, blob)
                    truth[(ci, si)] = h
                    fits = h.original_length == len(ch.blocks) * s.block_bytes and h.dtype == s.dtype
                except SegmentError as e:
                    truth[(ci, si)] = e
                    fits = None  # corrupt: caught in phase 1 or by the batch check
                if fits is not None:
                    assert fit[r] == fits, (ci, si)
                    if fits:
                        assert sizes[r].tolist() == [h.stored_length, h.original_length,
                                                     HEADER_SIZE + h.stored_length, spans[kb][1], spans[kb][0]]
        rows = _Rows.of(chunks, segs, keys, heads, sizes)
        n, nseg = len(fit), len(segs)
        failed = {k for k, v in truth.items() if isinstance(v, Exception)}
        bad: dict[int, str] = {}
        for i, j in ((0, n // 2), (n // 2, n)):
            got = p._verified_rows(rows, i, j, bad)
            for ci in {ci for ci, si in failed if i <= ci * nseg + si < j}:
                assert ci in bad
            want = [(ci, segs[si], truth[(ci, si)]) for r in range(i, j) for ci, si in [divmod(r, nseg)]
                    if (ci, si) not in failed and ci not in bad]
            if got is None:
                assert not want
                continue
            at, tid, templates = got
            items, ids = p._row_items(rows, at, tid, templates)
            assert [(ci, s, h) for ci, s, _, h, _ in items] == want
            assert [bytes(blob) for *_, blob in items] == [bytes(dram.view(*spans[keys[ci][si]]))
                                                           for r in at.tolist() for ci, si in [divmod(r, nseg)]]
            assert ids == {id(blob) for *_, blob in items}
        assert failed and p.failures == len(failed)
        for ci in {ci for ci, _ in failed}:  # the first failure of a chunk names the reason
            e = truth[(ci, min(sj for cj, sj in failed if cj == ci))]
            assert bad[ci] == f"corrupt: {type(e).__name__}: {e}"
    finally:
        dram.close()


def test_decode_batch_ends_give_back_workspace_and_fail_each_segment():
    """What ends a GPU decode batch (_decode_end for items, _rows_end for rows): an engine call that failed
    as a whole, or a collection that raised, fails every segment of the batch with that error; per-segment
    errors are reported with their chunk, segment and header; the decoded counts and bytes cover only the
    other segments; the workspace counted for the batch is given back whatever happened."""
    segs = [SimpleNamespace(layer=layer, role=role) for layer in range(2) for role in (Role.KEY, Role.VALUE)]
    chunks = [ChunkBlocks(bytes([c]) * 16, [c]) for c in range(2)]
    x = np.arange(1024, dtype=np.float16)
    blobs = [raw_segment(x, role=s.role, layer=s.layer, reason=RawReason.NONE) for _ in chunks for s in segs]
    heads = _header_rows(blobs)
    hs = [parse_header(b) for b in blobs]
    # per row: batch bytes, decoded, stored (header included), extent length, arena offset
    sizes = np.array([[h.stored_length, h.original_length, HEADER_SIZE + h.stored_length, len(b), 4096 * i]
                      for i, (h, b) in enumerate(zip(hs, blobs))], dtype=np.int64)
    rows = _Rows.of(chunks, segs, [[b""] * len(segs)] * len(chunks), heads, sizes)
    _, tid, templates = _verify_headers(heads, rows.layers, rows.roles, sizes[:, 3])
    at = np.arange(len(blobs))
    boom = RuntimeError("engine down")
    bad_crc = SegmentError("payload CRC32C mismatch")

    def finish(db):
        if db == "raise":
            raise boom
        return [bad_crc if i == 2 else None for i in range(len(blobs))], "event"

    p = _Pipeline(None, 4 << 20, 8, True)
    p._gpu_codecs = SimpleNamespace(decode_rows_finish=finish, decode_finish=finish)
    p.ws = 0
    p._workspace_delta = lambda n: setattr(p, "ws", p.ws + n)
    p._add_per_segment = lambda name, seconds, n: None
    items = [(ci, segs[si], chunks[ci], hs[ci * len(segs) + si], memoryview(b))
             for ci in range(len(chunks)) for si in range(len(segs)) for b in [blobs[ci * len(segs) + si]]]
    for db in (boom, "raise", "ok"):
        for end in ("rows", "items"):
            failed, totals = [], [0, 0, 0]
            p._workspace_delta(100)
            if end == "rows":
                ev = p._rows_end(rows, at, tid, templates, db, 100, 0.0, failed, totals)
            else:
                ev = p._decode_end(items, db, 100, int(sizes[:, 2].sum()), 0.0, failed, totals)
            assert p.ws == 0
            if db == "ok":
                assert ev == "event" and [(ci, s, h, e) for ci, s, _, h, e in failed] == [(0, segs[2], hs[2], bad_crc)]
                keep = [i for i in range(len(blobs)) if i != 2]
                assert totals == [len(keep), int(sizes[keep, 1].sum()), int(sizes[keep, 2].sum())]
            else:
                assert ev is None and totals == [0, 0, 0]
                assert [(ci, s, h) for ci, s, _, h, _ in failed] == [(i // len(segs), segs[i % len(segs)], hs[i])
                                                                   for i in range(len(blobs))]
                assert all(e is boom for *_, e in failed)
