"""Shared test configuration: ``gpu`` tests skip cleanly where no CUDA device is usable; the ``managers``
fixture starts Manager processes that share through peers (peer_manager_child.py)."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (cupy with a device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def managers():
    """``make(**cfg)`` starts a Manager process (:class:`peer_manager_child.Mgr`); all are closed after."""
    from json_child import spawner
    from peer_manager_child import Mgr

    with spawner(Mgr) as make:
        yield make
