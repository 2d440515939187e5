"""``prometheus_text``: a Manager's ``/metrics`` text for tests of the core that also check the metric.

The metrics need the ``server`` extra (prometheus-client); without it the calling test is skipped at this
point, after everything it checked before (so a test calls it last)."""

from __future__ import annotations

import pytest


def prometheus_text(manager: object) -> bytes:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from orbitkv_fs.server.metrics import build_registry

    return generate_latest(build_registry(manager))
