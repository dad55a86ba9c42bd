"""docs/metrics.md, the telemetry, the dashboards and the rules name the same metrics."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from rljob_worker.telemetry import TrainerTelemetry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from obs_support import DASHBOARD_DIR, REPO, RULES_FILE

DOC = (REPO / "docs" / "metrics.md").read_text()
OPERATOR_METRICS = {"rljob_operator_reconciles_total", "rljob_operator_errors_total",
                    "rljob_operator_reconcile_seconds", "rljob_operator_jobs"}


def telemetry_metric_names() -> set[str]:
    """Metric names as they appear in the exposition (counters with _total, info with _info)."""
    t = TrainerTelemetry(job="j", namespace="n", rank=0, model="m", algorithm="grpo", nnodes=1,
                         registry=CollectorRegistry())
    suffix = {"counter": "_total", "info": "_info"}
    return {f.name + suffix.get(f.type, "") for f in t.registry.collect() if f.name.startswith("rljob_")}


def used_metric_names() -> set[str]:
    """rljob_* names used by the dashboards and rules, histogram suffixes stripped."""
    text = RULES_FILE.read_text() + "".join(
        t["expr"] + json.dumps(p.get("fieldConfig", {}))
        for path in DASHBOARD_DIR.glob("*.json")
        for p in json.loads(path.read_text())["panels"] for t in p.get("targets", []))
    text += "".join(json.dumps(json.loads(p.read_text())["templating"]) for p in DASHBOARD_DIR.glob("*.json"))
    names = set(re.findall(r"\brljob_[a-z0-9_]+", text))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def documented(name: str) -> bool:
    return f"`{name}`" in DOC


def test_every_telemetry_metric_is_documented():
    names = telemetry_metric_names()
    assert len(names) > 40
    assert sorted(n for n in names if not documented(n)) == []


def test_every_used_metric_exists_and_is_documented():
    used = used_metric_names()
    unknown = used - telemetry_metric_names() - OPERATOR_METRICS
    assert unknown == set(), f"dashboards/rules use metrics nobody exports: {unknown}"
    assert sorted(n for n in used if not documented(n)) == []
    assert OPERATOR_METRICS <= used


def test_every_dashboard_and_alert_is_described():
    for path in DASHBOARD_DIR.glob("*.json"):
        d = json.loads(path.read_text())
        assert f"### {d['title']} (`{path.name}`, uid `{d['uid']}`)" in DOC
    for alert in re.findall(r"- alert: (\w+)", RULES_FILE.read_text()):
        assert f"| `{alert}` |" in DOC


def test_operator_metric_names_match_the_operator_module():
    """The Fleet dashboard and operator alerts assume the operator's metric names; when the
    operator's metrics module exists it must define them."""
    module = REPO / "operator" / "rljob_operator" / "metrics.py"
    if not module.exists():
        pytest.skip("operator/rljob_operator/metrics.py does not exist yet")
    source = module.read_text()
    bases = {re.sub(r"_total$", "", n) for n in OPERATOR_METRICS}
    missing = sorted(b for b in bases if f'"{b}' not in source and f"'{b}" not in source)
    assert missing == [], f"{module} does not define {missing}"
