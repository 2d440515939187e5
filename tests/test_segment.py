"""The segment header: round trips and every typed error, against the byte layout of docs/format.md.

Headers are forged here with the documented offsets (not with the module's own struct), so the tests
pin the on-disk layout as well as the parser. Hypothesis feeds random, mutated and CRC-correct forged
bytes: only :class:`SegmentError` subclasses may escape the parsers.
"""

from __future__ import annotations

import functools
import struct

import crc32c
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbitkv_fs import errors
from orbitkv_fs.codecs import decode_segment, encode_segment
from orbitkv_fs.errors import CodecUnavailable, SegmentError
from orbitkv_fs.segment import (
    HEADER_SIZE,
    MAX_SOURCE_BYTES,
    MAX_STORED_BYTES,
    AnsType,
    Format,
    RawReason,
    Role,
    SegmentHeader,
    aligned,
    build_segment,
    pack_header,
    pack_header_into,
    parse_header,
    parse_segment,
    peek_source,
    worth_keeping,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.float16, 4: BF16, 5: np.float32, 6: ml_dtypes.float8_e4m3fn,
               7: ml_dtypes.float8_e5m2, 8: np.uint16, 9: np.int16, 10: np.int32, 11: np.uint32,
               12: np.float64, 13: np.int64, 14: np.uint64}


def forge(*, magic=b"OKVS", version=1, fmt=0, flags=0, bits=0, role=0, head_dim=0, layer=0, sign_version=0,
          dtype=1, original=0, stored=0, payload_crc=0, seed=0, codec_version=1, ans_type=0, raw_reason=0,
          reserved=bytes(25), header_crc=None) -> bytes:
    """64 header bytes laid out as docs/format.md says, with a correct header CRC unless given."""
    body = (magic + struct.pack("<HBBBBHHBBIIIIBBB", version, fmt, flags, bits, role, head_dim, layer,
                                sign_version, dtype, original, stored, payload_crc, seed, codec_version,
                                ans_type, raw_reason) + reserved)
    assert len(body) == 60
    return body + struct.pack("<I", crc32c.crc32c(body) if header_crc is None else header_crc)


def forged_segment(payload: bytes, **fields) -> bytes:
    fields.setdefault("stored", len(payload))
    fields.setdefault("payload_crc", crc32c.crc32c(payload))
    return forge(**fields) + payload


def test_header_layout_matches_spec():
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float16)
    blob = encode_segment(x, "turboquant-4", role="key", layer=7)
    h = parse_header(blob)
    assert blob[:4] == b"OKVS" and len(blob) == HEADER_SIZE + h.stored_length
    assert struct.unpack_from("<H", blob, 4)[0] == 1
    assert blob[6] == Format.TURBOQUANT and blob[7] == 0 and blob[8] == 4 and blob[9] == Role.KEY
    assert struct.unpack_from("<HHBB", blob, 10) == (32, 7, 1, 3)
    assert struct.unpack_from("<IIII", blob, 16) == (4096, h.stored_length, crc32c.crc32c(blob[64:]), 0)
    assert blob[32:35] == bytes([1, 0, 0]) and blob[35:60] == bytes(25)
    assert struct.unpack_from("<I", blob, 60)[0] == crc32c.crc32c(blob[:60])
    assert forge(fmt=3, bits=4, role=1, head_dim=32, layer=7, sign_version=1, dtype=3, original=4096,
                 stored=h.stored_length, payload_crc=h.payload_crc) == blob[:64]


@pytest.mark.parametrize("code,dtype", sorted(DTYPE_CODES.items()))
def test_raw_round_trip_every_dtype_code(code, dtype):
    x = (np.arange(24) % 7).astype(dtype)
    blob = encode_segment(x, "none", layer=3)
    assert blob[15] == code
    h, payload = parse_segment(blob)
    assert (h.format, h.dtype, h.layer, h.original_length) == (Format.RAW, np.dtype(dtype), 3, x.nbytes)
    assert bytes(payload) == x.tobytes()
    y = decode_segment(blob)
    assert y.dtype == np.dtype(dtype) and y.tobytes() == x.tobytes()


