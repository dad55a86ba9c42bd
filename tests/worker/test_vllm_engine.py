"""VLLMEngine against a fake `vllm` module (CPU, CI), and the real engine on a tiny model (gpu + vllm).

The fake records what the engine asks of vLLM: constructor kwargs, sleep / wake_up calls in order,
the buckets handed to the model's load_weights, and per-prompt SamplingParams; it returns canned
RequestOutputs whose samples come back out of order and whose log-prob dicts hold more than the
sampled token, so the mapping to RolloutOutput is checked for real.
"""
from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from rljob_api.enums import RolloutEngine as EngineName
from rljob_worker.rollout import SamplingParams, make_engine
from rljob_worker.rollout.weight_sync import tensor_nbytes, vllm_param_name

KV_ERROR = ("To serve at least one request with the models's max seq len (32768), (1.50 GiB KV cache is needed, "
            "which is larger than the available KV cache memory (0.20 GiB). Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")

# HF names of a 1-layer tied-embedding Qwen2, and their sizes (elements)
HF_PARAMS = {
    "model.embed_tokens.weight": 64, "model.layers.0.input_layernorm.weight": 8,
    "model.layers.0.self_attn.q_proj.weight": 64, "model.layers.0.self_attn.q_proj.bias": 8,
    "model.layers.0.self_attn.k_proj.weight": 32, "model.layers.0.self_attn.k_proj.bias": 4,
    "model.layers.0.self_attn.v_proj.weight": 32, "model.layers.0.self_attn.v_proj.bias": 4,
    "model.layers.0.self_attn.o_proj.weight": 64, "model.layers.0.post_attention_layernorm.weight": 8,
    "model.layers.0.mlp.gate_proj.weight": 128, "model.layers.0.mlp.up_proj.weight": 128,
    "model.layers.0.mlp.down_proj.weight": 128, "model.norm.weight": 8,
}
VLLM_PARAMS = {vllm_param_name(n)[0] for n in HF_PARAMS}


def hf_stream(with_lm_head=False, consumed=None):
    for name, numel in HF_PARAMS.items():
        if consumed is not None:
            consumed.append(name)
        yield name, torch.full((numel,), 0.5)
    if with_lm_head:
        if consumed is not None:
            consumed.append("lm_head.weight")
        yield "lm_head.weight", torch.zeros(64)


# ---------------------------------------------------------------------------------------------- the fake
class FakeLogprob:
    def __init__(self, logprob):
        self.logprob = logprob
        self.rank, self.decoded_token = 1, None


class FakeCompletion:
    def __init__(self, index, token_ids, logprobs, finish_reason):
        self.index, self.token_ids, self.logprobs, self.finish_reason = index, token_ids, logprobs, finish_reason
        self.text, self.stop_reason = "", None


class FakeRequestOutput:
    def __init__(self, prompt_token_ids, outputs):
        self.prompt_token_ids, self.outputs, self.finished = prompt_token_ids, outputs, True


FAKE_VLLM_VERSION = "0.26.0"


