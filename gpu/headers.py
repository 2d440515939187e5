"""A save flight's headers, written by numba into the flight's output region in one call: per segment its
class's template row (a validated header with a zero payload CRC, ``segment.header_row``), its payload CRC,
for ANS its stored length, and its header CRC from the template's (``segment.header_crcs``' tables), plus
the fields the Manager admits the segment by. A numpy pass per field cost a flight of a few hundred segments
about 60 us of host time on the save's critical path (docs/results/2026-12-03-host-speed).

Primitives: :func:`write_headers` (also fields only, where the GPU wrote the headers); :func:`write_headers_model`
(what the GPU's ``okv_write_headers`` writes, made on the host with :func:`write_headers`: for tests and harnesses
without a GPU); :data:`HEADER_ROW_DTYPE` and :data:`ANS_ROW`, that kernel's rows (an ANS segment's slot and
stored length are the GPU's: its row names where ``okv_ans_pack`` put its payload length).

Invariants: the bytes are the ones ``segment.header_crcs`` and ``pack_header`` give (tests/test_gpu_headers.py
and test_gpu_descriptors.py compare them); nothing outside the segments' 64-byte header slots is written, and
nothing at all when a slot, template or place is out of range. Needs numpy and numba only.
"""

from __future__ import annotations

import numba
import numpy as np

from orbitkv_fs.header_rows import (
    FORMAT_AT,
    HEADER_CRC_AT,
    ORIGINAL_AT,
    PAYLOAD_CRC_AT,
    RAW_REASON_AT,
    STORED_AT,
    field_crc,
    u32_at,
)
from orbitkv_fs.segment import HEADER_SIZE, header_crc_tables

from .tables import finish_crc

_NO_STORED = np.zeros(0, np.uint32)

#: One row of ``okv_write_headers`` (``struct HeaderRow``, kernels/headers.cu): a segment's header slot (bytes
#: from the output region's start), its template, its Meta row and the payload bytes its CRC walked.
HEADER_ROW_DTYPE = np.dtype([("slot", "<u4"), ("tid", "<u4"), ("meta", "<u4"), ("walked", "<u4")])
#: ``walked`` of an ANS segment's row (``OKV_HEADER_ANS``): its ``slot`` is then the region offset of the u64
#: payload length ``okv_ans_pack`` wrote (zero: the segment failed and gets no header), its header's slot the one
#: that kernel left in its Meta row's ``pad0``, and its stored length (and walked bytes) that payload length.
ANS_ROW = 0xFFFFFFFF


@numba.njit(inline="always")
def _put32(b: np.ndarray, at: int, v: int) -> None:
    b[at] = v & 0xFF
    b[at + 1] = (v >> 8) & 0xFF
    b[at + 2] = (v >> 16) & 0xFF
    b[at + 3] = (v >> 24) & 0xFF


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _write(host: np.ndarray, templates: np.ndarray, bases: np.ndarray, tid: np.ndarray, pcrc: np.ndarray,
           slots: np.ndarray, idx: np.ndarray, stored: np.ndarray, t_pay: np.ndarray, t_sto: np.ndarray,
           fmt: np.ndarray, original: np.ndarray, length: np.ndarray, reason: np.ndarray, addr: np.ndarray,
           host_addr: int, write: bool) -> int:
    # int64 arithmetic throughout: the CRC words are 32-bit values held in int64 (numba's uint32 mixes promote)
    has_stored = stored.shape[0] > 0
    for j in range(tid.shape[0]):  # bounds first (boundscheck is off), so that a bad row writes nothing
        if not (0 <= slots[j] <= host.shape[0] - HEADER_SIZE and 0 <= tid[j] < templates.shape[0]
                and 0 <= idx[j] < fmt.shape[0]):
            return j
    for j in range(tid.shape[0]):
        t, s = tid[j], slots[j]
        n = u32_at(templates[t], STORED_AT)
        new = np.int64(stored[j]) if has_stored else n
        if write:
            p = np.int64(pcrc[j])
            host[s:s + HEADER_SIZE] = templates[t]
            crc = np.int64(bases[t]) ^ field_crc(t_pay, p) ^ field_crc(t_sto, n ^ new)
            _put32(host, s + STORED_AT, new)
            _put32(host, s + PAYLOAD_CRC_AT, p)
            _put32(host, s + HEADER_CRC_AT, crc)
        n = new
        i = idx[j]
        fmt[i] = templates[t, FORMAT_AT]
        original[i] = u32_at(templates[t], ORIGINAL_AT)
        length[i] = HEADER_SIZE + n
        reason[i] = templates[t, RAW_REASON_AT]
        addr[i] = host_addr + s
    return -1


