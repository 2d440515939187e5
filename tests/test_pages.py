"""Engine pages files: opening follows no symlink."""

import os

import pytest

from orbitkv_fs.pages import HostPages, PagesError


def test_open_refuses_a_symlink(tmp_path):
    p = HostPages.create([("a", (4, 4), "float16", "opaque")], directory=str(tmp_path))
    try:
        link = tmp_path / "link"
        os.symlink(p.path, link)
        with pytest.raises(PagesError, match="cannot open"):
            HostPages.open(str(link))
        q = HostPages.open(p.path)
        q.close()
    finally:
        p.close()