class FakeSamplingParams:
    """Validates like vLLM 0.26's SamplingParams where the engine depends on it (vllm/sampling_params.py)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.n, self.temperature, self.top_k = 1, 1.0, 0  # vLLM 0.26 defaults (top_k 0 = disabled)
        for k, v in kwargs.items():
            setattr(self, k, v)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 1e-5 and self.n > 1:  # _SAMPLING_EPS; greedy
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")


class FakeModel:
    """Stands in for the vLLM nn.Module: load_weights records buckets, returns the vLLM names it loaded."""

    def __init__(self, log, fail_on=None):
        self.buckets, self.log, self.fail_on = [], log, fail_on

    def load_weights(self, weights):
        weights = list(weights)
        assert not torch.is_grad_enabled()
        if self.fail_on and any(n == self.fail_on for n, _ in weights):
            raise KeyError(self.fail_on)
        self.buckets.append(weights)
        self.log.append("load_weights")
        return {vllm_param_name(n)[0] for n, _ in weights}

    def named_parameters(self):
        return ((n, None) for n in sorted(VLLM_PARAMS))


def canned_sample(prompt, j, max_tokens):
    """Deterministic sample j of a prompt: EOS (1) after 2 + j tokens, unless that exceeds max_tokens."""
    length = 2 + j
    if length <= max_tokens:
        ids, reason = [prompt[0] * 10 + j + k for k in range(length - 1)] + [1], "stop"
    else:
        ids, reason = [prompt[0] * 10 + j + k for k in range(max_tokens)], "length"
    # each position's dict holds the sampled token and a distractor, as vLLM can (sampled + top-k)
    lps = [{tok: FakeLogprob(-0.01 * (k + 1) - j), 999: FakeLogprob(-9.0)} for k, tok in enumerate(ids)]
    return FakeCompletion(j, ids, lps, reason)


def _fake_head_dim(model_dir):
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except OSError:
        return None
    heads = config.get("num_attention_heads")
    return config.get("head_dim") or (config["hidden_size"] // heads if heads else None)


def _fake_routing(model_dir, tokens):
    import json

    import numpy as np

    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    return (np.arange(tokens * layers * k).reshape(tokens, layers, k) % config["num_experts"]).astype(np.uint8)


class FakeLLM:
    instances: ClassVar[list[FakeLLM]] = []
    sleep_mode_engines_in_process: ClassVar[int] = 0  # each test plays a fresh process

    def __init__(self, **kwargs):
        self.kwargs, self.log, self.generate_calls = kwargs, [], []
        if kwargs["gpu_memory_utilization"] < 0.1:
            raise ValueError(KV_ERROR)
        if kwargs["model"] == "/broken":
            raise OSError("config.json not found")
        if kwargs.get("tensor_parallel_size", 1) > 1 and _fake_head_dim(kwargs["model"]) == 16:
            # vLLM 0.26 on 2 H100s never finishes its start-up warm-up at TP2 on a head_dim-16 model; a stand-in
            # cannot hang a test, so it fails where vLLM would hang (64 runs; widths between are unmeasured)
            raise TimeoutError("stand-in for vLLM 0.26's hang: TP > 1 warm-up on a head_dim-16 model never returns")
        if kwargs.get("enable_sleep_mode") and FakeLLM.sleep_mode_engines_in_process:
            # vLLM 0.26 on an H100: the sleep-mode allocator serves one engine per process, even after shutdown
            raise AssertionError("CuMem allocator can only be used for one instance per process.")
        FakeLLM.sleep_mode_engines_in_process += bool(kwargs.get("enable_sleep_mode"))
        self.model = FakeModel(self.log)
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.generate_calls.append((prompts, sampling_params, use_tqdm))
        assert len(prompts) == len(sampling_params)
        out = []
        for prompt, sp in zip(prompts, sampling_params):
            ids = prompt["prompt_token_ids"]
            samples = [canned_sample(ids, j, sp.max_tokens) for j in range(sp.n)]
            if self.kwargs.get("enable_return_routed_experts"):
                for sample in samples:  # vLLM 0.26: (prompt + output - 1 fed tokens, layers, top-k) on finish
                    sample.routed_experts = _fake_routing(self.kwargs["model"], len(ids) + len(sample.token_ids) - 1)
            out.append(FakeRequestOutput(ids, list(reversed(samples))))  # vLLM may finish children out of order
        self.log.append("generate")
        return out

    def sleep(self, level=1):
        self.log.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.log.append(f"wake_up({','.join(tags) if tags else 'all'})")

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.log.append("reset_prefix_cache")

    def apply_model(self, func):
        return [func(self.model)]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # so importlib.util.find_spec sees it
    module.LLM, module.SamplingParams, module.__version__ = FakeLLM, FakeSamplingParams, FAKE_VLLM_VERSION
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    FakeLLM.instances.clear()
    FakeLLM.sleep_mode_engines_in_process = 0
    from rljob_worker.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "_engines_started_in_process", 0)
    return module


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "tie_word_embeddings": true}')
    return str(tmp_path)


def new_engine(model_dir, **kw):
    from rljob_worker.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, **{"dtype": torch.bfloat16, "gpu_memory_utilization": 0.5, **kw})


# ---------------------------------------------------------------------------------------------- start-up
def test_constructor_gets_sleep_mode_and_the_specs_tp_and_memory(fake_vllm, model_dir):
    import os

    engine = new_engine(model_dir, tensor_parallel_size=1, gpu_memory_utilization=0.45, enforce_eager=True, seed=3,
                        max_model_len=512, max_num_batched_tokens=4096)
    kw = FakeLLM.instances[-1].kwargs
    assert kw["model"] == model_dir and kw["enable_sleep_mode"] is True
    assert kw["tensor_parallel_size"] == 1 and kw["gpu_memory_utilization"] == 0.45
    assert kw["dtype"] == "bfloat16" and kw["enforce_eager"] is True and kw["seed"] == 3
    assert kw["max_model_len"] == 512 and kw["max_num_batched_tokens"] == 4096
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert "distributed_executor_backend" not in kw  # one process, TP 1: vLLM's default executor
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine core
    assert engine.startup_seconds >= 0 and engine.metrics() == {"rollout/engine_startup_s": engine.startup_seconds}


def test_rollout_tp_above_one_uses_the_external_launcher(fake_vllm, model_dir):
    new_engine(model_dir, tensor_parallel_size=2)
    assert FakeLLM.instances[-1].kwargs["distributed_executor_backend"] == "external_launcher"
    assert FakeLLM.instances[-1].kwargs["tensor_parallel_size"] == 2
    assert FakeLLM.instances[-1].kwargs["disable_custom_all_reduce"] is True  # NCCL all-reduce, not CUDA IPC buffers


def _model_with(tmp_path, name, **config):
    import json

    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    return str(path)


def test_the_fake_fails_where_vllm_hangs_at_tp2_on_head_dim_16(fake_vllm, tmp_path):
    narrow = _model_with(tmp_path, "narrow", hidden_size=64, num_attention_heads=4)
    with pytest.raises(TimeoutError, match="head_dim-16"):
        FakeLLM(model=narrow, tensor_parallel_size=2, gpu_memory_utilization=0.5)
    FakeLLM(model=narrow, tensor_parallel_size=1, gpu_memory_utilization=0.5)  # TP 1 runs it (learned on an H100)


def _builtin_model(tmp_path, name):
    from rljob_worker.data.builtin_models import BUILTIN_MODELS

    config = BUILTIN_MODELS[name]
    return _model_with(tmp_path, name, **{k: config[k] for k in ("hidden_size", "num_attention_heads")})


def test_rollout_tp2_refuses_tiny_qwen2s_16_wide_heads_before_vllm_starts(fake_vllm, tmp_path):
    from rljob_worker.startup_errors import StartupError, is_configuration_error

    model = _builtin_model(tmp_path, "tiny-qwen2")
    with pytest.raises(StartupError) as err:
        new_engine(model, tensor_parallel_size=2)
    assert is_configuration_error(err.value) and not FakeLLM.instances  # refused before vLLM was asked
    message = str(err.value)
    assert "spec.rollout.tensorModelParallelSize=2" in message and "are 16" in message
    assert "rollout.tensorModelParallelSize: 1" in message
    new_engine(model, tensor_parallel_size=1)  # the same model at TP 1 starts


def test_rollout_tp2_takes_tiny_qwen2_hd64(fake_vllm, tmp_path):
    new_engine(_builtin_model(tmp_path, "tiny-qwen2-hd64"), tensor_parallel_size=2)
    assert FakeLLM.instances[-1].kwargs["tensor_parallel_size"] == 2


def test_an_explicit_head_dim_wins_over_hidden_over_heads(fake_vllm, tmp_path):
    from rljob_worker.startup_errors import StartupError

    model = _model_with(tmp_path, "explicit", hidden_size=256, num_attention_heads=2, head_dim=32)
    with pytest.raises(StartupError, match="are 32"):
        new_engine(model, tensor_parallel_size=2)


def test_make_engine_builds_it_from_the_spec_settings(fake_vllm, model_dir):
    from rljob_worker.rollout.vllm_engine import VLLMEngine

    engine = make_engine(EngineName.VLLM, model_dir, dtype=torch.float16, device=torch.device("cpu"), eos_token_id=1,
                         pad_token_id=0, tensor_parallel_size=4, gpu_memory_utilization=0.3)
    assert isinstance(engine, VLLMEngine)
    kw = FakeLLM.instances[-1].kwargs
    assert (kw["tensor_parallel_size"], kw["gpu_memory_utilization"], kw["dtype"]) == (4, 0.3, "float16")


@pytest.mark.parametrize(("setting", "level"), [(None, 2), ("2", 2), ("1", 1)])
def test_a_made_engine_drops_its_weights_asleep_unless_told_to_keep_a_host_copy(fake_vllm, model_dir, monkeypatch,
                                                                               setting, level):
    """The trainer refills every weight after each sleep (its weight sync), so by default the engine keeps no host
    copy (level 2); RLJOB_VLLM_SLEEP_LEVEL=1 keeps one, and the trainer then syncs LoRA's changed weights only."""
    if setting is None:
        monkeypatch.delenv("RLJOB_VLLM_SLEEP_LEVEL", raising=False)
    else:
        monkeypatch.setenv("RLJOB_VLLM_SLEEP_LEVEL", setting)
    engine = make_engine(EngineName.VLLM, model_dir, dtype=torch.float16, device=torch.device("cpu"), eos_token_id=1,
                         pad_token_id=0)
    engine.sleep()
    assert engine.sleep_level == level and FakeLLM.instances[-1].log == [f"sleep({level})"]