def test_build_and_parse_round_trip_every_format():
    cases = [
        (SegmentHeader(Format.RAW, np.dtype(np.uint8), 10, 0, 0, raw_reason=RawReason.NOT_SMALLER), bytes(range(10))),
        (SegmentHeader(Format.FP8, BF16, 20, 0, 0, bits=8, layer=65535, role=Role.VALUE), bytes(10)),
        (SegmentHeader(Format.TURBOQUANT, BF16, 256, 0, 0, role=Role.VALUE, bits=3, head_dim=64,
                       sign_version=1, rotation_seed=0xFFFFFFFF), bytes(2 * 28)),
        (SegmentHeader(Format.ANS, np.dtype(np.float16), 8192, 0, 0, ans_type=AnsType.FLOAT16), b"\x01" * 100),
    ]
    for h, payload in cases:
        blob = build_segment(h, payload)
        got, view = parse_segment(blob)
        assert bytes(view) == payload
        assert got.stored_length == len(payload) and got.payload_crc == crc32c.crc32c(payload)
        for field in ("format", "dtype", "original_length", "role", "layer", "bits", "head_dim",
                      "sign_version", "rotation_seed", "ans_type", "raw_reason"):
            assert getattr(got, field) == getattr(h, field), field
        assert parse_header(memoryview(bytearray(blob))) == got
        assert got.nbytes == len(blob)


def test_trailing_padding_allowed_only_when_not_exact():
    blob = encode_segment(np.arange(8, dtype=np.uint8), "none") + bytes(7)
    with pytest.raises(errors.LengthMismatch):
        parse_segment(blob)
    h, payload = parse_segment(blob, exact=False)
    assert bytes(payload) == bytes(range(8))


def expect(exc: type[SegmentError], blob: bytes) -> None:
    """``blob`` raises exactly ``exc`` from parse_segment and decode_segment."""
    for fn in (parse_segment, decode_segment):
        with pytest.raises(SegmentError) as info:
            fn(blob)
        assert type(info.value) is exc, (fn.__name__, info.value)


def test_bad_magic():
    expect(errors.BadMagic, forged_segment(b"", magic=b"OKVT"))
    expect(errors.BadMagic, b"\x00" * 64)


def test_unsupported_version():
    expect(errors.UnsupportedVersion, forged_segment(b"", version=2))
    expect(errors.UnsupportedVersion, forged_segment(b"", version=0))


@pytest.mark.parametrize("n", [0, 1, 4, 63])
def test_truncated_header(n):
    expect(errors.TruncatedSegment, forged_segment(b"abc", fmt=0, original=3)[:n])


def test_truncated_payload():
    blob = forged_segment(b"abcdefgh", original=8)
    expect(errors.TruncatedSegment, blob[:-1])
    expect(errors.TruncatedSegment, blob[:64])


def test_huge_declared_length_is_checked_before_use():
    # A header that claims the maximal payload but carries none: a truncation, found without allocating.
    expect(errors.TruncatedSegment, forge(original=MAX_STORED_BYTES, stored=MAX_STORED_BYTES))
    expect(errors.LengthMismatch, forge(original=0xFFFFFFFF, stored=0xFFFFFFFF))


def test_header_crc_mismatch():
    blob = bytearray(forged_segment(b"abcd", original=4))
    blob[60] ^= 1
    expect(errors.HeaderChecksumMismatch, bytes(blob))
    blob = bytearray(forged_segment(b"abcd", original=4))
    blob[13] ^= 0x80  # layer byte, CRC not recomputed
    expect(errors.HeaderChecksumMismatch, bytes(blob))


def test_payload_crc_mismatch():
    blob = bytearray(forged_segment(b"abcd", original=4))
    blob[-1] ^= 0x10
    expect(errors.PayloadChecksumMismatch, bytes(blob))
    expect(errors.PayloadChecksumMismatch, forged_segment(b"abcd", original=4, payload_crc=0))
    h, _ = parse_segment(bytes(blob), verify_crc=False)
    assert h.original_length == 4


