"""CPU cost of the record checks themselves, per record (best of 7 x 20,000 calls, one thread): the header
pack with tag and CRC (every record written), the keyed tag alone, the header CRC32C alone (what a demand
read checks), the tag check (what recovery checks). Prints one JSON document."""

from __future__ import annotations

import json
import os
import sys
import timeit

import crc32c

from orbitkv_fs.keys import ObjectKey, chunk_key
from orbitkv_fs.segment import Role
from orbitkv_fs.tiers.ssd.record import (CRC_AT, NO_PREV, NO_TAG, RECORD_HEAD_BYTES, RECORD_HEADER_SIZE, TAG_AT, Kind,
                                         ShardKey, pack_record_header_into, verify_record_tag)


def main() -> int:
    key = ShardKey(os.urandom(32))
    buf = bytearray(8192)
    mv = memoryview(buf)
    packed = ObjectKey(b"x" * 16, chunk_key(1), 0, Role.KEY).pack()

    def pack() -> None:
        pack_record_header_into(buf, key, Kind.SEGMENT, packed, 5, 4000, 8192, NO_PREV, NO_TAG)

    pack()
    cases = {"write_header_tag_and_crc_us": pack,
             "tag_us": lambda: key.record_tag(mv[:TAG_AT], mv[RECORD_HEADER_SIZE:RECORD_HEAD_BYTES]),
             "header_crc_us": lambda: crc32c.crc32c(mv[:CRC_AT]),
             "verify_tag_us": lambda: verify_record_tag(mv, key)}
    out = {name: min(timeit.repeat(fn, number=20000, repeat=7)) / 20000 * 1e6 for name, fn in cases.items()}
    print(json.dumps({"command": " ".join(sys.argv), "load": os.getloadavg(), **out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