def test_a_validation_leaves_a_level_two_engine_awake_and_every_step_samples_synced_weights(tmp_path):
    """The trainer with the real VLLMEngine over the stand-in, weights dropped while asleep: a validation before each
    step, then the step. The validation keeps the engine awake (a sleep there would drop weights that no sync
    refills before the step's rollout: the step's generate then fails), and each step's sleep is followed by the
    weights, their sync and the KV cache, in that order, before anything samples again."""
    import yaml

    spec = yaml.safe_load((Path(__file__).parents[2] / "examples" / "quickstart.yaml").read_text())["spec"]
    spec["training"].update(totalTrainingSteps=2, testFreq=1)
    spec["checkpoint"].update(uri=f"file://{tmp_path}/ckpt", saveFreq=-1, exportHf=False)
    spec["metrics"] = {"enabled": False}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_validation_probe.py")),
                           str(tmp_path / "spec.json"), str(tmp_path), str(out)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = []  # one entry per run of load_weights (a bucket each)
    for entry in json.loads(out.read_text())["log"]:
        if entry != "reset_prefix_cache" and not (entry == "load_weights" and log and log[-1] == entry):
            log.append(entry)
    step = ["generate", "sleep(2)", "wake_up(weights)", "load_weights", "wake_up(kv_cache)"]  # rollout, update, sync
    assert log == ["generate", *step, "generate", *step]  # validation, step 1, validation, step 2


