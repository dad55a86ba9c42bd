"""The real vLLM engine with its CUDA graphs on, bounded by the rows a step decodes (marked gpu + vllm). Its own
file, run in its own pytest process: vLLM 0.26 serves one sleep-mode engine per process (see test_vllm_gpu.py).

    python -m pytest tests/worker/test_vllm_gpu_graphs.py -v -s -p no:cacheprovider   # on the device
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from vllm_helpers import TEXTS, _ids, char_prompts, hf_engine, release, save_tiny_qwen2

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def test_graphs_up_to_the_steps_rows_and_a_larger_call_decodes_the_same(tmp_path):
    """max_rows=20 -> vLLM captures batches 1, 2, 4, 8, 16 and 24 only (24: the rows rounded up to vLLM's grid, so
    the whole batch has a graph). fp32 greedy on both sides: a call inside the bound (replayed graphs) and one
    with more rows than it (its first steps decode without a graph) give the HF engine's tokens in every row."""
    from rljob_worker.rollout.vllm_engine import VLLMEngine

    model_dir = save_tiny_qwen2(tmp_path / "m", seed=0)
    eos, _ = _ids()
    inside = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)  # 10 prompts x 2 = 20 rows
    above = SamplingParams(n=4, temperature=0.0, max_new_tokens=12)  # 40 rows
    prompts = char_prompts(TEXTS)
    hf = hf_engine(model_dir, torch.float32)
    want_inside, want_above = hf.generate(prompts, inside), hf.generate(prompts, above)
    del hf
    engine = VLLMEngine(str(model_dir), dtype=torch.float32, gpu_memory_utilization=0.2, max_model_len=64,
                        eos_token_id=eos, seed=0, max_rows=20)
    try:
        sizes = engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes
        got_inside, got_above = engine.generate(prompts, inside), engine.generate(prompts, above)
    finally:
        release(engine)
    assert sizes == [1, 2, 4, 8, 16, 24]
    assert got_inside.response_ids == want_inside.response_ids
    assert got_above.response_ids == want_above.response_ids
