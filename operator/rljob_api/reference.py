"""Markdown reference of every RLJob spec field, generated from the schema (docs/reference.md)."""
from __future__ import annotations

from typing import Any

from rljob_api.crd import openapi_schema


def _type(node: dict[str, Any]) -> str:
    if node.get("type") == "array":
        return f"list of {_type(node.get('items', {}))}"
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (free-form)"
    if node.get("type") == "object" and "additionalProperties" in node:
        return f"map of {_type(node['additionalProperties'])}"
    return node.get("type", "object")


def _rows(node: dict[str, Any], path: str, out: list[str]) -> None:
    for name, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{name}"
        desc = child.get("description", "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{child_path}` | {_type(child)} | {desc} |")
        if child.get("properties"):
            _rows(child, child_path, out)
        elif child.get("type") == "array" and child.get("items", {}).get("properties"):
            _rows(child["items"], child_path + "[]", out)


def reference_markdown() -> str:
    spec = openapi_schema()["properties"]["spec"]
    lines = [
        "# RLJob reference (`rljob.dev/v1alpha1`)",
        "",
        "Generated from `operator/rljob_api/models.py` by `rljob explain --markdown`; do not edit by hand.",
        "`kubectl explain rlj.spec.<field>` shows the same text on a cluster. `(verl: ...)` names the seed",
        "recipes' key for the same setting.",
        "",
        "| field | type | description |",
        "|---|---|---|",
    ]
    _rows(spec, "spec", lines)
    lines += ["", "## Cross-field rules", ""]
    for rule in spec.get("x-kubernetes-validations", []):
        lines.append(f"- {rule['message']} (checked by the API server and the operator)")
    lines += [
        "- batch sizes: trainBatchSizePerNode a multiple of ppoMiniBatchSizePerNode; mini-batch responses",
        "  (ppoMiniBatchSizePerNode x nnodes x rollout.samplesPerPrompt) divisible by the data-parallel size, and the per-rank",
        "  share a multiple of microBatchSizePerGpu (checked by the operator and `rljob validate`)",
        "",
    ]
    return "\n".join(lines)