def test_a_sleep_level_typo_is_refused_by_name(fake_vllm, model_dir, monkeypatch):
    monkeypatch.setenv("RLJOB_VLLM_SLEEP_LEVEL", "3")
    with pytest.raises(ValueError, match=r"RLJOB_VLLM_SLEEP_LEVEL='3': set 2 .* or 1"):
        make_engine(EngineName.VLLM, model_dir, dtype=torch.float16, device=torch.device("cpu"), eos_token_id=1,
                    pad_token_id=0)


@pytest.mark.parametrize(("rows", "bound"), [
    (None, None), (0, None), (1, 4), (4, 4), (5, 8), (20, 24), (248, 248), (249, 256), (256, 256), (257, 272),
    (496, 496), (497, None), (4096, None),  # 512 and above: vLLM's own ceiling, its default list
])
def test_capture_bound_is_the_rows_on_vllms_grid(rows, bound):
    from rljob_worker.rollout.vllm_engine import capture_size_bound

    assert capture_size_bound(rows, environ={}) == bound


def test_capture_bound_env_keeps_vllms_sizes_or_refuses_a_typo():
    from rljob_worker.rollout.vllm_engine import capture_size_bound

    assert capture_size_bound(20, environ={"RLJOB_VLLM_CAPTURE": "all"}) is None
    assert capture_size_bound(20, environ={"RLJOB_VLLM_CAPTURE": "rollout"}) == 24
    with pytest.raises(ValueError, match="RLJOB_VLLM_CAPTURE='everything'.*rollout.*all"):
        capture_size_bound(20, environ={"RLJOB_VLLM_CAPTURE": "everything"})


def test_vllm_captures_graphs_up_to_a_steps_rows_only(fake_vllm, model_dir, monkeypatch):
    monkeypatch.delenv("RLJOB_VLLM_CAPTURE", raising=False)
    engine = make_engine(EngineName.VLLM, model_dir, dtype=torch.float16, device=torch.device("cpu"), eos_token_id=1,
                         pad_token_id=0, max_rows=256)
    assert FakeLLM.instances[-1].kwargs["compilation_config"] == {"max_cudagraph_capture_size": 256}
    release_fake(engine, monkeypatch)
    new_engine(model_dir)  # no bound given: vLLM's own sizes
    assert "compilation_config" not in FakeLLM.instances[-1].kwargs
    release_fake(None, monkeypatch)
    new_engine(model_dir, max_rows=256, enforce_eager=True)  # no graphs at all
    assert "compilation_config" not in FakeLLM.instances[-1].kwargs
    release_fake(None, monkeypatch)
    explicit = {"cudagraph_capture_sizes": [1, 64]}  # a caller's own compilation config wins
    new_engine(model_dir, max_rows=256, compilation_config=explicit)
    assert FakeLLM.instances[-1].kwargs["compilation_config"] == explicit


def release_fake(engine, monkeypatch):
    """The fake, like vLLM 0.26, serves one sleep-mode engine per process: reset its count for the next one."""
    from rljob_worker.rollout import vllm_engine

    FakeLLM.sleep_mode_engines_in_process = 0
    monkeypatch.setattr(vllm_engine, "_engines_started_in_process", 0)


CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(("device", "kw", "want"), [
    (CPU, {"num_params": 10**8}, EngineName.HF),  # no GPU: hf
    (CUDA, {"num_params": 494_000_000}, EngineName.HF),  # 0.5B on one GPU: the static engine won (1.7x)
    (CUDA, {"num_params": 1_540_000_000}, EngineName.HF),  # 1.5B: the static engine won (1.2x)
    (CUDA, {"num_params": 3_000_000_000}, EngineName.HF),  # the threshold itself
    (CUDA, {"num_params": 7_620_000_000}, EngineName.VLLM),  # 7B: vLLM won (1.7x)
    (CUDA, {"num_params": None}, EngineName.VLLM),  # unknown size: vLLM
    (CUDA, {"num_params": 10**8, "world_size": 2}, EngineName.VLLM),  # hf samples on rank 0 only
    (CUDA, {"num_params": 10**8, "rollout_tp": 2}, EngineName.VLLM),  # hf has no rollout TP
], ids=["cpu", "0.5b", "1.5b", "3b", "7b", "unknown", "two-ranks", "rollout-tp2"])
def test_auto_picks_the_engine_the_measurements_favour(fake_vllm, device, kw, want):
    from rljob_worker.rollout.factory import resolve_engine_name

    assert resolve_engine_name(EngineName.AUTO, device, **kw) == want
    for explicit in (EngineName.VLLM, EngineName.HF):  # an explicit choice is never second-guessed
        assert resolve_engine_name(explicit, device, **kw) == explicit


def test_auto_without_vllm_is_hf_even_where_vllm_would_win(monkeypatch):
    from rljob_worker.rollout.factory import resolve_engine_name

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    assert resolve_engine_name(EngineName.AUTO, CUDA, world_size=8, rollout_tp=2, num_params=None) == EngineName.HF


def test_too_small_gpu_memory_utilization_names_the_setting(fake_vllm, model_dir):
    with pytest.raises(RuntimeError, match=r"spec\.rollout\.gpuMemoryUtilization=0\.05") as info:
        new_engine(model_dir, gpu_memory_utilization=0.05)
    assert "KV cache is needed" in str(info.value)  # vLLM's own numbers stay in the message
    assert isinstance(info.value.__cause__, ValueError)


