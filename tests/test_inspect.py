"""``orbitkv-inspect`` on real shard files written by the SSD tier, on damaged files and on garbage."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbitkv_fs.codecs import decode_segment, encode_segment
from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier
from orbitkv_fs.tiers.ssd.record import BLOCK, MAGIC, RECORD_HEADER_SIZE
from orbitkv_fs.tiers.ssd.superblock import RING_START, SUPERBLOCK_SIZE
from orbitkv_fs.tools.inspect import main
from test_ssd_common import direct_io_dir, flip, key, segment

import pytest


@pytest.fixture
def shard(tmp_path):
    d = direct_io_dir(tmp_path)
    path = str(d / "s.okv")
    with SsdTier(SsdConfig(paths=(path,), capacity=4 << 20)) as t:
        for i in range(6):
            t.submit(key(i), segment(i))
        x = np.linspace(-3, 3, 8192, dtype=np.float32).astype(np.float16)
        t.submit(key(6, layer=5), encode_segment(x, "fp8", role="key", layer=5))
        t.flush()
        t.submit(key(0), segment(0, version=1))  # supersedes record 0
        t.flush()
        offsets = {o.key: o.offset for o in t.iter_records()}
    return path, offsets


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_summary_list_verify_dump(shard, capsys, tmp_path):
    path, _ = shard
    rc, out, _ = run(capsys, "summary", path, "--json")
    s = json.loads(out)
    assert rc == 0 and s["records"] == 8 and s["valid"] == 8 and s["live_records"] == 7
    assert s["dead_bytes"] == 20480 and s["generation_max"] == 8
    assert s["formats"]["fp8"]["compression_ratio"] == pytest.approx(16384 / 8192)
    assert s["formats"]["raw"]["records"] == 6

    rc, out, _ = run(capsys, "list", path, "--json")
    rows = json.loads(out)
    assert [r["status"] for r in rows] == ["valid"] * 8 and [r["live"] for r in rows].count(False) == 1
    assert rows[6]["format"] == "fp8" and rows[6]["layer"] == 5 and rows[6]["role"] == "key"

    rc, out, _ = run(capsys, "list", path)
    assert rc == 0 and len(out.splitlines()) == 9

    rc, out, _ = run(capsys, "verify", path)
    assert rc == 0 and "0 bad" in out

    npy = str(tmp_path / "r1.npy")
    rc, out, _ = run(capsys, "dump", path, "--record", "1", "--out", npy, "--json")
    assert rc == 0 and json.loads(out)["key"] == str(key(1))
    assert np.array_equal(np.load(npy), decode_segment(segment(1)))


def test_verify_lists_bad_records_and_dump_refuses_them(shard, capsys, tmp_path):
    path, offsets = shard
    flip(path, offsets[key(3)] + RECORD_HEADER_SIZE + 64 + 9)
    rc, out, _ = run(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert rc == 1 and not doc["ok"] and [b["offset"] for b in doc["bad"]] == [offsets[key(3)]]
    assert "payload" in doc["bad"][0]["error"].lower() or "crc" in doc["bad"][0]["error"].lower()
    rc, out, _ = run(capsys, "verify", path)
    assert rc == 1 and str(offsets[key(3)]) in out
    bad_no = next(r["record"] for r in json.loads(run(capsys, "list", path, "--json")[1]) if r["status"] != "valid")
    rc, _, err = run(capsys, "dump", path, "--record", str(bad_no), "--out", str(tmp_path / "x.npy"))
    assert rc == 1 and "error" in err
    rc, _, err = run(capsys, "dump", path, "--record", "99", "--out", str(tmp_path / "x.npy"))
    assert rc == 1 and "no record 99" in err


@pytest.mark.parametrize("content", [None, b"", b"x" * 100, os.urandom(3 * 4096 + 7)])
def test_unreadable_inputs_are_clear_errors(tmp_path, capsys, content):
    path = tmp_path / "f"
    if content is not None:
        path.write_bytes(content)
    for cmd in ("summary", "list", "verify"):
        rc, out, err = run(capsys, cmd, str(path))
        assert rc == 2 and err.startswith("orbitkv-inspect: error:") and len(err.splitlines()) == 1
    rc, _, err = run(capsys, "summary", str(tmp_path))
    assert rc == 2 and "directory" in err


def test_console_entry_point_never_tracebacks(tmp_path):
    path = tmp_path / "garbage"
    path.write_bytes(os.urandom(64 * 1024))
    p = subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.inspect", "summary", str(path)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "not a shard file" in p.stderr


def test_progress_bar_when_asked_and_never_in_a_pipe(shard, capsys, monkeypatch):
    """The scan reports its progress on stderr where a person watches (ORBITKV_PROGRESS=1 stands in for a
    terminal here); captured output (not a terminal) gets no bar; stdout holds the answer alone."""
    path, _ = shard
    os.truncate(path, 256 << 20)  # sparse: cheap to create, scanned like any file
    monkeypatch.setenv("ORBITKV_PROGRESS", "1")
    rc, out, err = run(capsys, "summary", path, "--json")
    assert rc == 0 and json.loads(out)["valid"] == 8
    # The scan covers the ring the superblock declares (the file's tail past it is not the shard's).
    assert "scanning s.okv" in err and "100%" in err and re.search(r" (\S+)/\1 \[", err)
    monkeypatch.delenv("ORBITKV_PROGRESS")
    rc, out, err = run(capsys, "summary", path, "--json")
    assert rc == 0 and json.loads(out)["valid"] == 8 and err == ""


def test_dump_of_bf16_loads_as_numbers_and_qualifies_as_bf16(tmp_path, capsys):
    """numpy cannot load bfloat16 (``|V2``): dump saves it as float32, exactly, and orbitkv-qualify reads
    that file back as the BF16 segment it was (its figures equal those of the BF16 array itself)."""
    import ml_dtypes

    from orbitkv_fs.tools import qualify

    path = str(direct_io_dir(tmp_path) / "bf16.okv")
    x = np.random.default_rng(5).standard_normal((64, 2, 64)).astype(ml_dtypes.bfloat16)
    with SsdTier(SsdConfig(paths=(path,), capacity=4 << 20)) as t:
        t.submit(key(0), encode_segment(x, "none", role="key"))
        t.flush()
    npy = str(tmp_path / "k.npy")
    rc, out, _ = run(capsys, "dump", path, "--record", "0", "--out", npy)
    assert rc == 0 and "8192 x bfloat16" in out and "saved as float32, exactly" in out
    back = np.load(npy)
    assert back.dtype == np.float32 and np.array_equal(back, x.reshape(-1).astype(np.float32))
    loaded = qualify.load_kv(npy)
    assert loaded.dtype == np.dtype(ml_dtypes.bfloat16) and loaded.tobytes() == x.tobytes()
    rc, out, _ = run(capsys, "dump", path, "--record", "0", "--out", npy, "--json")
    assert json.loads(out)["dtype"] == "bfloat16" and json.loads(out)["saved_dtype"] == "float32"


def test_output_cut_short_by_head_ends_quietly(tmp_path):
    """``orbitkv-inspect list ... | head`` as a shell runs it: no Broken pipe message, no traceback (the
    listing is larger than a pipe's buffer, so the writer does meet the closed pipe)."""
    path = str(direct_io_dir(tmp_path) / "many.okv")
    with SsdTier(SsdConfig(paths=(path,), capacity=16 << 20)) as t:
        for i in range(2000):
            t.submit(key(i), segment(i, n=256))
        t.flush()
    p = subprocess.run(f"{sys.executable} -m orbitkv_fs.tools.inspect list {path} | head -2; "
                       "echo status ${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash",
                       capture_output=True, text=True, timeout=120)
    assert len(p.stdout.splitlines()) == 2, p.stdout
    assert p.stderr.strip() in ("status 0", "status 141"), p.stderr


def _blocks():
    header_like = st.builds(lambda tail: MAGIC + tail, st.binary(min_size=0, max_size=300))
    block = st.one_of(st.binary(max_size=4096), header_like, st.just(bytes(4096)))
    return st.lists(block, min_size=0, max_size=6).map(
        lambda bs: b"".join(b.ljust(4096, b"\0") if i % 2 == 0 else b for i, b in enumerate(bs)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_blocks(), cmd=st.sampled_from(["summary", "list", "verify"]))
def test_garbage_never_crashes(data, cmd):
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        rc = main([cmd, f.name, "--json"])
    assert rc in (0, 1, 2)


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(min_value=0, max_value=RING_START + 20479), value=st.integers(min_value=1, max_value=255))
def test_any_single_byte_damage_in_a_record_is_detected_or_harmless(pos, value, tmp_path_factory):
    d = direct_io_dir(tmp_path_factory.mktemp("h"))
    path = str(d / "s.okv")
    with SsdTier(SsdConfig(paths=(path,), capacity=1 << 20)) as t:
        t.submit(key(1), segment(1))
        t.flush()
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ value]))
    rc = main(["verify", path, "--json"])
    in_superblock = pos % BLOCK < SUPERBLOCK_SIZE and pos < RING_START
    in_record = RING_START <= pos < RING_START + RECORD_HEADER_SIZE + len(segment(1))
    if in_superblock or in_record:
        assert rc == 1  # a superblock copy, the record's header (the chain breaks) or its segment
    else:
        assert rc == 0  # zero padding is not covered by a tag or CRC and not read back