@pytest.mark.parametrize("fields,payload", [
    (dict(original=5), b"abcd"),  # raw: stored != original
    (dict(dtype=3, original=3), b"abc"),  # not whole items
    (dict(fmt=2, bits=8, dtype=4, original=10), b"abcd"),  # fp8: stored != original / 2
    (dict(fmt=3, bits=4, role=1, head_dim=32, sign_version=1, dtype=4, original=64), b"x" * 17),
    (dict(fmt=3, bits=4, role=2, head_dim=32, sign_version=1, dtype=4, original=65), b"x" * 20),
    (dict(fmt=1, ans_type=1, original=64), b""),  # ans with an empty payload
    (dict(fmt=2, bits=8, dtype=4, original=MAX_SOURCE_BYTES + 2, stored=MAX_SOURCE_BYTES // 2 + 1), b""),
    (dict(original=MAX_STORED_BYTES + 1, stored=MAX_STORED_BYTES + 1), b""),
    (dict(fmt=1, ans_type=1, original=1024, stored=MAX_STORED_BYTES + 1), b""),
])
def test_lengths_that_do_not_add_up_or_exceed_bounds(fields, payload):
    expect(errors.LengthMismatch, forged_segment(payload, **fields))


@pytest.mark.parametrize("fields", [
    dict(fmt=4), dict(fmt=255), dict(dtype=0), dict(dtype=15), dict(role=3), dict(ans_type=4),
    dict(raw_reason=7), dict(flags=1), dict(codec_version=2), dict(codec_version=0),
    dict(reserved=b"\x01" + bytes(24)), dict(bits=8),  # raw with codec parameters
    dict(fmt=2, bits=8, dtype=5, original=8, stored=4),  # fp8 from float32
    dict(fmt=2, bits=4, dtype=4, original=8, stored=4),
    dict(fmt=2, bits=8, dtype=4, original=8, stored=4, raw_reason=1),  # encoded with a raw reason
    dict(fmt=3, bits=5, role=1, head_dim=32, sign_version=1, dtype=4, original=64, stored=22),
    dict(fmt=3, bits=4, role=1, head_dim=48, sign_version=1, dtype=4, original=96, stored=26),
    dict(fmt=3, bits=4, role=0, head_dim=32, sign_version=1, dtype=4, original=64, stored=18),
    dict(fmt=3, bits=4, role=1, head_dim=32, sign_version=2, dtype=4, original=64, stored=18),
    dict(fmt=1, ans_type=0, original=8, stored=8),
])
def test_unknown_format_and_parameters(fields):
    fields.setdefault("original", 0)
    payload = b"p" * fields.get("stored", fields["original"])
    expect(errors.UnknownFormat, forged_segment(payload, **fields))


def test_errors_are_distinct_subclasses_of_one_base():
    kinds = [errors.BadMagic, errors.UnsupportedVersion, errors.TruncatedSegment, errors.LengthMismatch,
             errors.UnknownFormat, errors.HeaderChecksumMismatch, errors.PayloadChecksumMismatch]
    assert len(set(kinds)) == len(kinds)
    assert all(issubclass(k, SegmentError) and issubclass(k, errors.OrbitKVError) for k in kinds)
    assert not any(issubclass(a, b) for a in kinds for b in kinds if a is not b)


def test_pack_header_refuses_invalid_fields():
    with pytest.raises(errors.LengthMismatch):
        pack_header(SegmentHeader(Format.RAW, np.dtype(np.uint8), 4, 5, 0))
    with pytest.raises(errors.UnknownFormat):
        pack_header(SegmentHeader(Format.FP8, np.dtype(np.float32), 8, 4, 0, bits=8))


def test_pack_header_into_writes_the_same_bytes_in_place():
    h = SegmentHeader(Format.FP8, BF16, 4096, 2048, 0xDEADBEEF, bits=8, layer=7, role=Role.KEY)
    buf = np.full(3 * HEADER_SIZE, 0xAB, dtype=np.uint8)
    pack_header_into(h, buf, HEADER_SIZE)
    assert bytes(buf[HEADER_SIZE:2 * HEADER_SIZE]) == pack_header(h)
    assert (buf[:HEADER_SIZE] == 0xAB).all() and (buf[2 * HEADER_SIZE:] == 0xAB).all()  # nothing else touched
    with pytest.raises(errors.LengthMismatch):  # validated like pack_header
        pack_header_into(SegmentHeader(Format.RAW, np.dtype(np.uint8), 4, 5, 0), buf)


def test_peek_source_reads_the_size_fields_unverified():
    h = SegmentHeader(Format.RAW, BF16, 4096, 4096, 0, layer=3)
    blob = bytearray(build_segment(h, bytes(4096)))
    assert peek_source(blob) == (4, 4096)  # bfloat16's code, the original length
    assert peek_source(memoryview(blob)[:HEADER_SIZE - 1]) is None
    blob[17] ^= 0x10  # a corrupt length: peek reports it as is, parse_header refuses it
    assert peek_source(blob) == (4, 4096 ^ 0x1000)
    with pytest.raises(errors.HeaderChecksumMismatch):
        parse_header(blob)


def test_worth_keeping_is_the_aligned_one_eighth_rule():
    assert aligned(1) == 512 and aligned(512) == 512 and aligned(513) == 1024
    # 8 raw blocks of 512 -> keep at 7 blocks, not at 8.
    assert worth_keeping(8 * 512 - 64, 7 * 512 - 64)
    assert not worth_keeping(8 * 512 - 64, 7 * 512 - 63)
    assert not worth_keeping(100, 1)  # both fit one block: nothing saved


# --- property tests: nothing but SegmentError, whatever the bytes -------------------------------------

def _only_segment_errors(blob: bytes) -> None:
    for fn in (parse_header, parse_segment, decode_segment):
        try:
            fn(blob)
        except CodecUnavailable:
            # decode of a well-formed ans segment on a machine without the GPU stack: not a byte error
            assert fn is decode_segment and parse_header(blob).format == Format.ANS
        except SegmentError:
            pass


PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_segment_errors(blob):
    _only_segment_errors(blob)


@PROPERTY
@given(st.binary(max_size=300))
def test_random_bytes_after_magic(blob):
    _only_segment_errors(b"OKVS\x01\x00" + blob)


def _valid_segments() -> list[bytes]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(BF16)
    return [encode_segment(x, "none"), encode_segment(x, "fp8"), encode_segment(x, "turboquant-3", role="key"),
            encode_segment(x, "turboquant-4", role="value", layer=9), encode_segment(x[:1], "fp8")]


VALID = _valid_segments()


@PROPERTY
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
       st.integers(-80, 80))
def test_mutated_segments_raise_only_segment_errors(blob, flips, resize):
    b = bytearray(blob)
    for pos, val in flips:
        b[pos % len(b)] = val
    if resize < 0:
        del b[resize:]
    else:
        b += bytes(resize)
    _only_segment_errors(bytes(b))


@functools.cache
def _primed():
    """A HeaderTemplates that has parsed every VALID header (so its cache answers their look-alikes)."""
    from orbitkv_fs.segment import HeaderTemplates

    t = HeaderTemplates()
    for v in VALID:
        t.parse(v)
    return t


def _outcome(parse, b: bytes):
    try:
        return parse(b)
    except SegmentError as e:
        return type(e)


@PROPERTY
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 63), st.integers(0, 255)), max_size=4),
       st.booleans(), st.integers(-70, 0))
