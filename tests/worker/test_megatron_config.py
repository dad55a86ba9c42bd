"""HF config -> megatron config mapping, its errors, and the distributed environment (no model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
from rljob_worker.megatron.model_config import (
    check_hf_config,
    megatron_config_from_hf,
    padded_vocab_size,
)
from rljob_worker.runtime.distributed import DistEnv, dist_env_from_environ

# --------------------------------------------------------------------------------------------------
# distributed environment


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, DistEnv(1, 0, 1, 0, "127.0.0.1", 29500)),
        (
            # torchrun inside pod 1 of a 2-node PyTorchJob: the operator's WORLD_SIZE would be 2 pods,
            # but torchrun overrides it with the process count.
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "1",
                "PET_NPROC_PER_NODE": "4",
                "LOCAL_RANK": "3",
                "LOCAL_WORLD_SIZE": "4",
                "RANK": "7",
                "GROUP_RANK": "1",
                "WORLD_SIZE": "8",
                "MASTER_ADDR": "job-master-0",
                "MASTER_PORT": "23456",
                "TORCHELASTIC_RUN_ID": "x",
            },
            DistEnv(2, 1, 4, 3, "job-master-0", 23456),
        ),
        (
            # torchrun without GROUP_RANK: node rank from the global rank
            {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "5", "WORLD_SIZE": "6"},
            DistEnv(3, 2, 2, 1, "127.0.0.1", 29500),
        ),
        (
            # pod-level variables only (no torchrun): RANK is the node index, WORLD_SIZE the pod count
            {
                "PET_NNODES": "3",
                "PET_NPROC_PER_NODE": "8",
                "RANK": "2",
                "WORLD_SIZE": "3",
                "PET_MASTER_ADDR": "m",
                "PET_MASTER_PORT": "1234",
            },
            DistEnv(3, 2, 8, 0, "m", 1234),
        ),
        ({"PET_NNODES": "1:2", "PET_NPROC_PER_NODE": "auto"}, DistEnv(2, 0, 1, 0, "127.0.0.1", 29500)),
    ],
)
def test_dist_env_from_environ(environ, expected):
    env = dist_env_from_environ(environ)
    assert env == expected
    assert env.rank == env.node_rank * env.nproc_per_node + env.local_rank
    assert env.world_size == env.nnodes * env.nproc_per_node


def test_dist_env_rank_formula():
    env = dist_env_from_environ(
        {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "WORLD_SIZE": "8"}
    )
    assert (env.rank, env.world_size) == (7, 8)


# --------------------------------------------------------------------------------------------------
# model config


def test_padded_vocab_size():
    assert padded_vocab_size(128, 2) == 128
    assert padded_vocab_size(127, 2) == 128
    assert padded_vocab_size(151936, 8) == 151936
    assert padded_vocab_size(100, 3) == 102


def test_qwen2_mapping():
    m = megatron_config_from_hf(H.tiny_hf_config("qwen2"), tp=2, on_gpu=False)
    c = m.transformer_config
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups) == (2, 64, 4, 2)
    assert (c.ffn_hidden_size, c.kv_channels, c.tensor_model_parallel_size) == (128, 16, 2)
    assert c.add_qkv_bias and not c.add_bias_linear and c.gated_linear_unit and not c.qk_layernorm
    assert c.normalization == "RMSNorm" and c.layernorm_epsilon == 1e-6
    assert c.activation_func is torch.nn.functional.silu
    assert m.gpt_kwargs["share_embeddings_and_output_weights"] is True
    assert m.gpt_kwargs["rotary_base"] == 10000.0 and m.gpt_kwargs["vocab_size"] == 128
    assert not m.uses_te


def test_qwen3_and_llama_mapping():
    q3 = megatron_config_from_hf(H.tiny_hf_config("qwen3"), on_gpu=False)
    assert q3.transformer_config.qk_layernorm and q3.transformer_config.kv_channels == 32
    assert not q3.transformer_config.add_qkv_bias and q3.gpt_kwargs["rotary_base"] == 1e6
    ll = megatron_config_from_hf(H.tiny_hf_config("llama"), on_gpu=False)
    assert ll.gpt_kwargs["rope_scaling"] is True and ll.gpt_kwargs["rope_scaling_factor"] == 8.0
    assert ll.gpt_kwargs["share_embeddings_and_output_weights"] is False
    lin = megatron_config_from_hf(
        H.tiny_hf_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}), on_gpu=False
    )
    assert lin.gpt_kwargs["seq_len_interpolation_factor"] == 2.0


def test_unsupported_architecture():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        check_hf_config(GPT2Config())


@pytest.mark.parametrize(
    "tp, overrides, setting",
    [
        (2, {"num_key_value_heads": 1}, "num_key_value_heads=1"),
        (3, {}, "num_attention_heads=4"),
        (
            8,
            {"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 132},
            "intermediate_size=132",
        ),
    ],
)
def test_tp_that_does_not_divide(tp, overrides, setting):
    with pytest.raises(ValueError, match=rf"tensorModelParallelSize={tp} does not divide {setting}"):
        megatron_config_from_hf(H.tiny_hf_config("qwen2", **overrides), tp=tp, on_gpu=False)


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ],
)
def test_unsupported_settings(arch, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_hf_config(H.tiny_hf_config(arch, **overrides))


def test_sequence_parallel_uses_the_tagged_norm_with_the_local_spec():
    from rljob_worker.megatron.sequence_parallel import SequenceParallelRMSNorm

    mcfg = megatron_config_from_hf(
        H.tiny_hf_config("qwen3"), tp=2, sequence_parallel=True, on_gpu=False, use_te=False
    )
    layer = mcfg.layer_spec.submodules
    assert mcfg.final_layernorm is SequenceParallelRMSNorm
    assert layer.input_layernorm is layer.pre_mlp_layernorm is SequenceParallelRMSNorm
    assert layer.self_attention.submodules.q_layernorm is SequenceParallelRMSNorm
    norm = SequenceParallelRMSNorm(mcfg.transformer_config, 64, eps=1e-6)
    assert norm.weight.sequence_parallel is True
    x = torch.randn(3, 2, 64)
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(64, eps=1e-6)(x), rtol=0, atol=0)
    plain = megatron_config_from_hf(H.tiny_hf_config("qwen3"), tp=2, on_gpu=False, use_te=False)
    assert plain.final_layernorm is None  # without SP, megatron's own torch norms


def test_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(
        ValueError, match="sequenceParallel=true needs spec.megatron.tensorModelParallelSize > 1"
    ):
        megatron_config_from_hf(
            H.tiny_hf_config("qwen2"), tp=1, sequence_parallel=True, on_gpu=False, use_te=False
        )


def test_unsupported_parallel_layout():
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    with pytest.raises(ValueError, match="virtualPipelineModelParallelSize=2 needs pipeline parallelism"):
        MegatronActor.from_hf("/nonexistent", ParallelConfig(vpp=2), OptimConfig(lr=1e-3))
    with pytest.raises(ValueError, match="contextParallelSize=2 together with pipelineModelParallelSize=2"):
        MegatronActor.from_hf("/nonexistent", ParallelConfig(cp=2, pp=2), OptimConfig(lr=1e-3))
