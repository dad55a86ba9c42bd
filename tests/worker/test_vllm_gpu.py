"""The real vLLM engine on a GPU (marked gpu + vllm; skipped with a reason where either is missing).

    python -m pytest tests/worker/test_vllm_gpu.py -v -s -p no:cacheprovider   # on the device, vLLM 0.26 installed

A tiny Qwen2 (2 layers, head_dim 64, the built-in 16-symbol vocabulary): vLLM against the HF engine and a full
forward pass holding the same weights. vLLM 0.26's sleep-mode allocator serves one engine per process
(a second one fails even after the first was shut down), so this file holds the tests that share one bf16
engine and the float32 greedy comparison lives in test_vllm_gpu_fp32.py: run each file in its own pytest
process (bench/gpu_all.sh section vllmtests does).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from rljob_worker.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from vllm_helpers import (
    GREEDY,
    TEXTS,
    char_prompts,
    free_gib,
    hf_engine,
    release,
    save_tiny_qwen2,
    vllm_engine,
)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


# ------------------------------------------------------------------------------------------------ bf16, one engine
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {"a": save_tiny_qwen2(root / "a", seed=0), "b": save_tiny_qwen2(root / "b", seed=1),
            "flat": save_tiny_qwen2(root / "flat", seed=2, scale=0.08)}


@pytest.fixture(scope="module")
def engine(models):
    eng = vllm_engine(models["a"], torch.bfloat16, 0.3)
    yield eng
    release(eng)


def _named_params(model_dir):
    hf = hf_engine(model_dir, torch.bfloat16)
    return [(n, p.detach().clone()) for n, p in hf.model.named_parameters()]


def _sync(engine, named, level: int) -> float:
    """The trainer's cycle: sleep, wake the weights, stream new weights, wake the KV cache; GiB freed by the sleep."""
    before = free_gib()
    engine.sleep(level=level)
    freed = free_gib() - before
    engine.wake_up(tags=["weights"])
    engine.update_weights(iter(named))
    engine.wake_up(tags=["kv_cache"])
    return freed


