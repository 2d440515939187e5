"""``orbitkv-inspect``: offline inspection of SSD tier shard files (no server, no GPU; reads via mmap).

Commands (``--json`` on each prints one JSON document instead of text):

* ``summary FILE`` -- records, live vs dead bytes, formats, compression ratios, generations, bad records.
* ``list FILE`` -- one row per record: number, offset, key, layer/role, format, original/stored length,
  status (valid, corrupt, torn), generation, live or dead.
* ``verify FILE`` -- exit status 1, listing the bad records, when anything is corrupt or torn.
* ``dump FILE --record N --out x.npy`` -- decode record N (its number in ``list``) with
  :func:`orbitkv_fs.codecs.decode_segment` and save the array. numpy has no bfloat16 or FP8 of its own
  (``np.load`` would return those as opaque ``|V2`` / ``|V1`` items), so they are saved as float32, which
  holds every such value exactly; float16 and integer segments keep their dtype. The source dtype is
  printed (and in ``--json``); ``orbitkv-qualify`` reads the float32 file back as the BF16 it was.

"Live" is the newest valid generation of each key, what ``--ssd-recover`` would serve; older valid
generations are "dead". Exit status: 0 fine, 1 ``verify`` found bad records or ``dump`` could not decode,
2 the file cannot be read as a shard file (missing, empty, garbage): always a one-line error, never a
traceback. A scan that takes more than a moment shows a progress bar on stderr when stderr is a terminal
(:mod:`orbitkv_fs.progress`); output cut short by ``| head`` ends quietly.
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from orbitkv_fs.console import HelpFormatter, entry_point
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.progress import progress
from orbitkv_fs.tiers.ssd.record import BLOCK, MAGIC, ScanEntry, Status, check_record, scan


class InspectError(OrbitKVError):
    """The file cannot be inspected as a shard file."""


@dataclass
class Record:
    number: int
    entry: ScanEntry
    live: bool

    def row(self) -> dict[str, Any]:
        e = self.entry
        h, s = e.header, e.segment
        return {
            "record": self.number,
            "offset": e.offset,
            "status": e.status.value,
            "live": self.live,
            "key": str(h.key) if h else None,
            "layer": h.key.layer if h else None,
            "role": h.key.role.name.lower() if h else None,
            "generation": h.generation if h else None,
            "format": s.format.name.lower() if s else None,
            "original_length": s.original_length if s else None,
            "stored_length": s.stored_length if s else None,
            "record_length": h.record_length if h else None,
            "error": e.error or None,
        }


def load(path: str) -> list[Record]:
    """Scan ``path``; raise :class:`InspectError` when it is not a readable shard file."""
    if os.path.isdir(path):
        raise InspectError(f"{path}: is a directory")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InspectError(f"{path}: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < BLOCK:
            raise InspectError(f"{path}: {size} bytes, too small to be a shard file (records are {BLOCK}-aligned)")
        try:
            image = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            raise InspectError(f"{path}: cannot map: {e}") from None
        with image:
            image.madvise(mmap.MADV_SEQUENTIAL)
            with progress(size - size % BLOCK, f"scanning {os.path.basename(path)}", "B") as bar:
                entries = list(scan(memoryview(image), progress=bar.update_to))
            if not entries and any(image[o:o + 4] != b"\0\0\0\0" for o in range(0, size - size % BLOCK, BLOCK)):
                raise InspectError(f"{path}: no OrbitKV-FS records ({MAGIC!r} blocks) found: not a shard file")
    newest: dict[Any, int] = {}
    for e in entries:
        if e.status is Status.VALID:
            newest[e.header.key] = max(newest.get(e.header.key, 0), e.header.generation)
    return [Record(i, e, e.status is Status.VALID and newest[e.header.key] == e.header.generation)
            for i, e in enumerate(entries)]


def summarize(path: str, records: list[Record]) -> dict[str, Any]:
    by_format: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"records": 0, "original_bytes": 0,
                                                                           "stored_bytes": 0})
    live = dead = 0
    gens = [r.entry.header.generation for r in records if r.entry.header]
    status = collections.Counter(r.entry.status.value for r in records)
    for r in records:
        e = r.entry
        length = e.header.record_length if e.header else BLOCK
        if r.live:
            live += length
            f = by_format[e.segment.format.name.lower()]
            f["records"] += 1
            f["original_bytes"] += e.segment.original_length
            f["stored_bytes"] += e.segment.stored_length
        else:
            dead += length
    formats = {name: {**v, "compression_ratio": round(v["original_bytes"] / v["stored_bytes"], 4) if v["stored_bytes"] else None}
               for name, v in sorted(by_format.items())}
    return {
        "file": path,
        "file_bytes": os.path.getsize(path),
        "records": len(records),
        "valid": status.get("valid", 0),
        "corrupt": status.get("corrupt", 0),
        "torn": status.get("torn", 0),
        "live_records": sum(r.live for r in records),
        "live_bytes": live,
        "dead_bytes": dead,
        "formats": formats,
        "generation_min": min(gens) if gens else None,
        "generation_max": max(gens) if gens else None,
    }


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'#':>6} {'offset':>12} {'status':8} {'live':4} {'gen':>8} {'format':10} {'orig':>10} {'stored':>10}  key")
    for r in rows:
        print(f"{r['record']:>6} {r['offset']:>12} {r['status']:8} {'yes' if r['live'] else 'no':4} "
              f"{r['generation'] if r['generation'] is not None else '-':>8} {r['format'] or '-':10} "
              f"{r['original_length'] if r['original_length'] is not None else '-':>10} "
              f"{r['stored_length'] if r['stored_length'] is not None else '-':>10}  "
              f"{r['key'] or '-'}{'  ' + r['error'] if r['error'] else ''}")


def _dump(path: str, records: list[Record], number: int, out: str) -> dict[str, Any]:
    import numpy as np

    from orbitkv_fs.codecs import decode_segment

    if not 0 <= number < len(records):
        raise InspectError(f"{path}: no record {number} (the file has {len(records)})")
    rec = records[number]
    if rec.entry.status is not Status.VALID:
        raise InspectError(f"record {number} is {rec.entry.status.value}: {rec.entry.error}")
    e = rec.entry
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as image:
        raw = image[e.offset:e.offset + e.header.record_length]  # a copy: no view outlives the map
    _, _, seg = check_record(raw)
    arr = decode_segment(seg)
    source = arr.dtype
    if source.type.__module__ == "ml_dtypes":  # bfloat16, float8_*: np.load knows none of them
        arr = arr.astype(np.float32)  # exact: float32 holds every value of these narrower formats
    np.save(out, arr)
    return {"record": number, "key": str(e.header.key), "out": out, "dtype": str(source),
            "saved_dtype": str(arr.dtype), "elements": int(arr.size)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-inspect", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("summary", "records, live/dead bytes, formats, ratios, generations"),
                        ("list", "one row per record"), ("verify", "exit 1 listing bad records"),
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
        records = load(args.file)
        if args.cmd == "summary":
            doc: Any = summarize(args.file, records)
            if not args.json:
                for k, v in doc.items():
                    print(f"{k:16} {json.dumps(v) if isinstance(v, dict) else v}")
        elif args.cmd == "list":
            doc = [r.row() for r in records]
            if not args.json:
                _print_rows(doc)
        elif args.cmd == "verify":
            bad = [r.row() for r in records if r.entry.status is not Status.VALID]
            doc = {"file": args.file, "records": len(records), "bad": bad, "ok": not bad}
            if not args.json:
                if bad:
                    _print_rows(bad)
                print(f"{args.file}: {len(records)} records, {len(bad)} bad")
            if args.json:
                print(json.dumps(doc))
            return 1 if bad else 0
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
