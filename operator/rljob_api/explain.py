"""`rljob explain`: field documentation from the generated schema (what `kubectl explain` shows)."""
from __future__ import annotations

from typing import Any

from rljob_api.crd import openapi_schema


def _type_of(node: dict[str, Any]) -> str:
    t = node.get("type", "object")
    if t == "array":
        return f"[]{_type_of(node.get('items', {}))}"
    if "enum" in node:
        return f"{t} ({' | '.join(map(str, node['enum']))})"
    return t


def lookup(path: str) -> dict[str, Any]:
    node = openapi_schema()
    walked = []
    for part in [p for p in path.split(".") if p and p != "rlj"]:
        props = node.get("properties") or node.get("items", {}).get("properties") or {}
        if part not in props:
            where = ".".join(walked) or "RLJob"
            raise KeyError(f"field {part!r} does not exist in {where}; fields: {', '.join(props) or '(none)'}")
        node = props[part]
        walked.append(part)
    return node


def explain(path: str) -> str:
    node = lookup(path)
    lines = [f"FIELD: {path} <{_type_of(node)}>", "", "DESCRIPTION:", f"  {node.get('description', '')}"]
    props = node.get("properties") or node.get("items", {}).get("properties") or {}
    if props:
        lines += ["", "FIELDS:"]
        required = set(node.get("required", []))
        for name, child in props.items():
            flag = " -required-" if name in required else ""
            lines.append(f"  {name} <{_type_of(child)}>{flag}")
            lines.append(f"    {child.get('description', '')}")
    return "\n".join(lines)
