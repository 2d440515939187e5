"""``orbitkv-inspect``: offline inspection of SSD tier shard files (no server, no GPU; reads with ``pread``:
blocks the disk cannot read are reported, not a crash).

It runs as the Manager's user: the shard's superblock holds the secret that every record's tag is checked
with (the same recovery scan as ``--ssd-recover``, :func:`orbitkv_fs.tiers.ssd.recovery.recover_shard`).

Commands (``--json`` on each prints one JSON document instead of text):

* ``summary FILE`` -- records, live vs dead bytes, formats, compression ratios, generations, bad records,
  the superblock's checkpoint and how the chain of records ends.
* ``list FILE`` -- one row per verified record: number, offset, kind, key, layer/role, format,
  original/stored length, status (valid, corrupt, torn), fate (live, superseded, invalidated, damaged,
  tombstone, stale), generation.
* ``verify FILE`` -- exit status 1, listing what is bad, when a record is corrupt or torn, a superblock
  copy does not verify, or the chain breaks at a record the checkpoint called durable.
* ``dump FILE --record N --out x.npy`` -- decode record N (its number in ``list``) with
  :func:`orbitkv_fs.codecs.decode_segment` and save the array. numpy has no bfloat16 or FP8 of its own
  (``np.load`` would return those as opaque ``|V2`` / ``|V1`` items), so they are saved as float32, which
  holds every such value exactly; float16 and integer segments keep their dtype. The source dtype is
  printed (and in ``--json``); ``orbitkv-qualify`` reads the float32 file back as the BF16 it was.

"Live" is what ``--ssd-recover`` would serve. Exit status: 0 fine, 1 ``verify`` found something bad or
``dump`` could not decode, 2 the file cannot be read as a shard file (missing, empty, garbage, no valid
superblock: also a shard of an older format): always a one-line error, never a traceback. A scan that
takes more than a moment shows a progress bar on stderr when stderr is a terminal
(:mod:`orbitkv_fs.progress`); output cut short by ``| head`` ends quietly.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from orbitkv_fs.console import HelpFormatter, entry_point
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.progress import progress
from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE, Kind, check_segment_body
from orbitkv_fs.tiers.ssd.recovery import (ChainEnd, Fate, RecordInfo, ShardFile, ShardRecovery, Status,
                                          recover_shard)
from orbitkv_fs.tiers.ssd.superblock import RING_START


class InspectError(OrbitKVError):
    """The file cannot be inspected as a shard file."""


@dataclass
class Record:
    number: int
    info: RecordInfo

    @property
    def live(self) -> bool:
        return self.info.fate is Fate.LIVE

    def row(self) -> dict[str, Any]:
        r = self.info
        h, s = r.header, r.segment
        seg = h.kind is Kind.SEGMENT
        return {
            "record": self.number,
            "offset": h.offset,
            "kind": h.kind.name.lower(),
            "status": r.status.value,
            "fate": r.fate.value,
            "live": self.live,
            "key": str(h.key) if seg else _tombstone_name(h),
            "layer": h.key.layer if seg and h.key else None,
            "role": h.key.role.name.lower() if seg and h.key else None,
            "generation": h.generation,
            "format": s.format.name.lower() if s else None,
            "original_length": s.original_length if s else None,
            "stored_length": s.stored_length if s else None,
            "record_length": h.record_length,
            "error": r.error or None,
        }


def _tombstone_name(h: Any) -> str:
    """``keys``, ``chunks`` or ``namespace:<hex>``: what a tombstone covers (its entries are in its body)."""
    ns = h.raw_key[:16]
    return f"{h.scope.name.lower()}:{ns.hex()}" if ns.strip(b"\0") else h.scope.name.lower()


def load(path: str) -> tuple[ShardRecovery, list[Record]]:
    """Scan ``path``; raise :class:`InspectError` when it is not a readable shard file."""
    if os.path.isdir(path):
        raise InspectError(f"{path}: is a directory")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InspectError(f"{path}: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < RING_START:
            raise InspectError(f"{path}: {size} bytes, too small to be a shard file (it starts with "
                               f"{RING_START} bytes of superblocks)")
        with progress(None, f"scanning {os.path.basename(path)}", "B") as bar:  # the scan knows its total
            rec = recover_shard(ShardFile(f.fileno(), size), on_progress=bar.update_to)
    if rec.superblock is None:
        raise InspectError(f"{path}: no valid superblock: not a shard file (or one of a format before version 2)")
    return rec, [Record(i, r) for i, r in enumerate(rec.records)]


def _chain(rec: ShardRecovery) -> dict[str, Any]:
    return {"end": rec.chain_end.value, "break_offset": rec.break_offset, "cut": rec.cut or None,
            "records": len(rec.chain), "head_generation": rec.head.generation if rec.head else None}


def summarize(path: str, rec: ShardRecovery, records: list[Record]) -> dict[str, Any]:
    by_format: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"records": 0, "original_bytes": 0,
                                                                           "stored_bytes": 0})
    live = dead = 0
    gens = [r.info.header.generation for r in records]
    status = collections.Counter(r.info.status.value for r in records)
    for r in records:
        h = r.info.header
        if r.live:
            live += h.record_length
            s = r.info.segment
            f = by_format[s.format.name.lower()]
            f["records"] += 1
            f["original_bytes"] += s.original_length
            f["stored_bytes"] += s.stored_length
        else:
            dead += h.record_length
    formats = {name: {**v, "compression_ratio": round(v["original_bytes"] / v["stored_bytes"], 4) if v["stored_bytes"] else None}
               for name, v in sorted(by_format.items())}
    sb = rec.superblock
    return {
        "file": path,
        "file_bytes": os.path.getsize(path),
        "shard": f"{sb.shard_index} of {sb.shard_count}",
        "capacity": sb.capacity,
        "checkpoint_generation": sb.checkpoint_generation,
        "floor": sb.floor,
        "superblock_copies_ok": [not e for e in rec.superblock_errors],
        "records": len(records),
        "valid": status.get("valid", 0),
        "corrupt": status.get("corrupt", 0),
        "torn": status.get("torn", 0),
        "tombstones": sum(r.info.header.kind is Kind.TOMBSTONE for r in records),
        "stale": sum(r.info.fate is Fate.STALE for r in records),
        "live_records": sum(r.live for r in records),
        "live_bytes": live,
        "dead_bytes": dead,
        "unverified_blocks": rec.unverified_blocks,
        "unreadable": [list(r) for r in rec.unreadable],
        "formats": formats,
        "chain": _chain(rec),
        "generation_min": min(gens) if gens else None,
        "generation_max": max(gens) if gens else None,
    }


def _problems(rec: ShardRecovery) -> list[str]:
    """What ``verify`` reports besides bad records: superblock copies, a broken chain."""
    out = [f"superblock copy {i}: {e}" for i, e in enumerate(rec.superblock_errors) if e]
    if rec.chain_end is ChainEnd.BREAK:
        out.append(f"chain breaks: the durable record at offset {rec.break_offset} is missing or damaged "
                   "(older records are not recovered)")
    if rec.cut:
        out.append(f"chain cut: {rec.cut}")
    out += [f"unreadable: {n} bytes at offset {o} (the disk failed to read them)" for o, n in rec.unreadable]
    return out


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'#':>6} {'offset':>12} {'status':8} {'fate':11} {'gen':>8} {'format':10} {'orig':>10} {'stored':>10}  key")
    for r in rows:
        print(f"{r['record']:>6} {r['offset']:>12} {r['status']:8} {r['fate']:11} {r['generation']:>8} "
              f"{r['format'] or '-':10} "
              f"{r['original_length'] if r['original_length'] is not None else '-':>10} "
              f"{r['stored_length'] if r['stored_length'] is not None else '-':>10}  "
              f"{r['key']}{'  ' + r['error'] if r['error'] else ''}")


def _dump(path: str, records: list[Record], number: int, out: str) -> dict[str, Any]:
    import numpy as np

    from orbitkv_fs.codecs import decode_segment

    if not 0 <= number < len(records):
        raise InspectError(f"{path}: no record {number} (the file has {len(records)})")
    rec = records[number].info
    h = rec.header
    if h.kind is not Kind.SEGMENT:
        raise InspectError(f"record {number} is a tombstone, not a segment")
    if rec.status is not Status.VALID:
        raise InspectError(f"record {number} is {rec.status.value}: {rec.error}")
    try:
        with open(path, "rb") as f:
            body = os.pread(f.fileno(), h.body_length, h.offset + RECORD_HEADER_SIZE)
    except OSError as e:
        raise InspectError(f"{path}: record {number} cannot be read: {e.strerror}") from None
    check_segment_body(h, body)
    arr = decode_segment(body)
    source = arr.dtype
    if source.type.__module__ == "ml_dtypes":  # bfloat16, float8_*: np.load knows none of them
        arr = arr.astype(np.float32)  # exact: float32 holds every value of these narrower formats
    np.save(out, arr)
    return {"record": number, "key": str(h.key), "out": out, "dtype": str(source),
            "saved_dtype": str(arr.dtype), "elements": int(arr.size)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-inspect", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("summary", "records, live/dead bytes, formats, ratios, generations, checkpoint"),
                        ("list", "one row per record"), ("verify", "exit 1 listing what is bad"),
                        ("dump", "decode one record into a .npy file (BF16/FP8 saved as float32, exactly)")):
        sp = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        sp.add_argument("file", help="an SSD tier shard file (--ssd-cache-path of orbitkv-cache-manager)")
        sp.add_argument("--json", action="store_true", help="print JSON")
        if name == "dump":
            sp.add_argument("--record", type=int, required=True, help="record number (as in `list`)")
            sp.add_argument("--out", required=True, help="output .npy path")
    return p


@entry_point("orbitkv-inspect")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rec, records = load(args.file)
        if args.cmd == "summary":
            doc: Any = summarize(args.file, rec, records)
            if not args.json:
                for k, v in doc.items():
                    print(f"{k:22} {json.dumps(v) if isinstance(v, (dict, list)) else v}")
        elif args.cmd == "list":
            doc = [r.row() for r in records]
            if not args.json:
                _print_rows(doc)
        elif args.cmd == "verify":
            bad = [r.row() for r in records if r.info.status is not Status.VALID]
            problems = _problems(rec)
            doc = {"file": args.file, "records": len(records), "bad": bad, "problems": problems,
                   "ok": not bad and not problems}
            if args.json:
                print(json.dumps(doc))
            else:
                if bad:
                    _print_rows(bad)
                for line in problems:
                    print(line)
                print(f"{args.file}: {len(records)} records, {len(bad)} bad, {len(problems)} other problems")
            return 0 if doc["ok"] else 1
        else:
            try:
                doc = _dump(args.file, records, args.record, args.out)
            except OrbitKVError as e:
                print(f"orbitkv-inspect: error: {e}", file=sys.stderr)
                return 1
            if not args.json:
                saved = "" if doc["saved_dtype"] == doc["dtype"] else f" (saved as {doc['saved_dtype']}, exactly)"
                print(f"record {doc['record']} ({doc['key']}): {doc['elements']} x {doc['dtype']} -> {doc['out']}{saved}")
        if args.json:
            print(json.dumps(doc))
        return 0
    except BrokenPipeError:
        raise  # stdout's reader went away: entry_point ends quietly
    except (InspectError, OSError) as e:
        print(f"orbitkv-inspect: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
