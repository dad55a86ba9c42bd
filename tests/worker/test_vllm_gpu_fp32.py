"""The real vLLM engine in float32 against the HF engine (marked gpu + vllm). Its own file, run in its own pytest
process: vLLM 0.26 serves one sleep-mode engine per process (see test_vllm_gpu.py).

    python -m pytest tests/worker/test_vllm_gpu_fp32.py -v -s -p no:cacheprovider   # on the device
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from vllm_helpers import TEXTS, char_prompts, hf_engine, release, save_tiny_qwen2, vllm_engine

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def test_greedy_tokens_and_logprobs_equal_the_hf_engine_in_float32(tmp_path):
    """fp32 on both sides: the same greedy tokens in every row, log-probs close. n=2 also covers greedy n > 1.
    vLLM's fp32 attention is a Triton kernel whose dots run in TF32 (Triton's default input precision), so the
    log-probs are not fp32-exact: on an H100 the largest difference was 7.8e-2 (2026-11-26, tokens identical)."""
    model_dir = save_tiny_qwen2(tmp_path / "m", seed=0)
    prompts = char_prompts(TEXTS)
    want = hf_engine(model_dir, torch.float32).generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    engine = vllm_engine(model_dir, torch.float32, 0.2)
    try:
        got = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    finally:
        release(engine)
    assert got.response_ids == want.response_ids
    assert got.finished == want.finished
    diffs = [abs(a - b) for ra, rb in zip(got.response_logprobs, want.response_logprobs) for a, b in zip(ra, rb)]
    mean = sum(diffs) / len(diffs)
    print(f"fp32 greedy: {len(diffs)} tokens identical, |log-prob diff| mean {mean:.2e} max {max(diffs):.2e}")
    assert mean < 2e-2 and max(diffs) < 0.15