def test_other_start_up_errors_pass_through(fake_vllm):
    with pytest.raises(OSError, match="config.json not found"):
        new_engine("/broken")


def test_a_second_engine_in_one_process_is_refused_with_a_clear_message(fake_vllm, model_dir):
    """Real vLLM 0.26 fails the second sleep-mode engine of a process deep in load_model (an AssertionError about
    the CuMem allocator), even after the first was shut down; the engine says so before vLLM is asked."""
    first = new_engine(model_dir)
    first.shutdown()
    with pytest.raises(RuntimeError, match="one engine per process"):
        new_engine(model_dir)
    assert len(FakeLLM.instances) == 1


def test_the_fake_refuses_a_second_sleep_mode_engine_as_vllm_does(fake_vllm, model_dir):
    FakeLLM(model=model_dir, gpu_memory_utilization=0.5, enable_sleep_mode=True)
    with pytest.raises(AssertionError, match="one instance per process"):
        FakeLLM(model=model_dir, gpu_memory_utilization=0.5, enable_sleep_mode=True)


def test_vllm_not_importable_names_the_engine_setting(monkeypatch, model_dir):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(RuntimeError, match=r"spec\.rollout\.engine is vllm"):
        new_engine(model_dir)


# ---------------------------------------------------------------------------------------------- generate
def test_generate_maps_outputs_grouped_by_prompt(fake_vllm, model_dir):
    engine = new_engine(model_dir, eos_token_id=1)
    prompts = [[2, 3], [4], [5, 6, 7]]
    out = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=3, seed=100))
    assert len(out.response_ids) == len(out.response_logprobs) == len(out.finished) == 9
    for i, prompt in enumerate(prompts):
        for j in range(3):  # sample j of prompt i at i*n + j, whatever order vLLM returned them in
            expected = canned_sample(prompt, j, 3)
            assert out.response_ids[i * 3 + j] == expected.token_ids
            assert out.response_logprobs[i * 3 + j] == pytest.approx([-0.01 * (k + 1) - j for k in range(len(expected.token_ids))])
            assert out.finished[i * 3 + j] == (expected.finish_reason == "stop")
    assert out.finished[:3] == [True, True, False]  # the third sample hit max_new_tokens
    assert all(ids[-1] == 1 for ids, f in zip(out.response_ids, out.finished) if f)

    sent_prompts, sampling, use_tqdm = FakeLLM.instances[-1].generate_calls[-1]
    assert sent_prompts == [{"prompt_token_ids": p} for p in prompts] and use_tqdm is False
    for i, sp in enumerate(sampling):
        assert sp.kwargs == {"n": 3, "temperature": 0.7, "top_p": 0.9, "max_tokens": 3, "logprobs": 0,
                             "detokenize": False, "seed": 100 + 3 * i, "stop_token_ids": [1]}


