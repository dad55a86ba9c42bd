"""The real vLLM 0.26 on a GPU returns the experts it routed each token to (routing replay; marked gpu + vllm).

    python -m pytest tests/worker/test_vllm_gpu_moe.py -v -s -p no:cacheprovider   # its own process: one engine

builtin://tiny-qwen3-moe (4 experts, top-2, both layers MoE), bf16. vLLM's routing covers prompt + response - 1
tokens and lines up with the tokens: an HF forward of the same weights over the same tokens picks the same top-2
set far above chance (1 in 6 for 2 of 4), where a shift by one position would fall to chance. bench/gpu_all.sh
section vllmtests runs it; bench/moe_routing_replay.py measures the same at a Qwen3-30B-A3B shape.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from vllm_helpers import TEXTS, char_prompts, release

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def test_vllm_returns_the_routed_experts_of_every_fed_token(tmp_path):
    from rljob_worker.data.builtin_models import EOS, VOCAB, materialize_builtin
    from rljob_worker.rollout.vllm_engine import VLLMEngine
    from transformers import AutoModelForCausalLM

    model_dir = materialize_builtin("tiny-qwen3-moe", tmp_path / "moe")
    engine = VLLMEngine(str(model_dir), dtype=torch.bfloat16, gpu_memory_utilization=0.2, max_model_len=64,
                        eos_token_id=VOCAB.index(EOS), enforce_eager=True, seed=0, record_routing=True)
    try:
        prompts = char_prompts(TEXTS)
        out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3))
    finally:
        release(engine)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    gates = [layer.mlp.gate for layer in model.model.layers]
    agree = total = 0
    for j, (ids, routed) in enumerate(zip(out.response_ids, out.routed_experts)):
        tokens = prompts[j // 2] + ids[:-1]
        assert tuple(routed.shape) == (len(tokens), 2, 2) and routed.dtype == torch.uint8
        seen = {}
        handles = [g.register_forward_hook(lambda m, a, o, i=i, seen=seen: seen.__setitem__(i, o[2]))
                   for i, g in enumerate(gates)]
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens], device="cuda"))
        for h in handles:
            h.remove()
        for layer, idx in seen.items():
            same = (idx.sort(-1).values.cpu() == routed[:, layer].long().sort(-1).values).all(-1)
            agree, total = agree + int(same.sum()), total + len(tokens)
    assert agree / total > 0.5, (agree, total)
