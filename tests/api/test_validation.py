"""Table-driven tests of `parse_rljob` / `cross_field_errors`: every rule, invalid and valid at its boundary.

Each invalid case names the exact set of field paths reported and words of each message that tell
the user how to fix it; each valid case is the nearest spec the rule accepts.
"""
from __future__ import annotations

import datetime
from types import MappingProxyType

import pytest
from api_cases import (
    BUILTIN_SHAPE_INVALID,
    BUILTIN_SHAPE_VALID,
    CROSS_INVALID,
    CROSS_VALID,
    ENGINE_LAYOUT_INVALID,
    ENGINE_LAYOUT_VALID,
    SCHEMA_INVALID,
    SCHEMA_VALID,
    M,
    R,
    T,
)
from api_support import DELETE, EXAMPLE_PATHS, changed, errors_of, gpu_job, load_yaml
from rljob_api.models import RLJob
from rljob_api.validation import (
    FieldError,
    RLJobValidationError,
    actor_token_budget_in_effect,
    critic_data_parallel_size,
    critic_takes_turns,
    cross_field_errors,
    data_parallel_size,
    name_errors,
    parse_rljob,
    parse_spec,
    pool_ranks,
    processes_per_node,
)


def assert_errors(doc, expected: dict[str, list[str]]) -> None:
    errors = errors_of(doc)
    shown = "\n".join(map(str, errors)) or "(no errors)"
    assert {e.path for e in errors} == set(expected), f"reported:\n{shown}"
    for err in errors:
        for words in expected[err.path]:
            assert words in err.message, f"{err.path}: {err.message!r} should say {words!r}"


# --------------------------------------------------------------------------- cross-field rules


@pytest.mark.parametrize("changes, expected", [c[1:] for c in CROSS_INVALID], ids=[c[0] for c in CROSS_INVALID])
def test_cross_field_rule_rejects(changes, expected):
    assert_errors(changed(gpu_job(), changes), expected)


@pytest.mark.parametrize("changes", [c[1] for c in CROSS_VALID], ids=[c[0] for c in CROSS_VALID])
def test_cross_field_rule_accepts_boundary(changes):
    assert_errors(changed(gpu_job(), changes), {})


@pytest.mark.parametrize("changes, expected", [c[1:] for c in BUILTIN_SHAPE_INVALID],
                         ids=[c[0] for c in BUILTIN_SHAPE_INVALID])
def test_builtin_model_shape_rejects_sizes_it_cannot_be_split_by(changes, expected):
    assert_errors(changed(gpu_job(), changes), expected)


@pytest.mark.parametrize("changes", [c[1] for c in BUILTIN_SHAPE_VALID], ids=[c[0] for c in BUILTIN_SHAPE_VALID])
def test_builtin_model_shape_accepts_sizes_that_fit(changes):
    assert_errors(changed(gpu_job(), changes), {})


@pytest.mark.parametrize("changes, expected", [c[1:] for c in ENGINE_LAYOUT_INVALID],
                         ids=[c[0] for c in ENGINE_LAYOUT_INVALID])
def test_rollout_engine_rejects_a_rollout_tp_it_cannot_shard(changes, expected):
    assert_errors(changed(gpu_job(), changes), expected)


@pytest.mark.parametrize("changes", [c[1] for c in ENGINE_LAYOUT_VALID], ids=[c[0] for c in ENGINE_LAYOUT_VALID])
def test_rollout_engine_accepts_a_rollout_tp_it_serves(changes):
    assert_errors(changed(gpu_job(), changes), {})


def test_cross_field_errors_is_pure_and_returns_field_errors():
    job = RLJob.model_validate(changed(gpu_job(), {M + "tensorModelParallelSize": 3}))
    before = job.model_dump()
    first, second = cross_field_errors(job.spec), cross_field_errors(job.spec)
    assert first == second and all(isinstance(e, FieldError) for e in first)
    assert job.model_dump() == before
    assert str(first[0]).startswith("spec.megatron.tensorModelParallelSize: ")


