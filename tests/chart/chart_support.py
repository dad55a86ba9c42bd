"""Helpers for the chart tests: run helm, parse what it renders, validate custom kinds.

Built-in kinds are validated with kubernetes-validate (strict: unknown fields fail) against the
Kubernetes version of the kubectl fixture (1.37). The Prometheus Operator kinds (ServiceMonitor,
PodMonitor, PrometheusRule) have no schema there and their CRDs are not vendored here, so they are
checked against the small hand-written schemas below, which hold only the fields the chart uses
(with additionalProperties false, so a typo fails) and the fields the Prometheus Operator requires.
"""
from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rljob-operator"
VALUES_DIR = Path(__file__).resolve().parent / "values"
VALUES_FILES = sorted(VALUES_DIR.glob("*.yaml"))
RELEASE = "rljob"
NAMESPACE = "rljob-system"
KUBERNETES_VERSION = "1.37.0"

MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
BUILTIN_KINDS = {
    "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment", "Service",
    "ConfigMap", "CustomResourceDefinition",
}


class HelmError(RuntimeError):
    pass


def helm(helm_bin: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm_bin, *args], capture_output=True, text=True, timeout=60, check=False)
    if check and proc.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def template_args(values_files: Sequence[Path] = (), set_values: Sequence[str] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for f in values_files:
        args += ["--values", str(f)]
    for s in set_values:
        args += ["--set", s]
    return args


@functools.cache
def _render_cached(helm_bin: str, values_files: tuple[str, ...], set_values: tuple[str, ...]) -> str:
    return helm(helm_bin, *template_args([Path(f) for f in values_files], set_values)).stdout


def render(helm_bin: str, values_files: Iterable[Path] = (), set_values: Iterable[str] = ()) -> list[dict[str, Any]]:
    """`helm template` -> the list of rendered objects (empty documents dropped)."""
    text = _render_cached(helm_bin, tuple(str(f) for f in values_files), tuple(set_values))
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def values_of(values_files: Iterable[Path]) -> dict[str, Any]:
    """The chart's default values merged with the files (a deep merge, as helm does for maps)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in values_files:
        merged = _deep_merge(merged, yaml.safe_load(Path(f).read_text()) or {})
    return merged


def _deep_merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _deep_merge(base.get(k), v) if k in base else v
        return out
    return override


# ---------------------------------------------------------------------------- Prometheus Operator kinds

_STR = {"type": "string", "minLength": 1}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          "(([0-9]+)s)?(([0-9]+)ms)?)$"}


def _closed(properties: dict[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": list(required)}


_METADATA = _closed({"name": _STR, "namespace": _STR, "labels": _LABELS, "annotations": _LABELS}, ["name", "namespace"])
_SELECTOR = _closed({"matchLabels": {**_LABELS, "minProperties": 1}}, ["matchLabels"])
_NAMESPACE_SELECTOR = {"oneOf": [
    _closed({"any": {"const": True}}, ["any"]),
    _closed({"matchNames": {"type": "array", "minItems": 1, "items": _STR}}, ["matchNames"]),
]}
_ENDPOINT = _closed({"port": _STR, "path": {"type": "string", "pattern": "^/"}, "interval": _DURATION,
                     "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"}}, ["port", "path"])


def _monitoring_object(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed({"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                    "metadata": _METADATA, "spec": spec}, ["apiVersion", "kind", "metadata", "spec"])


_RULE = {
    "type": "object", "additionalProperties": False,
    "properties": {"alert": _STR, "record": _STR, "expr": _STR, "for": _DURATION, "keep_firing_for": _DURATION,
                   "labels": _LABELS, "annotations": _LABELS},
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}
MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _monitoring_object("ServiceMonitor", _closed({
        "selector": _SELECTOR, "namespaceSelector": _NAMESPACE_SELECTOR,
        "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
    }, ["selector", "endpoints"])),
    "PodMonitor": _monitoring_object("PodMonitor", _closed({
        "selector": _SELECTOR, "namespaceSelector": _NAMESPACE_SELECTOR,
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
    }, ["selector", "podMetricsEndpoints"])),
    "PrometheusRule": _monitoring_object("PrometheusRule", _closed({
        "groups": {"type": "array", "minItems": 1, "items": _closed({
            "name": _STR, "interval": _DURATION,
            "rules": {"type": "array", "minItems": 1, "items": _RULE},
        }, ["name", "rules"])},
    }, ["groups"])),
}


def monitoring_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(MONITORING_SCHEMAS[doc["kind"]])
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]
