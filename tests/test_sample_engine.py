"""``orbitkv-sample-engine``: its refusals, and the credential its commands hand on to each other (the
README walk and the fresh-venv test run it against a real manager)."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from orbitkv_fs.dataplane import DataPlaneServer
from orbitkv_fs.manager import Manager, ManagerConfig
from orbitkv_fs.pages import HostPages
from orbitkv_fs.tools.sample_engine import main


def test_pages_are_deterministic_and_other_geometry_is_refused(tmp_path, capsys):
    shm = str(tmp_path)
    assert main(["pages", "--shm-dir", shm, "--codec", "fp8"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["engine_id"] == "sample-tp0" and body["codec"] == "fp8" and len(body["tensors"]) == 8
    path = os.path.join(shm, "orbitkv-pages-sample-tp0")
    with HostPages.open(path) as p:
        first = p.array("L0.key").copy()
    os.unlink(path)
    assert main(["pages", "--shm-dir", shm]) == 0
    capsys.readouterr()
    with HostPages.open(path) as p:
        assert np.array_equal(p.array("L0.key").view(np.uint16), first.view(np.uint16))  # seeded
    assert main(["save", "--shm-dir", shm, "--heads", "4"]) == 2
    err = capsys.readouterr().err
    assert "holds other tensors" in err and "clean" in err and len(err.splitlines()) == 1
    os.unlink(path)


def test_no_manager_is_one_line_within_the_timeout(tmp_path, capsys):
    t = time.monotonic()
    rc = main(["save", "--shm-dir", str(tmp_path), "--data-plane", f"ipc://{tmp_path}/none.sock", "--timeout", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t < 30
    assert err.startswith("orbitkv-sample-engine save: ") and len(err.splitlines()) == 1, err
    assert os.path.exists(tmp_path / "orbitkv-pages-sample-tp0")  # made before the manager was asked
    assert main(["clean", "--shm-dir", str(tmp_path), "--data-plane", f"ipc://{tmp_path}/none.sock",
                 "--timeout", "1"]) == 1
    out, err = capsys.readouterr()
    assert "not unregistered" in err and "removed" in out and not os.listdir(tmp_path)


def test_chunks_must_fit_the_blocks(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["save", "--shm-dir", str(tmp_path), "--chunks", "40", "--blocks-per-chunk", "2"])
    assert e.value.code == 2 and "exceeds --blocks" in capsys.readouterr().err


def test_the_credential_save_answered_serves_the_later_commands_and_goes_with_clean(tmp_path, capsys):
    """Each command is its own client (a process on the command line): ``restore`` and ``clean`` act with
    the credential ``save``'s registration answered, kept next to the pages readable by its user only."""
    shm = str(tmp_path)
    m = Manager(ManagerConfig(pool_size=16 << 20, device="cpu", shm_dir=shm))
    srv = DataPlaneServer(m, f"ipc://{tmp_path}/dp.sock", workers=2)
    flags = ["--shm-dir", shm, "--data-plane", f"ipc://{tmp_path}/dp.sock"]
    kept = tmp_path / "orbitkv-pages-sample-tp0.credential"
    try:
        assert main(["save", *flags]) == 0
        assert kept.stat().st_mode & 0o777 == 0o600
        assert main(["restore", *flags]) == 0
        assert "identical to what was saved" in capsys.readouterr().out
        secret = kept.read_text()
        kept.write_text("0" * len(secret))  # another credential: refused
        assert main(["restore", *flags]) == 2
        assert "credential" in capsys.readouterr().err
        kept.write_text(secret)
        assert main(["clean", *flags]) == 0
        assert "unregistered sample-tp0" in capsys.readouterr().out
        assert m.list_engines() == [] and not [n for n in os.listdir(shm) if n.startswith("orbitkv-pages-")]
    finally:
        srv.close()
        m.close()


def test_restore_after_a_manager_restart_registers_again_with_the_codec_save_used(tmp_path, capsys):
    """A manager restarted on its SSD (``--ssd-recover``) no longer knows the engine: ``restore`` registers it
    again, with the codec ``save`` registered with (an engine's namespace depends on its codec), and restores
    what the SSD kept."""
    from test_ssd_common import direct_io_dir

    from orbitkv_fs.tiers.ssd import SsdConfig, SsdTier

    shm = str(tmp_path)
    ssd = (str(direct_io_dir(tmp_path) / "ssd0.okv"),)
    flags = ["--shm-dir", shm, "--data-plane", f"ipc://{tmp_path}/dp.sock"]

    def start(recover: bool) -> tuple[Manager, DataPlaneServer]:
        m = Manager(ManagerConfig(pool_size=16 << 20, device="cpu", shm_dir=shm),
                    lower_tier=SsdTier(SsdConfig(paths=ssd, capacity=64 << 20, recover=recover)))
        return m, DataPlaneServer(m, f"ipc://{tmp_path}/dp.sock", workers=2)

    m, srv = start(False)
    try:
        assert main(["save", "--codec", "fp8", *flags]) == 0
        assert m.flush_dram().submitted.objects > 0
    finally:
        srv.close()
        m.close()
    capsys.readouterr()
    m, srv = start(True)
    try:
        assert main(["restore", *flags]) == 0
        out = capsys.readouterr().out
        assert "registered sample-tp0 again" in out and "codec fp8" in out and "4 present (DRAM 0, lower tier 4" in out
        assert main(["clean", *flags]) == 0
    finally:
        srv.close()
        m.close()
