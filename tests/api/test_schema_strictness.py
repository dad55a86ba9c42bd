"""The CRD's openAPIV3Schema as a strict JSON Schema (what `kubectl apply` with strict field validation
enforces): the examples pass, bad manifests fail at the right place, and it agrees with pydantic on
every schema case of api_cases (a field the models restrict and the CRD does not, or the reverse, fails)."""
from __future__ import annotations

import jsonschema
import pytest
from api_cases import CROSS_INVALID, CROSS_VALID, SCHEMA_INVALID, SCHEMA_VALID, M, R
from api_support import DELETE, EXAMPLE_PATHS, changed, crd_schema, gpu_job, load_yaml, to_jsonschema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = to_jsonschema(crd_schema())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def problems(validator, doc) -> list[tuple[str, str]]:
    return [(".".join(map(str, e.absolute_path)), e.message) for e in validator.iter_errors(doc)]


def test_conversion_is_strict_where_unknown_fields_are_not_preserved():
    schema = to_jsonschema(crd_schema())
    spec = schema["properties"]["spec"]
    assert spec["additionalProperties"] is False
    assert spec["properties"]["megatron"]["additionalProperties"] is False
    assert "additionalProperties" not in spec["properties"]["megatron"]["properties"]["overrideTransformerConfig"]
    assert spec["properties"]["algorithm"]["properties"]["dualClipC"]["type"] == ["number", "null"]
    assert spec["properties"]["rollout"]["properties"]["topP"]["exclusiveMinimum"] == 0


@pytest.mark.parametrize("path", EXAMPLE_PATHS, ids=[p.name for p in EXAMPLE_PATHS])
def test_examples_pass_the_crd_schema(validator, path):
    assert problems(validator, load_yaml(path)) == []


@pytest.mark.parametrize("changes, at, words", [
    ({M + "tensorParallelSize": 2}, "spec.megatron", "'tensorParallelSize' was unexpected"),
    ({"spec.gpus_per_node": 8}, "spec", "'gpus_per_node' was unexpected"),
    ({"spec.algorithm.klEstimator": "k4"}, "spec.algorithm.klEstimator", "is not one of"),
    ({R + "engine": "sglang"}, "spec.rollout.engine", "is not one of"),
    ({"spec.model.path": "models/qwen"}, "spec.model.path", "does not match"),
    ({"spec.checkpoint.uri": "gs://bucket/ckpt"}, "spec.checkpoint.uri", "does not match"),
    ({"spec.s3.endpoint": "minio:9000"}, "spec.s3.endpoint", "does not match"),
    ({R + "samplesPerPrompt": 1}, "spec.rollout.samplesPerPrompt", "less than the minimum"),
    ({R + "topP": 0}, "spec.rollout.topP", "less than or equal to the minimum"),
    ({"spec.nnodes": "2"}, "spec.nnodes", "is not of type 'integer'"),
    ({"spec.model.path": DELETE}, "spec.model", "'path' is a required property"),
    ({"spec.podTemplate.resources": {"limits": {"cpu": 0.5}}}, "spec.podTemplate.resources.limits.cpu", "not valid"),
], ids=["unknown-field", "snake-case", "enum", "enum-engine", "model-uri", "checkpoint-uri", "endpoint-url",
        "minimum", "exclusive-minimum", "string-for-int", "required", "float-quantity"])
def test_crd_schema_rejects(validator, changes, at, words):
    found = problems(validator, changed(gpu_job(), changes))
    assert any(path == at and words in message for path, message in found), found


@pytest.mark.parametrize("changes, path, words, crd", [c[1:] for c in SCHEMA_INVALID], ids=[c[0] for c in SCHEMA_INVALID])
def test_crd_schema_agrees_with_pydantic_on_invalid(validator, changes, path, words, crd):
    """Every schema-level case pydantic rejects, the CRD rejects too (unless marked as out of its reach)."""
    found = problems(validator, changed(gpu_job(), changes))
    if crd:
        assert found, f"pydantic rejects {path} but the CRD schema accepts it"
    else:
        assert not found, f"marked as beyond the CRD schema, but it rejects: {found}"


@pytest.mark.parametrize("changes", [c[1] for c in SCHEMA_VALID + CROSS_VALID],
                         ids=[c[0] for c in SCHEMA_VALID + CROSS_VALID])
def test_crd_schema_agrees_with_pydantic_on_valid(validator, changes):
    assert problems(validator, changed(gpu_job(), changes)) == []


@pytest.mark.parametrize("changes", [c[1] for c in CROSS_INVALID], ids=[c[0] for c in CROSS_INVALID])
def test_cross_field_cases_are_schema_valid(validator, changes):
    """Cross-field cases change only valid values, so what rejects them is a CEL rule or the operator."""
    assert problems(validator, changed(gpu_job(), changes)) == []