def test_processed_logprobs_equal_a_recomputed_forward_under_temperature_and_top_p(engine, models):
    """logprobs_mode=processed_logprobs: the log-prob of each sampled token under the temperature / top-p
    distribution it was drawn from, which is what the trainer recomputes: log_softmax(filter_logits(logits))
    of a full forward pass (float32 here, on the same bf16 weights). Equal within bf16 noise."""
    from rljob_worker.rollout.sampling import filter_logits
    from transformers import AutoModelForCausalLM

    _sync(engine, _named_params(models["flat"]), level=1)  # flat distributions: top-p cuts, temperature matters
    prompts = char_prompts(TEXTS)
    temperature, top_p = 0.7, 0.9
    out = engine.generate(prompts, SamplingParams(n=4, temperature=temperature, top_p=top_p, max_new_tokens=16, seed=3))
    ref = AutoModelForCausalLM.from_pretrained(models["flat"], dtype=torch.float32).cuda().eval()
    gaps, raw_gaps, outside = [], [], 0
    with torch.no_grad():
        for k, (ids, lps) in enumerate(zip(out.response_ids, out.response_logprobs)):
            prompt = prompts[k // 4]
            seq = torch.tensor([prompt + ids], device="cuda")
            logits = ref(input_ids=seq).logits[0, len(prompt) - 1:-1]  # the logits each response token was drawn from
            picked = torch.tensor(ids, device="cuda")[:, None]
            want = torch.log_softmax(filter_logits(logits, temperature, 0, top_p), dim=-1).gather(-1, picked)
            raw = torch.log_softmax(logits.float(), dim=-1).gather(-1, picked)  # T=1, no top-p: the wrong target
            for w, r, g in zip(want.squeeze(-1).tolist(), raw.squeeze(-1).tolist(), lps):
                raw_gaps.append(abs(r - g))
                if w == float("-inf"):
                    outside += 1  # bf16 moved a token across the nucleus edge
                else:
                    gaps.append(abs(w - g))
    gaps_t, raw_t = torch.tensor(gaps), torch.tensor(raw_gaps)
    total = len(raw_gaps)
    print(f"processed log-probs (T={temperature}, top_p={top_p}): {total} tokens, mean |diff| {gaps_t.mean():.4f}, "
          f"p99 {gaps_t.quantile(0.99):.4f}, max {gaps_t.max():.4f}, outside the fp32 nucleus {outside}; "
          f"vs raw T=1 log-probs mean |diff| {raw_t.mean():.4f}")
    assert outside <= 0.02 * total
    assert gaps_t.mean() < 0.03 and gaps_t.quantile(0.99) < 0.15  # the 0.5B GRPO step showed a 0.010 mean
    assert raw_t.mean() > 5 * gaps_t.mean()  # the comparison tells processed from raw log-probs


def test_level_1_sleep_gives_memory_back_and_wakes_with_the_same_weights(engine, models):
    _sync(engine, _named_params(models["a"]), level=1)
    prompts = char_prompts(TEXTS)
    before = engine.generate(prompts, GREEDY)
    free_awake = free_gib()
    engine.sleep(level=1)
    freed = free_gib() - free_awake
    total = torch.cuda.mem_get_info()[1] / 2**30
    print(f"sleep level 1 freed {freed:.1f} GiB (engine budget {0.3 * total:.1f} GiB)")
    assert freed > 0.5 * 0.3 * total  # the KV cache (most of the budget) is unmapped
    engine.wake_up()
    assert engine.generate(prompts, GREEDY).response_ids == before.response_ids  # weights came back from the CPU copy


@pytest.mark.parametrize("level", [1, 2])
def test_a_weight_sync_after_sleep_changes_what_greedy_generates(engine, models, level):
    """Sync B's weights into the engine holding A (after a level-1 or level-2 sleep): the next greedy decode
    is B's (as the HF engine holding B decodes it) and no longer A's; then back to A."""
    prompts = char_prompts(TEXTS)
    _sync(engine, _named_params(models["a"]), level=1)
    a_out = engine.generate(prompts, GREEDY).response_ids
    b_want = hf_engine(models["b"], torch.bfloat16).generate(prompts, GREEDY).response_ids
    total = torch.cuda.mem_get_info()[1] / 2**30
    freed = _sync(engine, _named_params(models["b"]), level=level)
    print(f"sleep level {level} freed {freed:.1f} GiB")
    assert freed > 0.5 * 0.3 * total
    b_got = engine.generate(prompts, GREEDY).response_ids
    flipped = sum(x[:4] != y[:4] for x, y in zip(a_out, b_got))
    same_as_hf = sum(x[:4] == y[:4] for x, y in zip(b_got, b_want))
    print(f"level {level}: {flipped}/{len(prompts)} greedy rows changed by the sync, {same_as_hf} match HF on B")
    assert flipped >= len(prompts) // 2  # the sync changed what the engine generates...
    assert same_as_hf >= len(prompts) - 2  # ...into what B generates (bf16 kernels differ; sharp weights)
    _sync(engine, _named_params(models["a"]), level=level)
    assert engine.generate(prompts, GREEDY).response_ids == a_out  # and back


def test_bucketed_sync_seconds_per_gb(engine, models):
    """Prints the sync rate (HF-named bf16 tensors already on the GPU, 64 MiB buckets) at three bucket sizes.
    The tiny model is mostly per-call overhead; bench/rollout.py --vllm measures the 0.5B shape."""
    named = _named_params(models["a"])
    engine.sleep()
    engine.wake_up(tags=["weights"])
    rows = []
    for bucket in (64 << 10, 1 << 20, 64 << 20):
        engine.bucket_bytes = bucket
        t0 = time.perf_counter()
        engine.update_weights(iter(named))
        wall = time.perf_counter() - t0
        s = engine.last_sync_stats
        rows.append((bucket, s.buckets, s.gb, s.seconds, wall))
        assert s.gb > 0 and s.seconds > 0 and s.tensors == len(named)
    engine.wake_up(tags=["kv_cache"])
    for bucket, buckets, gb, seconds, wall in rows:
        print(f"sync: bucket {bucket >> 10} KiB, {buckets} buckets, {gb * 1e3:.2f} MB in {seconds * 1e3:.1f} ms "
              f"= {seconds / gb:.2f} s/GB")
    assert rows[0][1] > rows[-1][1]  # smaller buckets, more of them