def test_data_parallel_size():
    job = parse_rljob(changed(gpu_job(), {"spec.nnodes": 2, M + "tensorModelParallelSize": 2,
                                          M + "pipelineModelParallelSize": 2}))
    assert data_parallel_size(job.spec) == 4


# --------------------------------------------------------------------------- schema rules



@pytest.mark.parametrize("changes, path, words", [c[1:4] for c in SCHEMA_INVALID], ids=[c[0] for c in SCHEMA_INVALID])
def test_schema_rule_rejects(changes, path, words):
    assert_errors(changed(gpu_job(), changes), {path: words})


@pytest.mark.parametrize("changes", [c[1] for c in SCHEMA_VALID], ids=[c[0] for c in SCHEMA_VALID])
def test_schema_rule_accepts_boundary(changes):
    assert_errors(changed(gpu_job(), changes), {})


def test_schema_errors_are_all_reported_together():
    doc = changed(gpu_job(), {"spec.nnodes": 0, R + "engine": "sglang", M + "tensorParallelSize": 2,
                              "spec.model.path": DELETE})
    assert {e.path for e in errors_of(doc)} == {"spec.nnodes", R + "engine", M + "tensorParallelSize", "spec.model.path"}


def test_unknown_field_hints_name_the_field_meant_and_only_a_close_one():
    """A capitalised top-level key points at the RLJob's own fields; a key that merely starts with a real name
    (namespace, name) and one like nothing (replicas) get no guess."""
    errors = {e.path: e.message for e in errors_of(changed(gpu_job(), {"Spec": gpu_job()["spec"], "spec": DELETE}))}
    assert "`rljob explain rlj`; did you mean spec?" in errors["Spec"], errors
    for changes, path in [({"spec.s3.credentialsSecretRef": {"name": "s", "namespace": "x"}},
                           "spec.s3.credentialsSecretRef.namespace"), ({"spec.replicas": 2}, "spec.replicas")]:
        [err] = errors_of(changed(gpu_job(), changes))
        assert err.path == path and "unknown field" in err.message and "did you mean" not in err.message, err


def test_only_a_quoted_value_of_the_right_type_is_told_to_lose_its_quotes():
    for changes, path in [({"spec.nnodes": "two"}, "spec.nnodes"), ({"spec.nnodes": "1.5"}, "spec.nnodes"),
                          ({"spec.suspend": "yes"}, "spec.suspend"), ({T + "lr": "nan"}, T + "lr")]:
        [err] = errors_of(changed(gpu_job(), changes))
        assert err.path == path and "without quotes" not in err.message, err


def test_quantities_reach_consumers_as_strings():
    job = parse_rljob(changed(gpu_job(), {"spec.podTemplate.resources": {"requests": {"cpu": 4, "memory": "64Gi"}}}))
    assert job.spec.pod_template.resources == {"requests": {"cpu": "4", "memory": "64Gi"}}


# --------------------------------------------------------------------------- apiVersion, kind, document shape


@pytest.mark.parametrize("changes, path, words", [
    ({"apiVersion": "rljob.dev/v1"}, "apiVersion", ["must be 'rljob.dev/v1alpha1'", "got 'rljob.dev/v1'"]),
    ({"apiVersion": "kubeflow.org/v1alpha1"}, "apiVersion", ["must be 'rljob.dev/v1alpha1'"]),
    ({"apiVersion": DELETE}, "apiVersion", ["must be 'rljob.dev/v1alpha1'", "got None"]),
    ({"kind": "PyTorchJob"}, "kind", ["must be 'RLJob'", "got 'PyTorchJob'"]),
    ({"kind": "rljob"}, "kind", ["must be 'RLJob'"]),
    ({"kind": DELETE}, "kind", ["must be 'RLJob'"]),
], ids=["version-v1", "other-group", "no-apiversion", "pytorchjob", "lowercase-kind", "no-kind"])
def test_header_rejected(changes, path, words):
    assert_errors(changed(gpu_job(), changes), {path: words})