def test_sampling_params_top_k_and_unseeded(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    engine.generate([[2]], SamplingParams(n=2, temperature=0.5, top_k=5, max_new_tokens=4))
    (sp,) = FakeLLM.instances[-1].generate_calls[-1][1]
    assert sp.kwargs["top_k"] == 5 and "seed" not in sp.kwargs and "stop_token_ids" not in sp.kwargs
    assert sp.kwargs["temperature"] == 0.5


def test_the_fake_refuses_greedy_with_n_above_one_as_vllm_does(fake_vllm):
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 2"):
        fake_vllm.SamplingParams(n=2, temperature=0.0)
    fake_vllm.SamplingParams(n=2, temperature=1e-5)  # at vLLM's epsilon it samples
    fake_vllm.SamplingParams(n=1, temperature=0.0)


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_with_n_above_one_decodes_once_and_repeats(fake_vllm, model_dir, temperature):
    """vLLM 0.26 refuses greedy with n > 1: one n=1 request per prompt, its sample repeated n times."""
    engine = new_engine(model_dir, eos_token_id=1)
    prompts = [[2, 3], [4]]
    out = engine.generate(prompts, SamplingParams(n=3, temperature=temperature, max_new_tokens=5, seed=7))
    assert len(out.response_ids) == len(out.response_logprobs) == len(out.finished) == 6
    for i, prompt in enumerate(prompts):
        only = canned_sample(prompt, 0, 5)  # the single (greedy) sample of that prompt
        for j in range(3):
            assert out.response_ids[i * 3 + j] == only.token_ids and out.finished[i * 3 + j] is True
            assert out.response_logprobs[i * 3 + j] == pytest.approx([-0.01 * (k + 1) for k in range(len(only.token_ids))])
    assert out.response_ids[0] is not out.response_ids[1]  # copies, not one list aliased three times
    sampling = FakeLLM.instances[-1].generate_calls[-1][1]
    assert [sp.kwargs["n"] for sp in sampling] == [1, 1]
    assert [sp.kwargs["seed"] for sp in sampling] == [7, 10]  # prompt i keeps seed + i * n: streams stay distinct
    assert engine.calls[-1] == "generate(2 prompts x 3)"


# ---------------------------------------------------------------------------------------------- version check
@pytest.mark.parametrize("version", ["0.11.0", "0.25.1", "0.26.0rc1", "0.27.0", "1.0.0", "not-a-version"])
def test_untested_vllm_versions_are_refused_by_name(fake_vllm, model_dir, monkeypatch, version):
    monkeypatch.delenv("RLJOB_VLLM_ANY_VERSION", raising=False)
    monkeypatch.setattr(fake_vllm, "__version__", version)
    with pytest.raises(RuntimeError) as info:
        new_engine(model_dir)
    message = str(info.value)
    assert f"installed vLLM is {version}" in message and ">= 0.26.0, < 0.27.0" in message
    assert "pip install vllm==0.26.0" in message and "RLJOB_VLLM_ANY_VERSION=1" in message
    assert FakeLLM.instances == []  # refused before vLLM allocates anything


@pytest.mark.parametrize("version", ["0.26.0", "0.26.3", "0.26.1.dev4+g1234"])
def test_tested_vllm_versions_start(fake_vllm, model_dir, monkeypatch, version):
    monkeypatch.setattr(fake_vllm, "__version__", version)
    assert new_engine(model_dir).vllm_version == version


def test_any_version_override_lets_an_untested_vllm_start(fake_vllm, model_dir, monkeypatch, caplog):
    monkeypatch.setattr(fake_vllm, "__version__", "0.27.1")
    monkeypatch.setenv("RLJOB_VLLM_ANY_VERSION", "1")
    with caplog.at_level("WARNING"):
        new_engine(model_dir)
    assert "vLLM 0.27.1 is outside the tested range" in caplog.text


def test_shutdown_releases_the_llm(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    engine.shutdown()
    assert not hasattr(engine, "llm") and engine.calls[-1] == "shutdown"
    engine.shutdown()  # twice is harmless


def test_generate_with_no_prompts(fake_vllm, model_dir):
    out = new_engine(model_dir).generate([], SamplingParams(n=4))
    assert (out.response_ids, out.response_logprobs, out.finished) == ([], [], [])
    assert FakeLLM.instances[-1].generate_calls == []


def test_missing_logprobs_are_an_error(fake_vllm, model_dir, monkeypatch):
    engine = new_engine(model_dir)
    orig = FakeLLM.generate

    def no_logprobs(self, prompts, sampling_params, use_tqdm=True):
        outs = orig(self, prompts, sampling_params, use_tqdm)
        for o in outs:
            for c in o.outputs:
                c.logprobs = None
        return outs

    monkeypatch.setattr(FakeLLM, "generate", no_logprobs)
    with pytest.raises(RuntimeError, match="log-probs for 0 of"):
        engine.generate([[2]], SamplingParams(n=1, max_new_tokens=2))


# ---------------------------------------------------------------------------------------------- sleep / wake / sync
def test_sleep_wake_weights_sync_wake_kv_order(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    llm = FakeLLM.instances[-1]
    engine.generate([[2]], SamplingParams(n=2, max_new_tokens=2))
    engine.sleep()
    engine.wake_up(tags=["weights"])
    engine.update_weights(hf_stream())
    engine.wake_up(tags=["kv_cache"])
    engine.generate([[2]], SamplingParams(n=2, max_new_tokens=2))
    loads = llm.log.count("load_weights")
    assert llm.log == ["generate", "sleep(1)", "wake_up(weights)", *["load_weights"] * loads, "wake_up(kv_cache)",
                       "generate"]
    assert [c.split("(")[0] for c in engine.calls] == ["generate", "sleep", "wake_up", "update_weights", "wake_up",
                                                       "generate"]
    sync = f"update_weights({len(HF_PARAMS)} tensors, {loads} buckets)"
    assert engine.calls[1:5] == ["sleep(level=1)", "wake_up(weights)", sync, "wake_up(kv_cache)"]


def test_update_weights_while_asleep_is_refused(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"asleep: call wake_up\(tags=\['weights'\]\) first"):
        engine.update_weights(hf_stream())
    assert "load_weights" not in FakeLLM.instances[-1].log


def test_wrong_wake_and_generate_orders_are_refused(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    engine.sleep()
    with pytest.raises(RuntimeError, match="before the weights"):
        engine.wake_up(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match="generate while the vLLM engine is asleep"):
        engine.generate([[2]], SamplingParams())
    engine.wake_up(tags=["weights"])
    with pytest.raises(RuntimeError, match="generate while the vLLM engine is weights only"):
        engine.generate([[2]], SamplingParams())
    with pytest.raises(ValueError, match="unknown tags"):
        engine.wake_up(tags=["everything"])


def test_wake_up_without_tags_does_weights_then_kv_cache_and_sleep_is_idempotent(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    llm = FakeLLM.instances[-1]
    engine.wake_up()  # already awake: nothing to do
    engine.sleep()
    engine.sleep()  # already asleep: not passed on to vLLM
    engine.wake_up()
    assert llm.log == ["sleep(1)", "wake_up(weights)", "wake_up(kv_cache)"]
    assert engine.state == "awake"


def test_sleep_with_only_weights_awake_restores_the_kv_pool_first(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    llm = FakeLLM.instances[-1]
    engine.sleep()
    engine.wake_up(tags=["weights"])
    engine.sleep()
    assert llm.log == ["sleep(1)", "wake_up(weights)", "wake_up(kv_cache)", "sleep(1)"]


def test_level_two_sleep_needs_a_sync_before_generating(fake_vllm, model_dir):
    engine = new_engine(model_dir, sleep_level=2)
    engine.sleep()
    engine.wake_up()
    assert FakeLLM.instances[-1].log[0] == "sleep(2)"
    with pytest.raises(RuntimeError, match="level-2 sleep without update_weights"):
        engine.generate([[2]], SamplingParams())
    engine.update_weights(hf_stream())
    engine.generate([[2]], SamplingParams(max_new_tokens=2))


def test_update_weights_respects_bucket_bytes_and_reports_stats(fake_vllm, model_dir):
    engine = new_engine(model_dir, bucket_bytes=512)  # float32: 128 elements
    llm = FakeLLM.instances[-1]
    engine.sleep()
    engine.wake_up(tags=["weights"])
    engine.update_weights(hf_stream(with_lm_head=True))
    buckets = llm.model.buckets
    assert len(buckets) > 1
    assert all(sum(tensor_nbytes(t) for _, t in b) <= 512 for b in buckets)
    flat = [n for b in buckets for n, _ in b]
    assert flat == list(HF_PARAMS)  # order kept; tied lm_head.weight never sent to vLLM
    stats = engine.last_sync_stats
    assert stats.bytes == 4 * sum(HF_PARAMS.values()) and stats.tensors == len(HF_PARAMS)
    assert stats.buckets == len(buckets) and stats.seconds >= stats.load_seconds >= 0
    assert {"rollout/weight_sync_s", "rollout/weight_sync_gbps", "rollout/engine_startup_s"} <= set(engine.metrics())
    assert "reset_prefix_cache" not in llm.log  # KV cache was asleep: nothing cached to invalidate


def test_update_weights_while_awake_resets_the_prefix_cache(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    engine.update_weights(hf_stream())
    assert FakeLLM.instances[-1].log[-1] == "reset_prefix_cache"


def test_incomplete_sync_is_an_error(fake_vllm, model_dir):
    engine = new_engine(model_dir)
    no_norm = ((n, t) for n, t in hf_stream() if n != "model.norm.weight")
    with pytest.raises(KeyError, match=r"\['model.norm.weight'\] \(1 missing\)"):
        engine.update_weights(no_norm)
    # a fused parameter counts as loaded in vLLM once any part arrives: caught on the HF side
    no_up = ((n, t) for n, t in hf_stream() if "mlp.up_proj" not in n)
    with pytest.raises(KeyError, match=r"'model.layers.0.mlp.gate_up_proj.weight': \[1\]"):
        engine.update_weights(no_up)


def test_a_failing_load_still_consumes_the_collective_stream(fake_vllm, model_dir):
    engine = new_engine(model_dir, bucket_bytes=256)
    FakeLLM.instances[-1].model.fail_on = "model.layers.0.self_attn.o_proj.weight"
    consumed = []
    with pytest.raises(KeyError):
        engine.update_weights(hf_stream(consumed=consumed))
    assert consumed == list(HF_PARAMS)  # every rank of the TP group reaches every all-gather


def test_without_apply_model_the_driver_workers_model_is_used(fake_vllm, model_dir, monkeypatch):
    engine = new_engine(model_dir)
    llm = FakeLLM.instances[-1]
    runner = types.SimpleNamespace(model=llm.model)
    llm.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
        driver_worker=types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=runner))))
    monkeypatch.delattr(FakeLLM, "apply_model")
    engine.update_weights(hf_stream())
    assert [n for b in llm.model.buckets for n, _ in b] == list(HF_PARAMS)


# ---------------------------------------------------------------------------------------------- the real engine
@pytest.mark.gpu
@pytest.mark.vllm
def test_real_vllm_engine_on_a_tiny_qwen2(tmp_path):
    """Start vLLM on a tiny Qwen2 (head_dim 64), sample, sleep, sync new weights, and compare greedy output
    with the HF engine holding the same weights."""
    from rljob_worker.data.builtin_models import EOS, PAD, VOCAB, build_char_tokenizer
    from rljob_worker.rollout.hf_engine import HFEngine
    from rljob_worker.rollout.vllm_engine import VLLMEngine
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=len(VOCAB), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=VOCAB.index(EOS), pad_token_id=VOCAB.index(PAD),
                      bos_token_id=VOCAB.index(EOS))
    cfg.architectures = ["Qwen2ForCausalLM"]

    def sharp_model(seed):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.5)
        return model

    first, second = tmp_path / "first", tmp_path / "second"
    for path, seed in ((first, 0), (second, 1)):
        sharp_model(seed).save_pretrained(path)
        build_char_tokenizer().save_pretrained(path)
    tok = build_char_tokenizer()
    prompts = [tok(s, add_special_tokens=False)["input_ids"] for s in ["12+3=", "9=", "4444 8=", "0", "77+1=2 #"]]
    eos, pad, cuda = VOCAB.index(EOS), VOCAB.index(PAD), torch.device("cuda")
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)

    engine = VLLMEngine(str(first), dtype=torch.bfloat16, gpu_memory_utilization=0.3, max_model_len=64,
                        eos_token_id=eos, enforce_eager=True)
    sampled = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=1))
    assert len(sampled.response_ids) == 20
    assert all(len(ids) == len(lps) for ids, lps in zip(sampled.response_ids, sampled.response_logprobs))
    assert all(lp <= 1e-4 for lps in sampled.response_logprobs for lp in lps)

    free_before = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_before  # the sleep gave memory back
    engine.wake_up(tags=["weights"])
    hf_second = HFEngine(str(second), dtype=torch.bfloat16, device=cuda, eos_token_id=eos, pad_token_id=pad)
    engine.update_weights((n, p.detach().clone()) for n, p in hf_second.model.named_parameters())
    engine.wake_up(tags=["kv_cache"])
    assert engine.last_sync_stats.bytes > 0 and engine.last_sync_stats.gb_per_s > 0

    got, want = engine.generate(prompts, greedy), hf_second.generate(prompts, greedy)
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_helpers import release

    release(engine)  # the next test's engine must not share vLLM's process-wide sleep allocator with this one
    same = sum(a[:4] == b[:4] for a, b in zip(got.response_ids, want.response_ids))
    assert same >= 8, (got.response_ids, want.response_ids)  # bf16 kernels differ; sharp weights keep argmax stable
    assert all(got.response_ids[2 * i] == got.response_ids[2 * i + 1] for i in range(len(prompts)))  # greedy n=2


