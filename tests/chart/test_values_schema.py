"""values.schema.json: strict (unknown keys and wrong types fail `helm template`), and it and the
helm-docs comments in values.yaml cover every value."""
from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from chart_support import CHART, helm, template_args


def _template_fails(helm_bin: str, *set_values: str) -> str:
    proc = helm(helm_bin, *template_args(set_values=set_values), check=False)
    assert proc.returncode != 0, f"helm template accepted {set_values}"
    return proc.stderr


@pytest.mark.parametrize("bad", [
    "unknownTopLevel=1",
    "operator.unknownKey=1",
    "worker.image.digest=sha256:0",
    "metrics.serviceMonitor.intervalSeconds=30",
    "rbac.secrets=true",
])
def test_unknown_values_are_rejected(helm_bin: str, bad: str) -> None:
    err = _template_fails(helm_bin, bad)
    assert "additional properties" in err.lower() or "additionalproperties" in err.lower(), err


@pytest.mark.parametrize("bad", [
    "metrics.port=not-a-port",
    "worker.progressRbac=maybe",
    "operator.apiConcurrency=1000",
    "operator.logLevel=loud",
    "watchNamespaces=team-a",
    "watchNamespaces[0]=Team_A",
    "watchNamespaces[0]=rl-*",
    "image.pullPolicy=Sometimes",
    "metrics.serviceMonitor.interval=30",
    # names and addresses Kubernetes or the operator would refuse only after the install
    "fullnameOverride=My_Operator",
    "nameOverride=RLJob",
    "serviceAccount.name=Ops Bot",
    "priorityClassName=High_Priority",
    "metrics.bindAddress=localhost",
    "metrics.bindAddress=0.0.0.300",
])
def test_wrong_types_and_values_are_rejected(helm_bin: str, bad: str) -> None:
    err = _template_fails(helm_bin, bad)
    assert "schema" in err.lower(), err


def test_good_overrides_are_accepted(helm_bin: str) -> None:
    helm(helm_bin, *template_args(set_values=["watchNamespaces[0]=team-a", "metrics.port=9100",
                                              "operator.logLevel=debug", "global.foo=bar"]))
    for address in ("127.0.0.1", "::", "::1", "fd00::10"):
        helm(helm_bin, *template_args(set_values=[f"metrics.bindAddress={address}"]))
    helm(helm_bin, *template_args(set_values=["fullnameOverride=rl-ops", "serviceAccount.name=rl.ops-bot",
                                              "priorityClassName=system-cluster-critical"]))


def test_metrics_and_health_ports_must_differ(helm_bin: str) -> None:
    """kopf's /healthz and the operator's /metrics on one port: one of them could not bind."""
    err = _template_fails(helm_bin, "metrics.port=8081")
    assert "metrics.port and operator.healthPort" in err, err
    helm(helm_bin, *template_args(set_values=["metrics.port=8081", "metrics.enabled=false"]))


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        out.add(path)
        if sub.get("additionalProperties") is False:
            assert sub.get("type") == "object", path
            out |= _schema_paths(sub, path + ".")
    return out


def _value_paths(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        out.add(path)
        sub = schema.get("properties", {}).get(key, {})
        if isinstance(value, dict) and sub.get("additionalProperties") is False:
            out |= _value_paths(value, sub, path + ".")
    return out


def test_schema_is_strict_and_matches_values_yaml() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def closed_objects(node: dict[str, Any], path: str = "") -> None:
        for key, sub in node.get("properties", {}).items():
            assert "description" in sub, f"{path}{key}: no description in the schema"
            if sub.get("type") == "object" and "properties" in sub:
                assert sub.get("additionalProperties") is False, f"{path}{key}: not strict"
                closed_objects(sub, f"{path}{key}.")

    assert schema["additionalProperties"] is False
    closed_objects(schema)
    assert _schema_paths(schema) - {"global"} == _value_paths(values, schema)


def test_every_value_has_a_helm_docs_comment() -> None:
    """A `# --` comment block right above every key of values.yaml (nested keys included)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w.-]*):( |$)", line)
        if not m:
            continue
        indent = len(m[1])
        j = i - 1
        block = []
        while j >= 0 and re.match(rf"^ {{{indent}}}#", lines[j]):
            block.append(lines[j].strip())
            j -= 1
        documented = any(b.startswith("# --") for b in block)
        parent_documented = bool(block)  # a section comment above a map of documented leaves
        is_map = i + 1 < len(lines) and line.rstrip().endswith(":") and (
            len(lines[i + 1]) - len(lines[i + 1].lstrip()) > indent)
        # Keys inside a documented pass-through value (e.g. resources.requests.cpu) need none.
        if not (documented or (is_map and parent_documented)) and not _inside_documented_passthrough(
                lines, i, indent):
            missing.append(f"line {i + 1}: {line.strip()}")
    assert not missing, "values without a `# --` comment:\n" + "\n".join(missing)


def _inside_documented_passthrough(lines: list[str], i: int, indent: int) -> bool:
    """Whether some ancestor key of line i carries a `# --` comment (its whole value is documented)."""
    for j in range(i - 1, -1, -1):
        line = lines[j]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        ind = len(line) - len(line.lstrip())
        if ind >= indent:
            continue
        indent = ind
        k = j - 1
        while k >= 0 and lines[k].lstrip().startswith("#") and len(lines[k]) - len(lines[k].lstrip()) == ind:
            if lines[k].strip().startswith("# --"):
                return True
            k -= 1
        if ind == 0:
            return False
    return False
