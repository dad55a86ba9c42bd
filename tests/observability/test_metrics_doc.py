"""docs/metrics.md, the telemetry, the dashboards and the rules name the same metrics."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from rljob_worker.telemetry.trainer_metrics import TrainerTelemetry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from obs_support import DASHBOARD_DIR, REPO, RULES_FILE, load_rules

DOC = (REPO / "docs" / "metrics.md").read_text()



def exposition_names(registry) -> set[str]:
    """Metric names as they appear in the exposition (counters with _total, info with _info)."""
    suffix = {"counter": "_total", "info": "_info"}
    return {f.name + suffix.get(f.type, "") for f in registry.collect() if f.name.startswith("rljob_")}


def operator_metric_names() -> set[str]:
    from prometheus_client import REGISTRY
    from rljob_operator import metrics  # noqa: F401  (registers the operator's metrics in REGISTRY)

    return {n for n in exposition_names(REGISTRY) if n.startswith("rljob_operator_")}


def telemetry_metric_names() -> set[str]:
    t = TrainerTelemetry(job="j", namespace="n", rank=0, model="m", algorithm="grpo", nnodes=1,
                         registry=CollectorRegistry())
    return exposition_names(t.registry)


def used_metric_names() -> set[str]:
    """rljob_* names used by the dashboards and rules, histogram suffixes stripped."""
    text = "".join(rule["expr"] for rule in load_rules()) + "".join(
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
    """Dashboards and rules use only metrics that the telemetry or the operator's metrics module define."""
    used = used_metric_names()
    unknown = used - telemetry_metric_names() - operator_metric_names()
    assert unknown == set(), f"dashboards/rules use metrics nobody exports: {unknown}"
    assert sorted(n for n in used if not documented(n)) == []


def test_every_operator_metric_is_documented_and_shown():
    names = operator_metric_names()
    assert len(names) >= 4
    assert sorted(n for n in names if not documented(n)) == []
    assert names <= used_metric_names(), "operator metrics no dashboard shows"


def test_every_dashboard_and_alert_is_described():
    for path in DASHBOARD_DIR.glob("*.json"):
        d = json.loads(path.read_text())
        assert f"### {d['title']} (`{path.name}`, uid `{d['uid']}`)" in DOC
    for alert in re.findall(r"- alert: (\w+)", RULES_FILE.read_text()):
        assert f"| `{alert}` |" in DOC
