"""``prometheus_text``: a Manager's ``/metrics`` text for tests of the core that also check the metric;
``metrics`` / ``m1``: the samples a served ``/metrics`` answers, for the tests of the HTTP control plane.

The metrics need the ``server`` extra (prometheus-client); without it the calling test is skipped at this
point, after everything it checked before (so a test calls it last)."""

from __future__ import annotations

import pytest


def prometheus_text(manager: object) -> bytes:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from orbitkv_fs.server.metrics import build_registry

    return generate_latest(build_registry(manager))


def metrics(http) -> dict[tuple[str, tuple], float]:
    """Every sample of ``http``'s ``/metrics`` (an httpx client), by name and sorted labels."""
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def m1(ms: dict, name: str, **labels) -> float:
    return ms[(name, tuple(sorted(labels.items())))]