def test_stop_token_ids_reach_vllm_and_end_the_sample_on_them(fake_vllm, model_dir, monkeypatch):
    """The agent loop's tool-call end goes to vLLM's stop_token_ids beside the EOS; vLLM keeps a stop token id as
    the sample's last token (finish_reason "stop"), which the engine reports as finished."""
    engine = new_engine(model_dir, eos_token_id=1)
    real_generate = FakeLLM.generate

    def stopping_generate(self, prompts, sampling_params, use_tqdm=True):
        out = real_generate(self, prompts, sampling_params, use_tqdm)
        for request, sp in zip(out, sampling_params):
            for c in request.outputs:  # cut at the first stop token, as vLLM does
                stops = set(sp.kwargs.get("stop_token_ids", []))
                at = next((k for k, t in enumerate(c.token_ids) if t in stops), None)
                if at is not None:
                    c.token_ids, c.logprobs, c.finish_reason = c.token_ids[:at + 1], c.logprobs[:at + 1], "stop"
        return out

    monkeypatch.setattr(FakeLLM, "generate", stopping_generate)
    # canned sample 2 of prompt [3] is 30+2, 30+3, 30+4, then EOS: stop at 33
    out = engine.generate([[3]], SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=0, stop_token_ids=(33,)))
    (sp,) = FakeLLM.instances[-1].generate_calls[-1][1]
    assert sp.kwargs["stop_token_ids"] == [1, 33]
    assert out.response_ids[2] == [32, 33] and out.finished[2]
    assert out.response_ids[0] == [30, 1] and out.finished[0]
    assert len(out.response_logprobs[2]) == 2


