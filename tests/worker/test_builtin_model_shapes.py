"""rljob_api's copy of the builtin:// model shapes (validation refuses sizes they cannot be split by, without the
worker's dependencies) against the worker's configs and its own start-up checks, so that the two cannot drift."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from rljob_api.models import (
    BUILTIN_MODEL_SHAPES,
    BUILTIN_TOOL_MODEL_NAMES,
    VLLM_MIN_TP_HEAD_DIM,
    BuiltinShape,
    MegatronSpec,
    RLJobSpec,
)
from rljob_api.validation import builtin_rollout_errors, builtin_shape_errors
from rljob_worker.data.builtin_models import BUILTIN_MODELS, materialize_builtin


def test_the_api_shapes_are_the_worker_configs():
    assert list(BUILTIN_MODEL_SHAPES) == list(BUILTIN_MODELS)
    for name, cfg in BUILTIN_MODELS.items():
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        assert BUILTIN_MODEL_SHAPES[name] == BuiltinShape(
            attention_heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
            layers=cfg["num_hidden_layers"], head_dim=head_dim, experts=cfg.get("num_experts", 0)), name


def test_the_api_vllm_head_width_bound_is_the_workers():
    from rljob_worker.rollout.vllm_engine import MIN_TP_HEAD_DIM

    assert VLLM_MIN_TP_HEAD_DIM == MIN_TP_HEAD_DIM


LAYOUTS = [(tp, pp, vpp, ep) for tp, pp, vpp, ep in itertools.product([1, 2, 4, 8], [1, 2, 4], [None, 2], [1, 2, 4, 8])
           if not (vpp and pp == 1)]  # VPP without PP: a rule of its own (megatron_errors), not the model's


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_validation_refuses_exactly_the_layouts_the_worker_refuses(name):
    """The worker's start-up checks (check_hf_config: heads, KV heads, FFN and experts; check_layer_split: layers;
    check_training_layout: MoE under TP needs sequence parallelism) against builtin_shape_errors over a grid of
    TP x PP x VPP x EP x SP."""
    from rljob_worker.megatron.engine_config import ParallelConfig, check_layer_split
    from rljob_worker.megatron.model_config import check_hf_config
    from rljob_worker.megatron.moe import check_training_layout

    config = SimpleNamespace(**BUILTIN_MODELS[name])
    disagreements = []
    for (tp, pp, vpp, ep), sp in itertools.product(LAYOUTS, [False, True]):
        if sp and tp == 1:
            continue  # SP without TP: a rule of its own (megatron_errors)
        try:
            check_hf_config(config, tp, ep)
            check_layer_split(config.num_hidden_layers, ParallelConfig(tp=tp, pp=pp, vpp=vpp, ep=ep))
            check_training_layout(config, tp, sp)
            worker = None
        except ValueError as exc:
            worker = str(exc)
        m = MegatronSpec.model_validate({"tensorModelParallelSize": tp, "pipelineModelParallelSize": pp,
                                         "virtualPipelineModelParallelSize": vpp, "expertModelParallelSize": ep,
                                         "sequenceParallel": sp})
        api = builtin_shape_errors(name, m, "spec.megatron")
        if bool(api) != bool(worker):
            disagreements.append((tp, pp, vpp, ep, sp, worker, [str(e) for e in api]))
    assert not disagreements, disagreements[:3]


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
@pytest.mark.parametrize("rollout_tp", [1, 2, 4])
def test_validation_refuses_the_vllm_rollout_tp_the_worker_refuses(name, rollout_tp):
    """Every rollout TP that vllm_engine.check_tensor_parallel_shape refuses is refused by validation too (which also
    refuses a TP that does not divide the heads: vLLM's own rule)."""
    from rljob_worker.rollout.vllm_engine import check_tensor_parallel_shape
    from rljob_worker.startup_errors import StartupError

    spec = RLJobSpec.model_validate({"gpusPerNode": 8, "model": {"path": f"builtin://{name}"},
                                     "rollout": {"engine": "vllm", "tensorModelParallelSize": rollout_tp}})
    try:
        check_tensor_parallel_shape(BUILTIN_MODELS[name], rollout_tp)
    except StartupError:
        assert builtin_rollout_errors(name, spec), (name, rollout_tp)


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_validation_refuses_exactly_the_full_recompute_layer_counts_the_worker_refuses(name):
    """model_config.recompute_kwargs (as the engine calls it: layers per model chunk) against builtin_shape_errors'
    spec.megatron.recomputeNumLayers over method x layers x PP x VPP, on layouts that split the layers."""
    from rljob_worker.megatron.model_config import recompute_kwargs

    layers, disagreements = BUILTIN_MODELS[name]["num_hidden_layers"], []
    for method, n, pp, vpp in itertools.product(["uniform", "block"], [1, 2, 3, 4], [1, 2], [None, 2]):
        if (vpp and pp == 1) or layers % (pp * (vpp or 1)):
            continue  # refused for the layout itself (megatron_errors, the PP rule above)
        try:
            recompute_kwargs("full", method, n, total_layers=layers, pp=pp * (vpp or 1))
            worker = None
        except ValueError as exc:
            worker = str(exc)
        m = MegatronSpec.model_validate({"pipelineModelParallelSize": pp, "virtualPipelineModelParallelSize": vpp,
                                         "recomputeGranularity": "full", "recomputeMethod": method,
                                         "recomputeNumLayers": n})
        api = [e for e in builtin_shape_errors(name, m, "spec.megatron") if e.path.endswith("recomputeNumLayers")]
        if bool(api) != bool(worker):
            disagreements.append((method, n, pp, vpp, worker, [str(e) for e in api]))
    assert not disagreements, disagreements[:3]


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_the_api_tool_models_are_those_whose_tokenizer_has_the_end_tag_as_one_token(name, tmp_path):
    """Validation refuses rollout.agent on a builtin outside BUILTIN_TOOL_MODEL_NAMES; the worker refuses a tokenizer
    that splits </tool_call> (the engines stop a turn on one token). The tokenizer materialize_builtin writes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(materialize_builtin(name, tmp_path / name))
    one_token = len(tokenizer("</tool_call>", add_special_tokens=False)["input_ids"]) == 1
    assert one_token == (name in BUILTIN_TOOL_MODEL_NAMES)


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_validation_refuses_exactly_the_critic_output_layers_the_worker_refuses(name):
    """megatron/critic.critic_hf_config against builtin_model_errors' spec.critic.outputLayerIndex."""
    from rljob_api.validation import builtin_model_errors
    from rljob_worker.megatron.critic import critic_hf_config

    disagreements = []
    for index in range(1, BUILTIN_MODELS[name]["num_hidden_layers"] + 3):
        try:
            critic_hf_config(SimpleNamespace(**BUILTIN_MODELS[name]), index)
            worker = None
        except ValueError as exc:
            worker = str(exc)
        spec = RLJobSpec.model_validate({"model": {"path": f"builtin://{name}"}, "algorithm": {
            "advantageEstimator": "gae"}, "critic": {"outputLayerIndex": index}})
        api = [e for e in builtin_model_errors(spec) if e.path == "spec.critic.outputLayerIndex"]
        if bool(api) != bool(worker):
            disagreements.append((index, worker, [str(e) for e in api]))
    assert not disagreements, disagreements[:3]