def test_header_templates_parse_as_parse_header(blob, flips, fix_crc, cut):
    """Mutated headers (the header CRC made right again or not, maybe truncated): the cached parse
    answers exactly parse_header's header or error type."""
    b = bytearray(blob[:HEADER_SIZE])
    for pos, val in flips:
        b[pos] = val
    if fix_crc:
        struct.pack_into("<I", b, 60, crc32c.crc32c(bytes(b[:60])))
    b = bytes(b[:len(b) + cut] if cut else b)
    assert _outcome(_primed().parse, b) == _outcome(parse_header, b)


@st.composite
def forged_valid_crc(draw):
    """Consistent headers of every format with random payload bytes and both CRCs correct, then maybe
    one field replaced by a random value: exercises the field checks and the decoders on garbage."""
    fmt = draw(st.sampled_from([Format.RAW, Format.FP8, Format.TURBOQUANT, Format.ANS]))
    n = draw(st.integers(0, 12))
    fields: dict = dict(fmt=int(fmt), dtype=draw(st.sampled_from([3, 4])), layer=draw(st.integers(0, 65535)))
    if fmt == Format.RAW:
        fields["dtype"] = draw(st.sampled_from(sorted(DTYPE_CODES)))
        payload = draw(st.binary(max_size=200))
        payload = payload[: len(payload) // np.dtype(DTYPE_CODES[fields["dtype"]]).itemsize
                          * np.dtype(DTYPE_CODES[fields["dtype"]]).itemsize]
        fields["original"] = len(payload)
    elif fmt == Format.FP8:
        payload = draw(st.binary(max_size=200))
        fields.update(bits=8, original=2 * len(payload))
    elif fmt == Format.TURBOQUANT:
        d, bits, role = draw(st.sampled_from([32, 64, 128, 256])), draw(st.sampled_from([3, 4])), draw(st.sampled_from([1, 2]))
        record = (2 if role == 1 else 4) + d * bits // 8
        payload = draw(st.binary(min_size=n * record, max_size=n * record))
        fields.update(bits=bits, head_dim=d, role=role, sign_version=1, original=n * d * 2,
                      seed=draw(st.integers(0, 2**32 - 1)))
    else:
        payload = draw(st.binary(min_size=1, max_size=200))
        fields.update(ans_type=draw(st.integers(1, 3)), original=draw(st.integers(0, MAX_SOURCE_BYTES // 2)) * 2)
    if draw(st.booleans()):
        name = draw(st.sampled_from(["fmt", "flags", "bits", "role", "head_dim", "sign_version", "dtype",
                                     "original", "stored", "codec_version", "ans_type", "raw_reason"]))
        fields[name] = draw(st.integers(0, 2**32 - 1 if name in ("original", "stored") else 255))
    return forged_segment(payload, **fields)


@PROPERTY
@given(forged_valid_crc())
def test_forged_headers_with_valid_crcs_raise_only_segment_errors(blob):
    _only_segment_errors(blob)


@pytest.mark.parametrize("role,record", [(1, 34), (2, 36)])
def test_forged_turboquant_garbage_payload_decodes_without_crashing(role, record):
    # A valid header over arbitrary payload bytes (FP16 norms/scales that are inf or NaN included):
    # decode returns an array of the declared size; the CRC, not the decoder, is what rejects garbage.
    n = 15
    payload = (bytes(range(256)) * 3)[: n * record]
    blob = forged_segment(payload, fmt=3, bits=4, role=role, head_dim=64, sign_version=1, dtype=4,
                          original=n * 128)
    y = decode_segment(blob)
    assert y.dtype == BF16 and y.size == n * 64


# --- the documented constants, codes and bytes, as literals (a test that reads the module's own constant
# would move with it) -----------------------------------------------------------------------------------

GOLDEN_HEADERS = [
    (SegmentHeader(Format.TURBOQUANT, BF16, 4096, 1056, 0x11223344, role=Role.KEY, layer=0x0507, bits=4,
                   head_dim=128, sign_version=1, rotation_seed=0xCAFEBABE),
     "4f4b5653010003000401800007050104001000002004000044332211bebafeca"
     "01000000000000000000000000000000000000000000000000000000c507dfa5"),
    (SegmentHeader(Format.ANS, np.dtype(np.float16), 4096, 1000, 0x55667788, role=Role.VALUE, layer=2,
                   ans_type=AnsType.FLOAT16),
     "4f4b565301000100000200000200000300100000e80300008877665500000000"
     "010200000000000000000000000000000000000000000000000000004774121e"),
    (SegmentHeader(Format.RAW, np.dtype(np.float32), 64, 64, 0x99AABBCC, role=Role.OPAQUE, layer=1,
                   raw_reason=RawReason.POLICY),
     "4f4b56530100000000000000010000054000000040000000ccbbaa9900000000"
     "01000600000000000000000000000000000000000000000000000000b1974dae"),
]


@pytest.mark.parametrize("h,golden", GOLDEN_HEADERS)
def test_golden_header_bytes(h, golden):
    assert pack_header(h) == bytes.fromhex(golden)
    assert parse_header(bytes.fromhex(golden)) == h


def test_on_disk_codes_are_the_documented_numbers():
    assert {m.name: m.value for m in Format} == {"RAW": 0, "ANS": 1, "FP8": 2, "TURBOQUANT": 3}
    assert {m.name: m.value for m in Role} == {"OPAQUE": 0, "KEY": 1, "VALUE": 2}
    assert {m.name: m.value for m in AnsType} == {"NONE": 0, "BYTES": 1, "FLOAT16": 2, "FP8": 3}
    assert {m.name: m.value for m in RawReason} == {"NONE": 0, "NOT_SMALLER": 1, "TOO_LARGE": 2, "OUT_OF_RANGE": 3,
                                                    "NONFINITE": 4, "UNSUPPORTED": 5, "POLICY": 6}
    for code, reason in enumerate(["NONE", "NOT_SMALLER", "TOO_LARGE", "OUT_OF_RANGE", "NONFINITE", "UNSUPPORTED",
                                   "POLICY"]):
        assert parse_header(forge(raw_reason=code)).raw_reason.name == reason
    for code, dt in DTYPE_CODES.items():
        assert parse_header(forge(dtype=code)).dtype == np.dtype(dt)


def test_documented_limits():
    assert (HEADER_SIZE, MAX_SOURCE_BYTES, MAX_STORED_BYTES) == (64, 16 << 20, 32 << 20)
    # Every segment stores at most 32 MiB; encoded ones cover at most 16 MiB of source.
    assert parse_header(forge(original=33_554_432, stored=33_554_432)).stored_length == 33_554_432
    expect(errors.LengthMismatch, forge(original=33_554_433, stored=33_554_433))
    expect(errors.LengthMismatch, forge(fmt=1, ans_type=1, original=1024, stored=33_554_433))
    fp8 = dict(fmt=2, bits=8, dtype=4)
    assert parse_header(forge(**fp8, original=16_777_216, stored=8_388_608)).original_length == 16_777_216
    expect(errors.LengthMismatch, forge(**fp8, original=16_777_218, stored=8_388_609))


def test_worth_keeping_at_the_one_eighth_boundary():
    assert aligned(0) == 0 and aligned(1024) == 1024 and aligned(1025) == 1536
    # 72 raw blocks: 63 is exactly one eighth less (kept), 64 saves one ninth only (not kept).
    assert worth_keeping(72 * 512 - 64, 63 * 512 - 64)
    assert not worth_keeping(72 * 512 - 64, 64 * 512 - 64)
    assert worth_keeping(16 * 512 - 64, 14 * 512 - 64) and not worth_keeping(16 * 512 - 64, 15 * 512 - 64)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_turboquant_head_dims(head_dim):
    rec = 2 + head_dim * 4 // 8  # a key vector at 4 bits
    h = parse_header(forge(fmt=3, bits=4, role=1, head_dim=head_dim, sign_version=1, dtype=4, original=2 * head_dim,
                           stored=rec))
    assert (h.head_dim, h.stored_length) == (head_dim, rec)
    expect(errors.UnknownFormat, forge(fmt=3, bits=4, role=1, head_dim=2 * head_dim + 1, sign_version=1, dtype=4,
                                       original=2 * (2 * head_dim + 1), stored=2 + (2 * head_dim + 1) // 2))


def test_header_templates_keep_up_to_their_limit():
    from orbitkv_fs.segment import HeaderTemplates

    t = HeaderTemplates(limit=3)
    for layer in range(5):
        raw = pack_header(SegmentHeader(Format.RAW, BF16, 64, 64, 7, role=Role.KEY, layer=layer))
        assert t.parse(raw).layer == layer
        assert len(t._seen) == min(layer + 1, 3) if layer < 3 else len(t._seen) <= 3


def test_header_templates_tell_apart_headers_that_differ_next_to_the_payload_crc():
    # The parse cache is keyed by the header without its payload CRC (bytes 24..27): the bytes on either
    # side (stored length, rotation seed) must still tell two headers apart.
    from orbitkv_fs.segment import HeaderTemplates

    t = HeaderTemplates()
    hs = [SegmentHeader(Format.TURBOQUANT, BF16, 4096, 1056, 0x11223344, role=Role.KEY, layer=5, bits=4,
                        head_dim=128, sign_version=1, rotation_seed=seed) for seed in (0x100, 0x101, 0x200, 0x1100)]
    for h in hs + hs:
        assert t.parse(pack_header(h)) == h


def test_defaults_check_value_and_views():
    h = SegmentHeader(Format.RAW, np.dtype(np.uint8), 4, 4, 0)
    assert (h.role, h.layer, h.bits, h.head_dim, h.sign_version, h.rotation_seed, h.codec_version, h.ans_type,
            h.raw_reason, h.flags) == (Role.OPAQUE, 0, 0, 0, 0, 0, 1, AnsType.NONE, RawReason.NONE, 0)
    from orbitkv_fs.segment import HeaderTemplates, crc32c as seg_crc32c

    assert seg_crc32c(b"123456789") == 0xE3069283 and seg_crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283
    assert HeaderTemplates()._limit == 4096
    buf = bytearray(2 * HEADER_SIZE)
    pack_header_into(h, buf)  # offset 0 by default
    assert bytes(buf[:HEADER_SIZE]) == pack_header(h) and bytes(buf[HEADER_SIZE:]) == bytes(HEADER_SIZE)
    # A view of another item size is read as bytes.
    assert parse_header(memoryview(np.frombuffer(pack_header(h), np.uint16))) == h


@pytest.mark.parametrize("fields,err", [
    (dict(fmt=3, bits=4, role=1, head_dim=32, sign_version=1, dtype=5, original=128, stored=18), errors.UnknownFormat),
    (dict(fmt=3, bits=4, role=1, head_dim=32, sign_version=1, dtype=4, original=66, stored=18), errors.LengthMismatch),
])
def test_turboquant_source_dtype_and_whole_vectors(fields, err):
    expect(err, forge(**fields))


def test_header_crcs_with_a_new_stored_length_equal_the_packed_headers():
    """header_crcs from one template (ANS: one per class) and per-segment payload CRCs and stored lengths gives
    the CRC pack_header writes; a stored length left out of the XOR (the template's kept) does not."""
    import msgspec

    from orbitkv_fs.segment import header_crcs, header_row

    t = SegmentHeader(Format.ANS, np.dtype(ml_dtypes.bfloat16), 1 << 19, 458_688, 0, role=Role.KEY, layer=3,
                      ans_type=AnsType.FLOAT16)
    row, base = header_row(t)
    rng = np.random.default_rng(3)
    stored = rng.integers(1, 458_688, 50).astype(np.uint32)
    pcrc = rng.integers(0, 1 << 32, 50, dtype=np.uint64).astype(np.uint32)
    want = [struct.unpack_from("<I", pack_header(msgspec.structs.replace(t, stored_length=int(s), payload_crc=int(c))),
                               60)[0] for s, c in zip(stored.tolist(), pcrc.tolist())]
    bases = np.full(50, base, dtype=np.uint32)
    assert header_crcs(bases, pcrc, row["stored_length"][0] ^ stored).tolist() == want
    assert header_crcs(bases, pcrc).tolist() != want