# ---------------------------------------------------------------------------------------------- routing replay
def test_recording_routing_asks_vllm_for_routed_experts_and_returns_them_per_response(fake_vllm, tmp_path):
    from rljob_worker.rollout.base import SamplingParams

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8, '
                                          '"num_experts_per_tok": 2, "mlp_only_layers": [], "decoder_sparse_step": 1}')
    engine = new_engine(str(tmp_path), record_routing=True)
    assert FakeLLM.instances[-1].kwargs["enable_return_routed_experts"] is True
    out = engine.generate([[3, 4, 5], [6]], SamplingParams(n=2, max_new_tokens=8))
    assert [tuple(r.shape) for r in out.routed_experts] == [(3 + len(ids) - 1, 3, 2) for ids in out.response_ids[:2]] + [
        (1 + len(ids) - 1, 3, 2) for ids in out.response_ids[2:]]
    assert all(r.dtype == torch.uint8 for r in out.routed_experts)


def test_routed_experts_of_moe_layers_only_are_placed_in_their_layers():
    import numpy as np
    from rljob_worker.rollout.routed_experts import from_vllm

    moe_only = np.full((5, 2, 2), 7, dtype=np.uint8)
    full = from_vllm(moe_only, num_layers=4, moe_layers=[0, 2], top_k=2, dtype=torch.uint8)
    assert tuple(full.shape) == (5, 4, 2)
    assert (full[:, [0, 2]] == 7).all() and torch.equal(full[:, 1], torch.tensor([[0, 1]] * 5, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="3 layers"):
        from_vllm(np.zeros((5, 3, 2)), num_layers=4, moe_layers=[0, 2], top_k=2, dtype=torch.uint8)
