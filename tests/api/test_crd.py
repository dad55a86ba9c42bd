"""The committed CRD: no drift from the models, valid for `kubernetes-validate --strict`, and a
structural schema that a real API server accepts (the checks apiextensions applies on create)."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from api_support import CRD_PATH, crd_doc, crd_schema, schema_nodes
from rljob_api.crd import build_crd, crd_yaml, openapi_schema
from rljob_api.models import RLJobSpec

TYPES = {"object", "array", "string", "integer", "number", "boolean"}
# JSONSchemaProps fields a structural schema may use (no $ref, definitions, patternProperties, dependencies,
# additionalItems, uniqueItems, id, $schema; anyOf/allOf/oneOf/not are checked separately).
ALLOWED_KEYS = {
    "description", "type", "format", "title", "default", "example", "nullable", "enum",
    "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "multipleOf",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "maxProperties", "minProperties",
    "required", "items", "properties", "additionalProperties",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-int-or-string",
    "x-kubernetes-list-map-keys", "x-kubernetes-list-type", "x-kubernetes-map-type", "x-kubernetes-validations",
}
VALIDATION_REASONS = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"}
REGEN = "run `rljob crd > crds/rljob.dev_rljobs.yaml` and commit the result"


def where(path: tuple) -> str:
    return ".".join(path) or "(root)"


# --------------------------------------------------------------------------- drift


def test_committed_crd_matches_models():
    committed = CRD_PATH.read_text()
    assert committed == crd_yaml(), f"{CRD_PATH.name} differs from what the models generate: {REGEN}"


def test_committed_crd_parses_to_build_crd():
    assert yaml.safe_load(CRD_PATH.read_text()) == build_crd(), REGEN


def test_crd_generation_is_deterministic():
    assert crd_yaml() == crd_yaml()


# --------------------------------------------------------------------------- kubernetes-validate


def test_kubernetes_validate_strict_cli():
    exe = shutil.which("kubernetes-validate")
    cmd = [exe] if exe else [sys.executable, "-m", "kubernetes_validate"]
    proc = subprocess.run([*cmd, "--strict", str(CRD_PATH)], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubernetes-validate --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "passed" in proc.stdout + proc.stderr


def test_kubernetes_validate_strict_catches_a_broken_crd():
    """The check above can fail: an unknown field and a non-string type are rejected."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(crd_doc(), version, strict=True)
    bad = crd_doc()
    bad["spec"]["versions"][0]["servedd"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)
    bad = crd_doc()
    bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["nnodes"]["type"] = \
        ["integer", "null"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


# --------------------------------------------------------------------------- CRD envelope


def test_crd_names_scope_and_version():
    crd = crd_doc()
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}" == "rljobs.rljob.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "RLJob" and spec["names"]["shortNames"] == ["rlj"]
    assert spec["names"]["singular"] == "rljob" and spec["names"]["listKind"] == "RLJobList"
    assert spec["names"]["categories"]
    [version] = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_printer_columns():
    [version] = crd_doc()["spec"]["versions"]
    cols = {c["name"].upper(): c for c in version["additionalPrinterColumns"]}
    default_cols = [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert default_cols[:6] == ["STEP", "REWARD", "RUNNING", "SUCCEEDED", "QUEUE", "AGE"]
    assert cols["QUEUE"]["jsonPath"] == '.status.conditions[?(@.type=="Admitted")].reason' 
    assert cols["CHECKPOINT"]["priority"] == 1
    assert cols["TRACKER"]["priority"] == 1 and cols["TRACKER"]["jsonPath"] == ".status.trainer.trackerRuns[0].url"
    assert cols["AGE"]["jsonPath"] == ".metadata.creationTimestamp" and cols["AGE"]["type"] == "date"
    assert cols["RUNNING"]["jsonPath"] == '.status.conditions[?(@.type=="Running")].status'
    schema = crd_schema()
    for col in version["additionalPrinterColumns"]:
        assert col["type"] in {"integer", "number", "string", "boolean", "date"}
        # every column's jsonPath (before any filter or index) names a field of the schema
        parts = re.sub(r"\[\?\(.*?\)\]|\[\d+\]", "", col["jsonPath"]).strip(".").split(".")
        node = schema
        for part in parts:
            if part == "creationTimestamp" and node is schema["properties"]["metadata"]:
                break
            props = node.get("properties") or node.get("items", {}).get("properties", {})
            assert part in props, f"printer column {col['name']}: {col['jsonPath']} is not in the schema"
            node = props[part]


def test_status_conditions_are_a_map_keyed_by_type():
    conditions = crd_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    items = conditions["items"]
    for key in ("type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"):
        assert key in items["properties"], key
    assert "phase" not in crd_schema()["properties"]["status"]["properties"]


def test_status_has_trainer_progress_and_checkpoint():
    status = crd_schema()["properties"]["status"]["properties"]
    trainer = status["trainer"]["properties"]
    for key in ("step", "totalSteps", "progressPercentage", "rewardMean", "lastUpdatedTime"):
        assert key in trainer
    assert set(trainer["lastCheckpoint"]["properties"]) >= {"step", "uri", "time"}
    for key in ("observedGeneration", "pytorchJobName", "startTime", "completionTime"):
        assert key in status


def test_spec_properties_are_the_model_fields():
    spec = crd_schema()["properties"]["spec"]
    aliases = {f.alias or name for name, f in RLJobSpec.model_fields.items()}
    assert set(spec["properties"]) == aliases
    assert spec["required"] == ["model"]
    assert spec["properties"]["model"]["required"] == ["path"]


# --------------------------------------------------------------------------- structural schema


def structural_problems(schema: dict) -> list[str]:
    """What the API server's structural-schema validation (and CRD validation) would complain about."""
    problems = []
    for path, node in schema_nodes(schema):
        at = where(path)
        unknown = set(node) - ALLOWED_KEYS - {"anyOf", "allOf", "oneOf", "not"}
        if unknown:
            problems.append(f"{at}: keys not allowed in a structural schema: {sorted(unknown)}")
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
        for combinator in ("anyOf", "allOf", "oneOf", "not"):
            if combinator in node and not (int_or_string and combinator == "anyOf" and all(
                    set(s) <= {"type"} and s.get("type") in {"integer", "string"} for s in node["anyOf"])):
                problems.append(f"{at}: {combinator} is not allowed here")
        if "type" in node:
            if not isinstance(node["type"], str) or node["type"] not in TYPES:
                problems.append(f"{at}: type {node['type']!r} is not a single OpenAPI type")
            if int_or_string:
                problems.append(f"{at}: x-kubernetes-int-or-string must not have a type")
        elif not (int_or_string or preserve):
            problems.append(f"{at}: every node needs a type (unless int-or-string or preserving unknown fields)")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{at}: properties and additionalProperties on one node")
        if "additionalProperties" in node and not isinstance(node["additionalProperties"], dict):
            problems.append(f"{at}: additionalProperties must be a schema, not {node['additionalProperties']!r}")
        if ("properties" in node or "additionalProperties" in node) and node.get("type") not in (None, "object"):
            problems.append(f"{at}: properties on a non-object")
        if node.get("type") == "array" and not isinstance(node.get("items"), dict):
            problems.append(f"{at}: an array needs one items schema")
        if "items" in node and node.get("type") != "array":
            problems.append(f"{at}: items on a non-array")
        for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if flag in node and (not isinstance(node[flag], bool) or bound not in node):
                problems.append(f"{at}: {flag} must be a boolean next to {bound} (OpenAPI v3.0)")
        if "pattern" in node:
            try:
                re.compile(node["pattern"])
            except re.error as exc:
                problems.append(f"{at}: pattern does not compile: {exc}")
            if re.search(r"\(\?[=!<]|\\[1-9]", node["pattern"]):
                problems.append(f"{at}: pattern uses look-around or back-references (RE2 has neither)")
        if "enum" in node:
            py = {"string": str, "integer": int, "number": (int, float), "boolean": bool}.get(str(node.get("type")))
            if py is None or not all(isinstance(v, py) for v in node["enum"]):
                problems.append(f"{at}: enum values must match the node's type")
        for req in node.get("required", []):
            if req not in node.get("properties", {}):
                problems.append(f"{at}: required {req!r} is not a property")
        if node.get("x-kubernetes-list-type") == "map":
            keys = node.get("x-kubernetes-list-map-keys") or []
            items = node.get("items", {})
            if not keys:
                problems.append(f"{at}: list-type map needs x-kubernetes-list-map-keys")
            for key in keys:
                prop = items.get("properties", {}).get(key)
                if prop is None:
                    problems.append(f"{at}: map key {key!r} is not a property of the items")
                elif prop.get("type") not in {"string", "integer", "boolean", "number"}:
                    problems.append(f"{at}: map key {key!r} must be a scalar")
                elif key not in items.get("required", []) and "default" not in prop:
                    problems.append(f"{at}: map key {key!r} must be required or defaulted")
        if "x-kubernetes-list-map-keys" in node and node.get("x-kubernetes-list-type") != "map":
            problems.append(f"{at}: list-map-keys without list-type map")
    metadata = schema.get("properties", {}).get("metadata", {})
    if set(metadata) - {"type", "description"} or metadata.get("type") != "object":
        problems.append("metadata: at the root only `type: object` is allowed")
    return problems


def test_schema_is_structural():
    problems = structural_problems(crd_schema())
    assert not problems, "\n".join(problems)


def test_no_ref_anywhere():
    assert "$ref" not in CRD_PATH.read_text() and "$defs" not in CRD_PATH.read_text()


@pytest.mark.parametrize("breakage, words", [
    (lambda s: s["properties"]["spec"]["properties"].__setitem__("x", {"$ref": "#/definitions/X"}), "not allowed"),
    (lambda s: s["properties"]["spec"]["properties"]["nnodes"].pop("type"), "needs a type"),
    (lambda s: s["properties"]["spec"]["properties"]["model"].__setitem__("additionalProperties", False),
     "properties and additionalProperties"),
    (lambda s: s["properties"]["spec"]["properties"]["image"].__setitem__(
        "anyOf", [{"type": "string"}, {"type": "null"}]), "anyOf is not allowed"),
    (lambda s: s["properties"]["status"]["properties"]["conditions"].__setitem__("x-kubernetes-list-map-keys", ["kind"]),
     "map key 'kind'"),
    (lambda s: s["properties"]["status"]["properties"]["conditions"]["items"]["required"].remove("type"),
     "must be required"),
    (lambda s: s["properties"]["spec"]["properties"]["rollout"]["properties"]["topP"].__setitem__(
        "exclusiveMinimum", 0), "must be a boolean"),
    (lambda s: s["properties"]["spec"]["properties"]["device"].__setitem__("type", ["string", "null"]), "single"),
    (lambda s: s["properties"]["metadata"].__setitem__("properties", {"name": {"type": "string"}}), "metadata"),
], ids=["ref", "no-type", "props-and-additional", "anyof-null", "map-key-missing", "map-key-optional",
        "numeric-exclusive-min", "type-list", "metadata-restricted"])
def test_structural_check_can_fail(breakage, words):
    schema = copy.deepcopy(crd_schema())
    breakage(schema)
    problems = structural_problems(schema)
    assert any(words in p for p in problems), problems


def described_fields(schema: dict) -> list[tuple[str, str]]:
    """(path, description) of every field: each property of every object, nested in items too."""
    out = []
    for path, node in schema_nodes(schema):
        for name, child in (node.get("properties") or {}).items():
            out.append((where(path + (name,)), (child.get("description") or "").strip()))
    return out


def test_every_field_has_a_description():
    fields = described_fields(crd_schema())
    assert len(fields) > 150
    missing = [p for p, d in fields if not d and p != "metadata"]  # metadata: the API server's ObjectMeta
    assert not missing, f"fields without a description: {missing}"


def test_description_check_can_fail():
    schema = copy.deepcopy(crd_schema())
    schema["properties"]["spec"]["properties"]["rollout"]["properties"]["samplesPerPrompt"]["description"] = " "
    assert ("spec.rollout.samplesPerPrompt", "") in described_fields(schema)


def test_descriptions_show_defaults():
    spec = crd_schema()["properties"]["spec"]["properties"]
    assert spec["rollout"]["properties"]["samplesPerPrompt"]["description"].endswith("Default: 8.")
    assert "Default: low_var_kl." in spec["algorithm"]["properties"]["klEstimator"]["description"]


def test_no_server_side_defaults():
    """Defaults live in the models (so an omitted field means the model default to CEL and pydantic alike)."""
    assert not [where(p) for p, n in schema_nodes(crd_schema()) if "default" in n]


def test_enums_and_bounds_reach_the_schema():
    spec = crd_schema()["properties"]["spec"]["properties"]
    assert spec["algorithm"]["properties"]["klEstimator"]["enum"] == ["k1", "k2", "k3", "low_var_kl"]
    assert spec["algorithm"]["properties"]["lossAggregation"]["enum"] == [
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    assert spec["rollout"]["properties"]["samplesPerPrompt"]["minimum"] == 2
    top_p = spec["rollout"]["properties"]["topP"]
    assert top_p["minimum"] == 0 and top_p["exclusiveMinimum"] is True
    assert spec["model"]["properties"]["path"]["pattern"].startswith("^(s3://")
    assert spec["megatron"]["properties"]["overrideTransformerConfig"]["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["algorithm"]["properties"]["dualClipC"]["nullable"] is True
    cpu = spec["podTemplate"]["properties"]["resources"]["additionalProperties"]["additionalProperties"]
    assert cpu == {"x-kubernetes-int-or-string": True}


# --------------------------------------------------------------------------- CEL rules are well-formed


def cel_rule_nodes(schema: dict):
    for path, node in schema_nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            yield path, node, rule


def test_cel_rules_are_well_formed():
    import celpy

    env = celpy.Environment()
    rules = list(cel_rule_nodes(crd_schema()))
    assert len(rules) >= 6
    for path, node, rule in rules:
        assert set(rule) <= {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"}
        assert rule["message"].strip() and "\n" not in rule["message"]
        assert rule.get("reason", "FieldValueInvalid") in VALIDATION_REASONS
        env.compile(rule["rule"])  # parses
        if "fieldPath" in rule:  # the API server requires fieldPath to name a field of the node's schema
            target = node
            for part in rule["fieldPath"].lstrip(".").split("."):
                assert part in target.get("properties", {}), f"{where(path)}: fieldPath {rule['fieldPath']} is not a field"
                target = target["properties"][part]
        # self.<field> references must exist in the schema of the node the rule is attached to
        for ref in re.findall(r"self((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", rule["rule"]):
            target = node
            for part in ref.strip(".").split("."):
                assert part in target.get("properties", {}), f"{where(path)}: rule reads self{ref}, not in the schema"
                target = target["properties"][part]


def test_openapi_schema_is_what_the_crd_carries():
    assert build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == openapi_schema()
