"""Active parameters per token (the N of the MFU estimate) from the HF config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
from rljob_worker.telemetry.flops import active_parameters


def _hf_numel(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    ],
)
def test_dense_models_count_every_parameter(arch, overrides):
    config = H.tiny_hf_config(arch, **overrides)
    assert active_parameters(config) == _hf_numel(config)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_with_every_expert_routed_counts_every_parameter(arch):
    config = H.tiny_hf_config(arch, num_experts_per_tok=4)  # top-k = all 4 experts
    assert active_parameters(config) == _hf_numel(config)


def test_moe_counts_top_k_experts_and_the_shared_expert_by_hand():
    # tiny qwen2_moe: h 64, vocab 128 untied, 2 layers, 4 heads x 16, 2 kv heads, qkv bias,
    # both layers MoE: 4 experts of 32, top 2, a shared expert of 48 with its gate
    config = H.tiny_hf_config("qwen2_moe")
    h, hd = 64, 16
    attn = h * 4 * hd + 2 * h * 2 * hd + 4 * hd * h + (4 + 2 * 2) * hd  # q k v o + qkv bias
    moe = h * 4 + 2 * (3 * h * 32) + 3 * h * 48 + h  # router, 2 experts, shared expert, its gate
    layer = attn + moe + 2 * h  # + two norms
    assert active_parameters(config) == 128 * h + 2 * layer + h + h * 128  # embed, final norm, lm_head
    # 2 of 4 experts: every layer leaves out 2 experts' weights
    config_all = H.tiny_hf_config("qwen2_moe", num_experts_per_tok=4)
    assert active_parameters(config_all) - active_parameters(config) == 2 * 2 * 3 * h * 32
    # qwen3_moe's dense layer 1 (mlp_only_layers) counts its full MLP of 128
    q3 = H.tiny_hf_config("qwen3_moe")
    q3_dense = H.tiny_hf_config("qwen3_moe", mlp_only_layers=[0, 1])
    assert active_parameters(q3_dense) - active_parameters(q3) == 3 * h * 128 - (h * 4 + 2 * 3 * h * 32)
