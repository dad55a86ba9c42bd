"""The Grafana dashboards: structure (valid model, unique ids, layout, variables) and every PromQL
expression run against a real Prometheus that scrapes simulated trainers and the operator's metrics module."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from obs_support import (
    DASHBOARD_FILES,
    NAMESPACE,
    RATE_SUBSTITUTIONS,
    VAR_REF,
    all_panels,
    dashboard_targets,
    finite_values,
    load_dashboard,
    strings,
    substitute_vars,
    wait_until,
)

EXPECTED_TITLES = {"rljob / RL training", "rljob / Throughput and cost", "rljob / Fleet"}
DS_REF = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's global variables, which need no definition in the dashboard.
BUILTIN_VARS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms",
                "__from", "__to", "__dashboard", "__user", "__org", "__name", "__all", "timeFilter"}
# What the live test substitutes for each variable: the simulated healthy run and 1m windows
# (the run is scraped every second, so 1m holds plenty of samples).
SUBSTITUTIONS = {**RATE_SUBSTITUTIONS, "namespace": NAMESPACE, "rljob": "healthy"}


def substitute(expr: str) -> str:
    return substitute_vars(expr, SUBSTITUTIONS)


# --------------------------------------------------------------------------- structure


def test_the_three_dashboards_exist():
    assert {load_dashboard(p)["title"] for p in DASHBOARD_FILES} == EXPECTED_TITLES
    uids = [load_dashboard(p)["uid"] for p in DASHBOARD_FILES]
    assert len(set(uids)) == len(uids)
    assert all(re.fullmatch(r"[a-z0-9-]{1,40}", uid) for uid in uids)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_model(path: Path):
    d = load_dashboard(path)
    assert d["id"] is None, "a provisioned dashboard must not carry a database id"
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert "rljob" in d["tags"]
    panels = all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert g["w"] >= 1 and g["h"] >= 1 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap in {path.name}"
                cells[(x, y)] = p["id"]
        assert p["title"].strip()
        if p["type"] == "row":
            continue
        assert p["datasource"] == DS_REF, p["title"]
        assert p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS_REF, p["title"]
            assert t["expr"].strip(), p["title"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_variables(path: Path):
    d = load_dashboard(path)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for name, label in (("namespace", "namespace"), ("rljob", "rljob")):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"] == DS_REF
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert re.fullmatch(rf"label_values\(rljob_\w+(\{{.*\}})?, {label}\)", query), query
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"
    used = {m.group(1) or m.group(2) or m.group(3) for s in strings(d) for m in VAR_REF.finditer(s)}
    undefined = used - set(variables) - BUILTIN_VARS
    assert not undefined, f"variables used but not defined in {path.name}: {undefined}"
    exprs = " ".join(t["expr"] for p in all_panels(d) for t in p.get("targets", []))
    unused = {n for n in variables if n != "datasource" and f"${n}" not in exprs}
    assert not unused, f"variables defined but never used in {path.name}: {unused}"


def test_every_variable_substitution_is_known():
    for _file, _panel, target in dashboard_targets():
        substitute(target["expr"])  # KeyError names a variable the live test cannot fill in


# --------------------------------------------------------------------------- live


@pytest.mark.parametrize(("file", "panel", "target"), dashboard_targets(),
                         ids=[f"{f}:{p['id']}:{t['refId']}" for f, p, t in dashboard_targets()])
def test_panel_expression_returns_data(observed_run, file, panel, target):
    """No parse error (the query raises at once), and some finite value for the simulated runs."""
    prom = observed_run.prom
    expr = substitute(target["expr"])
    prom.query(expr)  # raises PrometheusQueryError on a bad expression
    values = wait_until(lambda: finite_values(prom.query(expr)), timeout=30,
                        what=f"data from {file} panel {panel['title']!r} {target['refId']}: {expr}",
                        last=lambda: prom.query(expr))
    assert values


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_variable_queries_list_the_running_job(observed_run, path: Path):
    prom = observed_run.prom
    for v in load_dashboard(path)["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = substitute(v["query"]["query"])
        metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", query).groups()
        values = {r["metric"].get(label) for r in prom.query(f"group by ({label}) ({metric})")}
        assert {"namespace": NAMESPACE, "rljob": "healthy"}[v["name"]] in values, (v["name"], values)
