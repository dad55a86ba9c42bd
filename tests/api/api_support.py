"""Helpers shared by the tests in tests/api (conftest.py puts this folder on sys.path).

- manifests: `gpu_job()` (a small valid GPU RLJob every table mutates), `changed(doc, {path: value})`,
  `errors_of(doc)` (what `rljob validate` reports for one document);
- the committed CRD: `crd_doc()`, `crd_schema()`, `schema_nodes()`;
- CEL: `cel_failures(doc)` evaluates every `x-kubernetes-validations` rule of the CRD with celpy
  at the node it is attached to, as the API server does;
- `to_jsonschema(openapi)`: the CRD's OpenAPI v3 schema as a strict draft-7 JSON Schema.
"""
from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = ROOT / "examples"
CRD_PATH = ROOT / "crds" / "rljob.dev_rljobs.yaml"
EXAMPLE_PATHS = sorted(EXAMPLES_DIR.glob("*.yaml"))

DELETE = object()  # `changed(doc, {"spec.model.path": DELETE})` removes the field


# --------------------------------------------------------------------------- manifests


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def gpu_job() -> dict[str, Any]:
    """A valid one-node, 8-GPU job with every size written out: DP 8, 16 responses per rank per mini-batch."""
    return {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t"},
        "spec": {
            "nnodes": 1,
            "gpusPerNode": 8,
            "model": {"path": "/models/qwen"},
            "data": {"trainFiles": ["/data/train.parquet"]},
            "rollout": {"samplesPerPrompt": 8},
            "training": {"trainBatchSizePerNode": 64, "ppoMiniBatchSizePerNode": 16, "microBatchSizePerGpu": 4},
        },
    }


def _split(path: str) -> list[str | int]:
    """'spec.data.trainFiles[1]' -> ['spec', 'data', 'trainFiles', 1]."""
    parts: list[str | int] = []
    for piece in path.split("."):
        m = re.fullmatch(r"([^\[]*)((?:\[\d+\])*)", piece)
        assert m, piece
        if m.group(1):
            parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
    return parts


def changed(doc: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of doc with dotted paths set (intermediate mappings are created) or DELETEd."""
    out = copy.deepcopy(doc)
    for path, value in changes.items():
        parts = _split(path)
        node: Any = out
        for part in parts[:-1]:
            if isinstance(part, str) and part not in node:
                node[part] = {}
            node = node[part]
        if value is DELETE:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = copy.deepcopy(value)
    return out


def errors_of(doc: Any) -> list:
    """The FieldErrors `rljob validate` prints for one document ([] when valid)."""
    from rljob_api.validation import RLJobValidationError, name_errors, parse_rljob

    try:
        job = parse_rljob(doc)
    except RLJobValidationError as exc:
        assert exc.errors, "RLJobValidationError without errors"
        return exc.errors
    return name_errors(job.metadata.name, job.spec)


# --------------------------------------------------------------------------- the committed CRD


@functools.cache
def _crd_cached() -> dict[str, Any]:
    return load_yaml(CRD_PATH)


def crd_doc() -> dict[str, Any]:
    return copy.deepcopy(_crd_cached())


def crd_schema() -> dict[str, Any]:
    return crd_doc()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def schema_nodes(node: dict[str, Any], path: tuple = ()) -> Iterator[tuple[tuple, dict[str, Any]]]:
    """Every schema node with its path; property names as str, '[]' for items, '{}' for additionalProperties."""
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from schema_nodes(child, path + (name,))
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], path + ("[]",))
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], path + ("{}",))


# --------------------------------------------------------------------------- CEL


@functools.cache
def cel_rules() -> tuple[tuple[tuple, str, str, Any], ...]:
    """(schema path, fieldPath, message, compiled program) for every x-kubernetes-validations rule."""
    import celpy

    env = celpy.Environment()
    out = []
    for path, node in schema_nodes(crd_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            out.append((path, rule.get("fieldPath", ""), rule["message"], program))
    return tuple(out)


def _values_at(doc: Any, path: tuple) -> Iterator[Any]:
    """The values a rule attached at `path` sees as `self` (absent fields: not evaluated, as the API server)."""
    if not path:
        yield doc
        return
    head, rest = path[0], path[1:]
    if head == "[]":
        for item in doc if isinstance(doc, list) else []:
            yield from _values_at(item, rest)
    elif head == "{}":
        for item in (doc.values() if isinstance(doc, dict) else []):
            yield from _values_at(item, rest)
    elif isinstance(doc, dict) and doc.get(head) is not None:
        yield from _values_at(doc[head], rest)


def cel_failures(doc: dict[str, Any]) -> list[str]:
    """'spec.megatron.tensorModelParallelSize'-style paths (node path + fieldPath) of every failing CEL rule.

    A rule that errors counts as failing, as it does in the API server."""
    import celpy

    failed = []
    for path, field_path, message, program in cel_rules():
        for value in _values_at(doc, path):
            try:
                ok = program.evaluate({"self": celpy.json_to_cel(value)})
            except Exception as exc:  # noqa: BLE001  (celpy raises CELEvalError and others at run time)
                ok = exc
            if isinstance(ok, Exception) or not bool(ok):
                failed.append(".".join(path) + field_path)
    return failed


# --------------------------------------------------------------------------- JSON Schema


def to_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes structural dialect) -> a strict draft-7 JSON Schema.

    nullable: true -> null allowed; boolean exclusive bounds -> numeric ones; int-or-string -> anyOf;
    additionalProperties: false wherever properties are listed and unknown fields are not preserved
    (what `kubectl apply` with strict field validation enforces)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in {"nullable", "exclusiveMinimum", "exclusiveMaximum"}:
            continue
        if key == "properties":
            out[key] = {name: to_jsonschema(child) for name, child in value.items()}
        elif key in {"items", "additionalProperties"}:
            out[key] = to_jsonschema(value)
        else:
            out[key] = copy.deepcopy(value)
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(flag) is True:
            out[flag] = out.pop(bound)
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out
