"""``orbitkv_fs.progress``: a bar where a person watches, nothing anywhere else, the same counting either way."""

from __future__ import annotations

import io
import subprocess
import sys

from orbitkv_fs.progress import progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_terminal_no_bar_and_no_tqdm(monkeypatch):
    """A pipe or a log gets nothing, and the core does not even import tqdm for it."""
    monkeypatch.delenv("ORBITKV_PROGRESS", raising=False)
    code = ("import io, sys; from orbitkv_fs.progress import progress\n"
            "out = io.StringIO()\n"
            "with progress(10, 'x', file=out) as bar:\n"
            "    bar.update(10)\n"
            "assert not bar.enabled and out.getvalue() == '' and 'tqdm' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_terminal_bar_counts_bytes_and_positions(monkeypatch):
    monkeypatch.delenv("ORBITKV_PROGRESS", raising=False)
    out = _Tty()
    with progress(4 << 20, "scanning", "B", file=out, delay=0) as bar:
        bar.update(1 << 20)
        bar.update_to(3 << 20)
        bar.update_to(2 << 20)  # a position behind the last one changes nothing
        bar.write("a line above the bar")
        bar.update_to(4 << 20)
    text = out.getvalue()
    assert bar.enabled and "scanning" in text and "4.00M/4.00M" in text and "100%" in text
    assert "a line above the bar\n" in text


def test_a_callback_sets_the_total_once_it_knows_it(monkeypatch):
    """The SSD recovery scan reports (bytes_done, bytes_total): a bar started without a total takes it."""
    monkeypatch.delenv("ORBITKV_PROGRESS", raising=False)
    out = _Tty()
    with progress(None, "recovering SSD shards", "B", file=out, delay=0) as bar:
        bar.update_to(1 << 20, 2 << 20)
        bar.update_to(2 << 20, 2 << 20)
    text = out.getvalue()
    assert "2.00M/2.00M" in text and "100%" in text


def test_quick_work_on_a_terminal_draws_nothing(monkeypatch):
    monkeypatch.delenv("ORBITKV_PROGRESS", raising=False)
    out = _Tty()
    with progress(3, "quick", file=out) as bar:  # default delay: only work longer than 2 s shows a bar
        bar.update(3)
    assert bar.enabled and "quick" not in out.getvalue()


def test_environment_switch_wins(monkeypatch):
    monkeypatch.setenv("ORBITKV_PROGRESS", "0")
    assert not progress(1, "x", file=_Tty()).enabled
    monkeypatch.setenv("ORBITKV_PROGRESS", "1")
    out = io.StringIO()
    with progress(2, "forced", file=out) as bar:
        bar.update(2)
    assert "forced" in out.getvalue() and "2/2" in out.getvalue()