def write_headers(host: np.ndarray, templates: np.ndarray, bases: np.ndarray, tid: np.ndarray,
                  pcrc: "np.ndarray | None", slots: np.ndarray, idx: np.ndarray, fields: "tuple[np.ndarray, ...]",
                  stored: "np.ndarray | None" = None) -> None:
    """Write segment ``j``'s header at byte ``slots[j]`` of ``host`` (uint8, contiguous): template row
    ``templates[tid[j]]`` (``(classes, 64)`` uint8) with payload CRC ``pcrc[j]`` and the header CRC from the
    template's CRC ``bases[tid[j]]``; ``stored`` (ANS: what nvCOMP made of each payload), each segment's stored
    length in place of its template's. ``fields``: the arrays ``(fmt, original, length, reason, addr)`` that get,
    at ``idx[j]``, the header's format, original length, header-and-payload length, raw reason and the host
    address of its first byte. ``pcrc`` None: the headers are in place already (the GPU wrote them,
    ``okv_write_headers``, ``stored`` then the lengths it wrote), and only ``fields`` are written: ``host`` is
    not touched.
    Raises IndexError, having written nothing, when a slot's header would not lie inside ``host``, a ``tid`` is
    not a template or an ``idx`` not a place in ``fields``."""
    write = pcrc is not None
    if not write:
        pcrc = _NO_STORED
    if not ((len(pcrc) == len(tid) or not write) and len(tid) == len(slots) == len(idx)
            and (stored is None or len(stored) == len(tid)) and all(len(f) == len(fields[0]) for f in fields)):
        raise ValueError("write_headers: the per-segment arrays (and the field arrays) differ in length")
    t_pay, t_sto = header_crc_tables()
    bad = _write(host, templates, bases, tid, pcrc.astype(np.uint32, copy=False), slots, idx,
           _NO_STORED if stored is None else stored.astype(np.uint32), t_pay, t_sto, *fields,
           host.ctypes.data, write)
    if bad >= 0:
        raise IndexError(f"header {bad}: slot {int(slots[bad])}, template {int(tid[bad])} or place {int(idx[bad])} "
                         f"out of range ({host.size} bytes, {len(templates)} templates, {len(fields[0])} places)")


def write_headers_model(region: np.ndarray, rows: np.ndarray, templates: np.ndarray, bases: np.ndarray) -> None:
    """What ``okv_write_headers`` (kernels/headers.cu) writes into an encode flight's output ``region`` (uint8,
    its Meta array first) for ``rows`` (:data:`HEADER_ROW_DTYPE`), made on the host: each row's payload CRC
    finished from its Meta.acc (:func:`~.tables.finish_crc`), then :func:`write_headers` in place; an
    :data:`ANS_ROW` row's length and slot read from the region as the kernel reads them (none written for a
    zero length or one over its template's). For tests and harnesses without a GPU; the kernel itself is
    checked against the host codecs on one (tests/test_gpu_engine.py)."""
    if not len(rows):
        return
    meta = region[:16 * (int(rows["meta"].max()) + 1)].view("<u4").reshape(-1, 4)
    slot, tid, walked = rows["slot"].astype(np.int64), rows["tid"].astype(np.intp), rows["walked"].astype(np.int64)
    stored = templates[tid, STORED_AT:STORED_AT + 4].copy().view("<u4").reshape(-1).astype(np.int64)
    ans = np.flatnonzero(walked == ANS_ROW)
    keep = np.ones(len(rows), dtype=bool)
    if len(ans):
        at = slot[ans]
        n = np.stack([region[a:a + 8] for a in at.tolist()]).view("<u8").reshape(-1).astype(np.int64)
        keep[ans] = (n > 0) & (n <= stored[ans])
        walked[ans], stored[ans] = n, n
        slot[ans] = meta[rows["meta"][ans], 2]
    k = np.flatnonzero(keep)
    n = len(k)
    scratch = (np.zeros(n, np.int16), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.uint8),
               np.zeros(n, np.int64))  # the admitted fields, which the model does not answer
    write_headers(region, templates, bases, tid[k], finish_crc(meta[rows["meta"][k], 0], walked[k]), slot[k],
                  np.arange(n), scratch, stored[k])