def test_wrong_apiversion_and_kind_both_reported():
    doc = changed(gpu_job(), {"apiVersion": "v1", "kind": "ConfigMap"})
    assert {e.path for e in errors_of(doc)} == {"apiVersion", "kind"}


@pytest.mark.parametrize("doc", [None, [], ["a"], "RLJob", 3], ids=["null", "empty-list", "list", "string", "int"])
def test_non_mapping_document(doc):
    with pytest.raises(RLJobValidationError) as info:
        parse_rljob(doc)
    [err] = info.value.errors
    assert err.path == "(root)" and "expected a mapping" in err.message


def test_validation_error_lists_every_error():
    exc = RLJobValidationError([FieldError("a", "x"), FieldError("b.c", "y")])
    assert str(exc) == "a: x; b.c: y"
    assert isinstance(exc, ValueError)


def test_name_errors_directly():
    assert name_errors("ok-name") == []
    assert [e.path for e in name_errors("-bad")] == ["metadata.name"]


def test_name_must_start_with_a_letter():
    """The training-operator's Service <name>-master-0 is a DNS-1035 label: 7b-grpo would fail at its creation."""
    assert name_errors("grpo-7b") == []
    [err] = errors_of(changed(gpu_job(), {"metadata.name": "7b-grpo"}))
    assert err.path == "metadata.name" and "starting with a letter" in err.message, err
    assert "Service <name>-master-0 must start with a letter" in err.message, err


# --------------------------------------------------------------------------- parse_spec (the worker's entry)


def test_parse_spec_prefixes_paths_and_is_strict():
    spec = changed(gpu_job(), {"spec.model.path": DELETE, "spec.nnodes": "1", "spec.gpusPerNode": DELETE,
                                    "spec.gpus_per_node": 8})["spec"]
    with pytest.raises(RLJobValidationError) as info:
        parse_spec(spec)
    assert {e.path for e in info.value.errors} == {"spec.model.path", "spec.nnodes", "spec.gpus_per_node"}


def test_parse_spec_runs_cross_field_rules():
    with pytest.raises(RLJobValidationError) as info:
        parse_spec(changed(gpu_job(), {M + "sequenceParallel": True})["spec"])
    assert [e.path for e in info.value.errors] == [M + "sequenceParallel"]


def test_parse_spec_accepts_its_own_json_dump():
    job = parse_rljob(load_yaml(EXAMPLE_PATHS[0]))
    again = parse_spec(job.spec.model_dump(mode="json", by_alias=True))  # as the launcher writes spec.json
    assert again == job.spec


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("path", EXAMPLE_PATHS, ids=[p.name for p in EXAMPLE_PATHS])
def test_example_validates_and_round_trips(path):
    doc = load_yaml(path)
    assert errors_of(doc) == []
    job = parse_rljob(doc)
    dumped = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert parse_rljob(dumped) == job


def test_examples_present():
    names = {p.name for p in EXAMPLE_PATHS}
    assert {"quickstart.yaml", "qwen3-8b-grpo-megatron.yaml", "qwen3-30b-a3b-moe.yaml",
            "qwen2.5-7b-grpo-tp4.yaml", "qwen2.5-7b-grpo-tp2.yaml"} <= names


def _example(name: str):
    return parse_rljob(load_yaml(EXAMPLE_PATHS[0].parent / name)).spec


def test_siirl_qwen3_8b_recipe_translated():
    s = _example("qwen3-8b-grpo-megatron.yaml")
    m, t, c = s.megatron, s.training, s.checkpoint
    assert (s.nnodes, s.gpus_per_node) == (1, 8)
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size) == (2, 4, 1)
    assert m.sequence_parallel and m.use_distributed_optimizer
    assert t.lr == 1e-6 and s.rollout.samples_per_prompt == 8
    assert (s.data.max_prompt_length, s.data.max_response_length) == (1024, 2048)
    assert (c.save_freq, c.max_to_keep, c.resume_mode.value) == (30, 5, "auto")
    assert (t.test_freq, t.total_epochs, t.val_before_train) == (10, 30, True)


