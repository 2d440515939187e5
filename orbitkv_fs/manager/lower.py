"""Coordination with the tier below DRAM (the SSD log): promotion, readahead, admission, invalidation,
flush and listing.

Primitives: :func:`demoter` (DRAM's eviction handed to the tier, a batch a call),
:meth:`LowerTierCoordination._promote_run` (a lookup's run read back in windows, the window's DRAM reserved
at once, each segment copied into it as it lands, a window published at once),
:meth:`~LowerTierCoordination._remember_prefix` / :meth:`~LowerTierCoordination._readahead` /
:meth:`~LowerTierCoordination._prefetched` (speculative prefetch of the chunks that followed a prefix),
:meth:`~LowerTierCoordination._checked_lower` / :meth:`~LowerTierCoordination._checked_header` (the
lower tier's bytes checked against their key), :meth:`~LowerTierCoordination._admit` (a verified segment
into DRAM), :meth:`~LowerTierCoordination.invalidate`, :meth:`~LowerTierCoordination.flush_dram`,
:meth:`~LowerTierCoordination.list_objects`.

State owned: ``_succ`` / ``_succ_lock`` (prefix memory), ``_inval_epoch``. Invariants: no lower-tier byte
is admitted without its header checked against the key (the tier checked every CRC); a prefetch that
raced an invalidation is not kept; an invalidation hides matching objects in both tiers.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import numpy as np

from ..access import AdminRequired, Caller, authorize
from ..errors import SegmentError
from ..keys import ObjectKey, segment_keys
from ..segment import HEADER_SIZE, SegmentHeader, parse_header
from ..tiers.dram import Demote
from .api import (FlushResult, InvalidateResult, LowerTier, ObjectInfo, ObjectPage, RequestError, TierCounts,
                  UnknownEngine)
from .leases import _Lease
from .registry import _Engine
from .verify import _REP_NAMES, _verify_header

log = logging.getLogger("orbitkv_fs.manager")


#: Segments a lookup reads from the lower tier in one batch (all in flight together).
_PROMOTE_WINDOW = 256


#: Seconds a DRAM flush may take in all (:meth:`LowerTierCoordination.flush_dram`).
FLUSH_TIMEOUT = 60.0

#: Chunks whose successors the prefetch remembers (about 100 bytes each).
_PREFIX_MEMORY = 1 << 16


def demoter(lower: LowerTier) -> Demote:
    """What DRAM's eviction calls with its victims' keys and views of their extents: the tier's
    ``submit_many`` (one copy of each segment, one lock round), or ``submit`` of a copy of each for a tier
    without it."""
    many = getattr(lower, "submit_many", None)
    if many is not None:
        return many

    def each(keys: list[ObjectKey], segments: list[memoryview]) -> int:
        return sum(bool(lower.submit(k, bytes(s))) for k, s in zip(keys, segments))

    return each


def _lower_listing(lower: LowerTier, match_chunk: Callable[[bytes], bool], after: bytes,
                   limit: int) -> list[tuple[bytes, int]]:
    """``(packed key, stored bytes)`` of the lower tier's objects after ``after`` of the chunks ``match_chunk``
    takes, sorted: the first ``limit`` at least, from the tier's ``listing`` (the SSD tier's: its own chunks'
    rows a page), or else all of ``iter_objects``, sorted."""
    paged = getattr(lower, "listing", None)
    if paged is not None:
        return paged(match_chunk, after=after, limit=limit)
    return sorted((kb, n) for kb, n in ((k.pack(), n) for k, n in lower.iter_objects())
                  if kb > after and match_chunk(kb[:32]))


def _lower_lengths(lower: LowerTier, keys: list[ObjectKey]) -> list[int | None]:
    """The segment length of each key the tier holds, None where it holds none: one ``describe`` (the SSD tier:
    one lock round, presence and size at once), else ``contains`` of each, 0 for a length not known before
    reading."""
    describe = getattr(lower, "describe", None)
    if describe is None:
        return [0 if have else None for have in _lower_contains(lower, keys)]
    return [None if d is None else d[1] for d in describe(keys)]


def _lower_contains(lower: LowerTier, keys: list[ObjectKey]) -> list[bool]:
    """The tier's ``contains`` of each key: its ``contains_many`` where it has one (the SSD tier: one lock round),
    else one call a key."""
    many = getattr(lower, "contains_many", None)
    return many(keys) if many is not None else [lower.contains(k) for k in keys]


class LowerTierCoordination:
    """The lower tier's promotion, prefetch, invalidation and flush."""

    def _promote_run(self, eng: _Engine, chunks: Sequence[bytes], pin: _Lease | None) -> int:
        """How many leading ``chunks`` the lower tier can complete: every segment DRAM lacks is held by the
        lower tier and reads back valid. Those segments are readmitted to DRAM where they fit; the rest a
        restore serves from the lower tier's bytes again, so a chunk counts whether or not DRAM could take
        it back (an arena full of leased or pinned objects). With ``pin`` the counted chunks are pinned
        (recorded in it). A segment the lower tier claimed but could not deliver (corrupt, I/O error) is a
        miss. Reads go out in windows of up to :data:`_PROMOTE_WINDOW` segments, all in flight together.

        A lookup answers the engine's scheduler, so the work per segment is per window where it can be: DRAM's
        membership and the tier's lengths asked once a chunk, the window's DRAM reserved in one round from
        those lengths (:meth:`_reserve_window`), each landed segment copied into its extent as it lands, and
        the window's segments published together once its reads are done."""
        counted = 0
        pos = 0
        while pos < len(chunks):
            window: list[tuple[bytes, list[bytes]]] = []  # (chunk, its keys DRAM lacks)
            wanted: list[ObjectKey] = []  # those keys as the tier takes them, window order
            lengths: list[int] = []  # their segment lengths as the tier tells them (0: not known)
            for c in chunks[pos:]:
                missing = self._dram_lacks(eng, c)
                objs = [ObjectKey.unpack(kb) for kb in missing]
                told = _lower_lengths(self.lower, objs)
                if None in told:
                    break
                window.append((c, missing))
                wanted += objs
                lengths += told  # type: ignore[arg-type]
                if len(wanted) >= _PROMOTE_WINDOW:
                    break
            if not window:
                break
            if pin is not None:
                # Pinned before the reads land, so the admissions below cannot evict each other.
                ncs = [eng.ns + c for c, _ in window]
                self.dram.pin_chunks(ncs)
                pin.chunks.extend(ncs)
            flat = [kb for _, m in window for kb in m]
            got: set[bytes] = set()
            landed: list[tuple[bytes, int, int, SegmentHeader]] = []  # reserved, copied, not yet published
            held = self._reserve_window(lengths)  # index -> (offset, length) of an extent reserved for it

            def admit(i: int, blob: "bytes | memoryview") -> None:
                # As each read lands, while the next ones are in flight: DRAM copies it into an extent of its
                # own (a segment of a chunk that then misses stays valid in DRAM, just not counted below).
                kb = flat[i]
                h = self._checked_header(kb, blob)
                if h is None:
                    return
                got.add(kb)
                extent = held.pop(i, None)
                if extent is not None and extent[1] == len(blob):
                    off: int | None = extent[0]
                    self.dram.view(extent[0], extent[1])[:] = np.frombuffer(blob, dtype=np.uint8)
                else:  # the tier had no size for it, or its record changed since: an extent of its own
                    if extent is not None:
                        self.dram.cancel(*extent)
                    off = self._copy_in(blob)
                if off is not None:
                    landed.append((kb, off, len(blob), h))

            try:
                self.lower.read_many(wanted, sink=admit)
            except BaseException:
                for _, off, n, _ in landed:
                    self.dram.cancel(off, n)
                raise
            finally:
                for extent in held.values():  # reserved for segments that did not land
                    self.dram.cancel(*extent)
            if landed:
                kbs, offs, lens, heads = zip(*landed)
                self.dram.publish_many(kbs, offs, lens, [h.original_length for h in heads],
                                       [int(h.format) for h in heads])
            if len(got) < len(flat):
                self._add(misses=len(flat) - len(got))
            good = 0
            for _, m in window:
                if any(kb not in got for kb in m):
                    break
                good += 1
            if pin is not None and good < len(window):
                bad = [eng.ns + c for c, _ in window[good:]]
                self.dram.unpin_chunks(bad)
                del pin.chunks[len(pin.chunks) - len(bad):]
            counted += good
            pos += good
            if good < len(window):
                break
        return counted

    def _reserve_window(self, lengths: Sequence[int]) -> dict[int, tuple[int, int]]:
        """DRAM extents for a promotion window's segments, reserved under one lock round from the lengths the
        lower tier told before reading (:func:`_lower_lengths`): ``{index: (offset, length)}``; none for a
        length not known (0), or where DRAM had no room (leased or pinned objects)."""
        sized = [(i, n) for i, n in enumerate(lengths) if n]
        offs = self.dram.reserve_many([n for _, n in sized])
        return {i: (off, n) for (i, n), off in zip(sized, offs) if off is not None}

    def _dram_lacks(self, eng: _Engine, chunk: bytes) -> list[bytes]:
        """The packed keys of ``chunk``'s segments that DRAM does not hold, in the engine's segment order (its
        membership asked once for the chunk)."""
        keys = segment_keys(eng.ns, chunk, eng.tails)
        return [kb for kb, have in zip(keys, self.dram.contains_many(keys)) if not have]

    def _remember_prefix(self, eng: _Engine, chunks: Sequence[bytes]) -> None:
        """Record which chunks follow which in a prefix (the order a save or lookup names them), for
        :meth:`_readahead`. Bounded: the oldest entries go past :data:`_PREFIX_MEMORY`."""
        n = self._config.ssd_prefetch_chunks
        if not n or len(chunks) < 2 or getattr(self.lower, "prefetch", None) is None:
            return
        with self._succ_lock:
            for i in range(len(chunks) - 1):
                k = eng.ns + chunks[i]
                self._succ[k] = tuple(chunks[i + 1:i + 1 + n])
                self._succ.move_to_end(k)
            while len(self._succ) > _PREFIX_MEMORY:
                self._succ.popitem(last=False)

    def _readahead(self, eng: _Engine, after: bytes, exclude: set[bytes]) -> None:
        """Speculative prefetch: the chunks that followed ``after`` in its prefix (up to
        ``ssd_prefetch_chunks``, not in ``exclude``: the request asked for those itself), their segments
        DRAM lacks, read on the lower tier's background lane (at most ``ssd_prefetch_bytes``) and admitted
        to DRAM as they land."""
        prefetch = getattr(self.lower, "prefetch", None)
        if prefetch is None or not self._config.ssd_prefetch_chunks:
            return
        with self._succ_lock:
            nxt = self._succ.get(eng.ns + after, ())
        keys = [ObjectKey.unpack(kb) for c in nxt if c not in exclude for kb in self._dram_lacks(eng, c)]
        if not keys:
            return
        epoch = self._inval_epoch
        try:
            prefetch(keys, lambda key, blob: self._prefetched(key, blob, epoch),
                     max_bytes=self._config.ssd_prefetch_bytes)
        except Exception as e:  # speculation must never fail the request that triggered it
            log.warning("SSD prefetch request failed: %s", e)

    def _prefetched(self, key: ObjectKey, blob: "bytes | memoryview", epoch: int) -> None:
        """A prefetched segment landed (on the lower tier's lane thread; the tier validated every CRC; ``blob``
        may be a view of the tier's read buffer, valid during the call): copy it into DRAM as a prefetched
        object, unless an invalidation ran since it was requested."""
        kb = key.pack()
        if self._inval_epoch != epoch or self._closed:
            return
        try:
            h = _verify_header(kb, blob)
        except SegmentError as e:
            log.warning("lower tier prefetched a bad segment for %s: %s", key, e)
            self._add(decode_failures=1)
            return
        if self._admit(kb, blob, h, prefetched=True) is None:
            return
        if self._inval_epoch != epoch:  # the invalidation may have swept DRAM before this publish
            self.dram.invalidate_keys([kb])
            return
        self._add(prefetch_segments=1, prefetch_bytes=len(blob))

    def _read_lower(self, kb: bytes) -> bytes | None:
        return self._checked_lower(kb, self.lower.read(ObjectKey.unpack(kb)))

    def _checked_lower(self, kb: bytes, blob: bytes | None, reasons: dict[bytes, str] | None = None) -> bytes | None:
        """``blob`` as read from the lower tier for ``kb`` once verified; None when absent or bad (then
        ``reasons[kb]`` says why)."""
        if blob is None or self._checked_header(kb, blob, reasons) is None:
            return None
        return blob

    def _checked_header(self, kb: bytes, blob: "bytes | memoryview",
                        reasons: dict[bytes, str] | None = None) -> SegmentHeader | None:
        """The header of a segment the lower tier read for ``kb``, checked against the key (the tier checked
        every CRC of the bytes); None when it is bad (then ``reasons[kb]`` says why). Counts the hit."""
        try:
            h = _verify_header(kb, blob)
        except SegmentError as e:
            log.warning("lower tier returned a bad segment for %s: %s", ObjectKey.unpack(kb), e)
            self._add(decode_failures=1)
            if reasons is not None:
                reasons[kb] = f"corrupt (lower tier): {type(e).__name__}: {e}"
            return None
        self._count(self._hits, "lower")
        return h

    def _admit(self, kb: bytes, blob: "bytes | memoryview", h: SegmentHeader | None = None, *,
               prefetched: bool = False) -> tuple[int, int] | None:
        """Copy a verified segment (``h``: its parsed header, when the caller has it) into DRAM and publish
        it; None when it did not fit or was present."""
        h = h or parse_header(blob)
        off = self._copy_in(blob)
        if off is None:
            return None
        return self.dram.publish(kb, off, len(blob), h.original_length, int(h.format), prefetched=prefetched)

    def _copy_in(self, blob: "bytes | memoryview") -> int | None:
        """Reserve a DRAM extent for ``blob`` and copy it there, unpublished: its offset, or None when DRAM has no
        room (leased or pinned objects)."""
        off = self.dram.reserve(len(blob))
        if off is not None:
            self.dram.view(off, len(blob))[:] = np.frombuffer(blob, dtype=np.uint8)
        return off

    def invalidate(self, *, keys: Sequence[ObjectKey] | None = None, chunks: Sequence[bytes] | None = None,
                   namespace: bytes | None = None, engine_id: str | None = None,
                   all: bool = False, caller: Caller | None = None) -> InvalidateResult:
        """Drop objects from every tier: exact ``keys``; ``chunks`` of ``engine_id`` or ``namespace``;
        everything of a namespace or an engine's namespace; or ``all``. Leased objects are hidden at once
        and freed when their leases drain. Answers per-tier object counts and stored bytes. With
        ``caller`` (an engine, not the operator) only ``engine_id`` (optionally narrowed to ``chunks``) of an
        engine the caller may act for: any other selector raises
        :class:`~orbitkv_fs.access.AdminRequired`."""
        if sum(x is not None for x in (keys, namespace, engine_id)) + bool(all) != 1:
            raise RequestError("invalidate needs exactly one of keys, namespace, engine_id or all")
        if namespace is not None and len(namespace) != 16:
            raise RequestError("a namespace is 16 bytes")
        if chunks is not None and namespace is None and engine_id is None:
            raise RequestError("chunks go with namespace or engine_id")
        if caller is not None and engine_id is None:
            raise AdminRequired("invalidating keys, a namespace or everything is an admin act (the admin "
                                "token); an engine invalidates its own namespace by its engine_id")
        if engine_id is not None:
            with self._lock:
                eng = self._engines.get(engine_id)
                if eng is None:
                    raise UnknownEngine(f"no engine {engine_id!r} is registered")
                if caller is not None:
                    authorize(engine_id, eng.secret, eng.owner_uid, False, caller)
                namespace = eng.ns
        with self._stat_lock:
            self._inval_epoch += 1  # before DRAM is swept: see _prefetched()
        lower = TierCounts()
        if keys is not None:
            d = self.dram.invalidate_keys(k.pack() for k in keys)
            if self.lower is not None:
                lower = self.lower.invalidate(keys=list(keys))
        elif namespace is not None and chunks is not None:
            d = self.dram.invalidate_chunks(namespace + c for c in chunks)
            if self.lower is not None:  # also chunks it no longer lists: a restart must not revive them
                lower = self.lower.invalidate(namespace=namespace, chunks=list(chunks))
        elif namespace is not None:
            d = self.dram.invalidate(lambda p: p[:16] == namespace)
            if self.lower is not None:
                lower = self.lower.invalidate(namespace=namespace)
        else:
            d = self.dram.invalidate(lambda p: True)
            if self.lower is not None:
                lower = self.lower.invalidate(all=True)
        return InvalidateResult(dram=TierCounts(*d), lower=lower)

    def flush_dram(self, timeout: float = FLUSH_TIMEOUT) -> FlushResult:
        """Demote every unleased DRAM object to the lower tier and wait for its writeback, for at most
        ``timeout`` seconds in all (a disk that stops answering must not hold the caller forever: past it,
        what the tier has no room for is dropped and the result says ``complete=False``); DRAM keeps nothing
        it could hand over (without a lower tier the objects are simply dropped)."""
        deadline = time.monotonic() + timeout
        sub = [0, 0]
        drop = [0, 0]
        late = False  # an object refused because the deadline ran out
        while True:  # in slices, so a flush never holds a copy of the whole pool
            objs, leased = self.dram.drain(64 << 20)
            if not objs:
                break
            for key, blob in objs:
                # A flush hands over everything at once: wait for room in the lane rather than drop.
                ok = self.lower is not None and self.lower.submit(key, blob,
                                                                  timeout=max(0.0, deadline - time.monotonic()))
                t = sub if ok else drop
                t[0] += 1
                t[1] += len(blob)
                late = late or (not ok and self.lower is not None and time.monotonic() >= deadline)
        if self.lower is not None:
            try:
                self.lower.flush(timeout=max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                late = True
        if late:
            log.warning("DRAM flush: the lower tier did not take and write back everything within %.0f s", timeout)
        return FlushResult(submitted=TierCounts(*sub), dropped=TierCounts(*drop), skipped_leased=leased,
                           complete=not late)

    def list_objects(self, namespace: bytes | None = None, prefix: str = "", limit: int = 1000,
                     cursor: str | None = None) -> ObjectPage:
        """Page through cached objects (DRAM, then the lower tier), in packed-key order; ``prefix`` is a
        hex prefix of the chunk key. Lower-tier rows carry format "", original length 0 and the tier's
        stored bytes (its listing does not read headers)."""
        if not 0 < limit <= 100_000:
            raise RequestError("limit must be in 1..100000")
        prefix = prefix.lower()
        if any(ch not in "0123456789abcdef" for ch in prefix):
            raise RequestError("prefix must be hex")
        tier, after = "dram", ""
        if cursor:
            tier, _, after = cursor.partition(":")
            if tier not in ("dram", "lower"):
                raise RequestError(f"bad cursor {cursor!r}")
        try:
            start = bytes.fromhex(after)
        except ValueError:
            raise RequestError(f"bad cursor {cursor!r}") from None
        out: list[ObjectInfo] = []
        last = ""

        def match_chunk(p: bytes) -> bool:
            return (namespace is None or p[:16] == namespace) and p[16:32].hex().startswith(prefix)

        if tier == "dram":
            rows = self.dram.listing(match_chunk, after=start, limit=limit + 1)
            for kb, rep, logical, length, gen in rows:
                if len(out) == limit:
                    return ObjectPage(out, f"dram:{last}")
                out.append(ObjectInfo(str(ObjectKey.unpack(kb)), "dram", _REP_NAMES[rep], logical,
                                      length - HEADER_SIZE, gen))
                last = kb.hex()
            start, last = b"", ""  # the lower tier's part starts at its first key: a page cut here says "lower:"
        if self.lower is not None:
            for kb, n in _lower_listing(self.lower, match_chunk, start, limit + 1 - len(out)):
                if len(out) == limit:
                    return ObjectPage(out, f"lower:{last}")
                out.append(ObjectInfo(str(ObjectKey.unpack(kb)), "lower", "", 0, n))
                last = kb.hex()
        return ObjectPage(out, None)
