"""``wait_until``: the tests' one way to wait for something another thread or process does."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``cond`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