def test_moe_example_uses_ep_and_full_recompute():
    m = _example("qwen3-30b-a3b-moe.yaml").megatron
    assert m.expert_model_parallel_size > 1
    assert (m.recompute_granularity.value, m.recompute_method.value, m.recompute_num_layers) == ("full", "uniform", 1)


def test_tp_variants():
    assert _example("qwen2.5-7b-grpo-tp4.yaml").megatron.tensor_model_parallel_size == 4
    assert _example("qwen2.5-7b-grpo-tp2.yaml").megatron.tensor_model_parallel_size == 2


def test_quickstart_runs_on_cpu_without_files():
    s = _example("quickstart.yaml")
    assert s.device == "cpu" and s.data.synthetic is not None and not s.data.train_files
    assert s.model.path.startswith("builtin://")


# --------------------------------------------------------------------------- input shapes other than plain YAML dicts


def test_any_mapping_is_accepted_like_kopf_bodies():
    doc = gpu_job()
    view = MappingProxyType({**doc, "spec": MappingProxyType({**doc["spec"], "model": MappingProxyType(doc["spec"]["model"])})})
    assert parse_rljob(view).spec.model.path == "/models/qwen"


def test_yaml_only_values_become_what_json_carries():
    doc = changed(gpu_job(), {"spec.podTemplate.labels": {1: "a", None: "b"},
                              "spec.podTemplate.annotations": {"since": datetime.date(2024, 1, 2)}})
    pod = parse_rljob(doc).spec.pod_template
    assert pod.labels == {"1": "a", "null": "b"} and pod.annotations == {"since": "2024-01-02"}


def test_non_json_values_are_reported_with_their_path():
    doc = changed(gpu_job(), {"spec.image": b"bytes"})
    assert [(e.path, "quote it" in e.message) for e in errors_of(doc)] == [("spec.image", True)]


def test_ppo_examples_translate_the_three_critic_placements_and_trinity():
    split = _example("qwen2.5-7b-ppo-split.yaml")
    assert split.algorithm.advantage_estimator.value == "gae" and split.critic.placement.value == "split"
    assert (split.gpus_per_node, split.critic.gpus) == (8, 4)
    assert split.megatron.tensor_model_parallel_size == split.critic.megatron.tensor_model_parallel_size == 4
    assert split.critic.output_layer_index == 20 and split.critic.megatron.pipeline_model_parallel_size == 1
    assert (data_parallel_size(split), critic_data_parallel_size(split)) == (1, 1)
    assert pool_ranks(split) == ([0, 1, 2, 3], [4, 5, 6, 7])
    shared = _example("qwen2.5-7b-ppo-shared.yaml")
    assert (shared.gpus_per_node, shared.critic.placement.value) == (2, "shared")
    assert shared.megatron.tensor_model_parallel_size == shared.critic.megatron.tensor_model_parallel_size == 2
    assert shared.critic.megatron.param_offload and shared.megatron.param_offload
    assert pool_ranks(shared) == ([0, 1], [0, 1])
    sequential = _example("qwen2.5-7b-ppo-sequential.yaml")
    assert (sequential.gpus_per_node, sequential.critic.placement.value) == (8, "shared")
    trinity = _example("trinity-ppo-megatron.yaml")
    assert trinity.critic.megatron.tensor_model_parallel_size == 4
    # shared, with its own sizes: a critic process beside each actor process (16 per pod), taking turns
    assert critic_takes_turns(trinity) and not critic_takes_turns(shared) and not critic_takes_turns(split)
    assert processes_per_node(trinity) == 16 and processes_per_node(shared) == 2 and processes_per_node(split) == 8
    assert pool_ranks(trinity) == (list(range(8)), list(range(8, 16)))
    assert (data_parallel_size(trinity), critic_data_parallel_size(trinity)) == (2, 2)  # TP2 x PP2 and TP4 of 8
    assert trinity.megatron.recompute_granularity.value == trinity.critic.megatron.recompute_granularity.value == "full"
    assert trinity.algorithm.gae_lambda == 0.95
    for spec in (split, shared, sequential, trinity):
        assert spec.critic.model.path is None  # the critic starts from the actor's checkpoint


