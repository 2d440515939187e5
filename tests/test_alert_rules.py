"""The Prometheus alerting rules shipped for operators (docs/control-plane/alerts.yml) against reality: every
expression parses with a real PromQL parser (promql-parser, a port of Prometheus's own), every rule carries
what an alert manager routes on, and every metric a rule names is one a real ``orbitkv-cache-manager`` process
with an SSD tier exports, so a renamed metric cannot leave a rule that silently never fires."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from manager_process import ManagerProcess
from test_ssd_common import direct_io_dir

promql_parser = pytest.importorskip("promql_parser")
yaml = pytest.importorskip("yaml")

RULES = Path(__file__).resolve().parent.parent / "docs" / "control-plane" / "alerts.yml"


def _rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def _selectors(expr: str) -> list[str]:
    names: list[str] = []

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_every_rule_parses_and_carries_what_routing_needs() -> None:
    rules = _rules()
    assert len(rules) >= 10
    assert len({r["alert"] for r in rules}) == len(rules)
    for r in rules:
        assert _selectors(r["expr"]), r["alert"]
        if "for" in r:
            assert promql_parser.parse_duration(r["for"]).total_seconds() > 0
        assert r["labels"]["severity"] in ("page", "ticket", "info"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    with pytest.raises(ValueError):  # the parser refuses what Prometheus would
        promql_parser.parse("increase(orbitkv_ssd_corrupt_records_total[15m] > 0")


def test_the_alerting_rules_name_only_metrics_a_manager_exports(tmp_path) -> None:
    ssd = direct_io_dir(tmp_path) / "shard.okv"
    mgr = ManagerProcess("--ssd-cache-path", str(ssd), "--ssd-cache-capacity", "64mb", shm_dir=str(tmp_path))
    try:
        with urllib.request.urlopen(mgr.http + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        mgr.stop()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    named = {n for r in _rules() for n in _selectors(r["expr"]) if n != "up"}  # up: Prometheus's own
    assert named and named <= exported, sorted(named - exported)
