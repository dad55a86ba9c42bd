"""`rljob explain`: field documentation from the generated schema (what `kubectl explain` shows)."""
from __future__ import annotations

from typing import Any

from rljob_api.crd import openapi_schema
from rljob_api.models import KIND, PLURAL, SHORT_NAMES, SINGULAR
from rljob_api.validation import NAME_RULE

# What a path may start with, as `kubectl explain` takes the resource: rlj.spec, rljob.spec, rljobs.spec, RLJob.spec.
RESOURCE_NAMES = frozenset({KIND.lower(), SINGULAR, PLURAL, *SHORT_NAMES})

# The CRD leaves metadata to the API server (ObjectMeta); explain says what rljob itself needs of it.
METADATA = {
    "type": "object",
    "description": "Standard Kubernetes object metadata (name, namespace, labels, annotations); rljob needs name.",
    "properties": {"name": {"type": "string", "description": (
        f"Required. The job's name, which its pods, Services and `rljob run`'s runs/<name>/ take: {NAME_RULE}. With "
        "spec.childKind JobSet the last pod's hostname <name>-trainer-0-<nnodes - 1> must also fit in 63 characters.")}},
}


def _value_of_map(node: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of a map's values when they are objects with fields (reward.bySource.<source>), else None."""
    value = node.get("additionalProperties")
    return value if isinstance(value, dict) and value.get("properties") else None


def fields_of(node: dict[str, Any]) -> dict[str, Any]:
    """The fields under node: its own, its list items', or its map values'."""
    return (node.get("properties") or node.get("items", {}).get("properties")
            or (_value_of_map(node) or {}).get("properties") or {})


def _type_of(node: dict[str, Any]) -> str:
    t = node.get("type", "object")
    if t == "array":
        return f"[]{_type_of(node.get('items', {}))}"
    if "enum" in node:
        return f"{t} ({' | '.join(map(str, node['enum']))})"
    if isinstance(node.get("additionalProperties"), dict):
        return f"map[string]{_type_of(node['additionalProperties'])}"
    return t


def lookup(path: str) -> dict[str, Any]:
    """The schema node at a dotted path (an optional rlj. / rljob. / rljobs. first; any key of a map of objects
    names its value). Raises KeyError naming the part that does not exist and the fields that do."""
    root = openapi_schema()
    node = {**root, "properties": {**root["properties"], "metadata": METADATA}}
    parts = [p for p in path.split(".") if p]
    if parts and parts[0].lower() in RESOURCE_NAMES:
        parts = parts[1:]
    walked = []
    for part in parts:
        props = node.get("properties") or node.get("items", {}).get("properties") or {}
        if part in props:
            node = props[part]
        elif not props and _value_of_map(node):  # a key of a map such as reward.bySource.<source>
            value = _value_of_map(node)
            node = {**value, "description": value.get("description") or (
                f"The entry for {part!r} of {'.'.join(walked)}: {node.get('description', '')}")}
        else:
            where = ".".join(walked) or "RLJob"
            raise KeyError(f"field {part!r} does not exist in {where}; fields: {', '.join(props) or '(none)'}")
        walked.append(part)
    return node


def explain(path: str) -> str:
    node = lookup(path)
    lines = [f"FIELD: {path} <{_type_of(node)}>", "", "DESCRIPTION:", f"  {node.get('description', '')}"]
    props = fields_of(node)
    if props:
        lines += ["", "FIELDS:"]
        required = set(node.get("required", []))
        for name, child in props.items():
            flag = " -required-" if name in required else ""
            lines.append(f"  {name} <{_type_of(child)}>{flag}")
            lines.append(f"    {child.get('description', '')}")
    return "\n".join(lines)