@pytest.mark.parametrize(("nnodes", "gpus", "critic_gpus", "actor", "critic"), [
    (1, 8, 4, [0, 1, 2, 3], [4, 5, 6, 7]),
    (2, 4, 2, [0, 1, 4, 5], [2, 3, 6, 7]),
    (2, 2, None, [0, 1, 2, 3], [0, 1, 2, 3]),  # shared: both pools are the whole world
])
def test_pool_ranks_split_every_node_the_same_way(nnodes, gpus, critic_gpus, actor, critic):
    critic_spec = {"placement": "split", "gpus": critic_gpus} if critic_gpus else {}
    doc = changed(gpu_job(), {"spec.nnodes": nnodes, "spec.gpusPerNode": gpus, "spec.algorithm.advantageEstimator": "gae",
                              "spec.critic": critic_spec, "spec.training.microBatchSizePerGpu": 1})
    spec = parse_rljob(doc).spec
    assert pool_ranks(spec) == (actor, critic)
    assert data_parallel_size(spec) == len(actor) and critic_data_parallel_size(spec) == len(critic)


@pytest.mark.parametrize(("nnodes", "gpus", "actor", "critic"), [
    (1, 2, [0, 1], [2, 3]),
    (2, 2, [0, 1, 4, 5], [2, 3, 6, 7]),  # per node: the actor's processes first, then the critic's
])
def test_a_shared_critic_with_its_own_layout_gets_a_process_beside_every_actor_process(nnodes, gpus, actor, critic):
    doc = changed(gpu_job(), {"spec.nnodes": nnodes, "spec.gpusPerNode": gpus, "spec.algorithm.advantageEstimator": "gae",
                              "spec.critic": {"megatron": {"tensorModelParallelSize": 2}},
                              "spec.training.microBatchSizePerGpu": 1})
    spec = parse_rljob(doc).spec
    assert critic_takes_turns(spec) and processes_per_node(spec) == 2 * gpus
    assert pool_ranks(spec) == (actor, critic)
    assert data_parallel_size(spec) == nnodes * gpus and critic_data_parallel_size(spec) == nnodes * gpus // 2


def test_pool_ranks_without_critic_is_the_actor_alone():
    assert pool_ranks(parse_rljob(gpu_job()).spec) == (list(range(8)), [])


def test_lambda_is_the_yaml_key_of_gae_lambda():
    spec = parse_rljob(changed(gpu_job(), {"spec.algorithm.advantageEstimator": "gae", "spec.algorithm.lambda": 0.9,
                                           "spec.critic": {}})).spec
    assert spec.algorithm.gae_lambda == 0.9
    assert spec.model_dump(mode="json", by_alias=True)["algorithm"]["lambda"] == 0.9


@pytest.mark.parametrize(("change", "on_gpu", "want"), [
    ({}, True, 4 * (1024 + 2048)),  # unset on a GPU: microBatchSizePerGpu full rows
    ({}, False, None),  # unset on a CPU: rows
    ({"spec.megatron.pipelineModelParallelSize": 2}, True, None),  # a pipeline pads to the step's largest
    ({"spec.training.maxTokensPerMicroBatch": 0}, True, None),  # 0: rows everywhere
    ({"spec.training.maxTokensPerMicroBatch": 20000}, False, 20000),  # set: that budget
    ({"spec.training.maxTokensPerMicroBatch": 20000, "spec.megatron.pipelineModelParallelSize": 2}, True, 20000),
])
def test_actor_token_budget_in_effect(change, on_gpu, want):
    spec = parse_rljob(changed(gpu_job(), change)).spec
    assert actor_token_budget_in_effect(spec, on_gpu=on_gpu) == want
