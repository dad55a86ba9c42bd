"""The PPO critic on the GPU path (megatron DDP + optimizer, Float16Module in bf16), one GPU.

Run with the device tool: ``python -m pytest tests/worker/test_critic_gpu.py -q`` (bench/gpu_all.sh
``gputests`` runs it with every other ``gpu`` test).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_bf16_critic_reads_layer_k_learns_and_checkpoints(tmp_path, distributed_optimizer):
    from rljob_api.enums import LossAggregation
    from rljob_worker.algorithms.gae import value_loss
    from rljob_worker.megatron.critic import MegatronCritic
    from rljob_worker.megatron.engine_config import OptimConfig, ParallelConfig

    hf_dir = H.make_tiny_hf_model("qwen2", tmp_path / "hf", seed=3, num_hidden_layers=3)

    def build():
        return MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(use_distributed_optimizer=distributed_optimizer),
                                      optim=OptimConfig(lr=1e-2), dtype=torch.bfloat16, seed=1, output_layer_index=2)

    critic = build()
    assert len(critic.core.decoder.layers) == 2
    ids, mask = H.sample_batch()
    response = mask.clone()
    response[:, :4] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": response,
             "returns": torch.where(response.bool(), 1.5, 0.0)}
    # bf16 values against the fp32 HF hidden state of layer 2 through the final norm and the head
    hf = H.load_hf_model(hf_dir)
    with torch.no_grad():
        hidden = hf.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                          output_hidden_states=True).hidden_states[2]
        per_token = (hf.model.norm(hidden) @ critic.core.output_layer.weight.detach().float().cpu().T)[..., 0]
    values = critic.compute_values(batch, micro_batch_size=2)
    row = 3  # no padding: value at t = head output at t - 1
    torch.testing.assert_close(values[row, 1:], per_token[row, :-1], rtol=0.05, atol=0.02)

    def loss_fn(v, mb):
        return value_loss(v, torch.zeros_like(v), mb["returns"], mb["response_mask"], 10.0, LossAggregation.TOKEN_MEAN)

    history = [critic.update(batch, loss_fn, micro_batch_size=2) for _ in range(6)]
    assert all(h["skipped"] == 0 for h in history)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    critic.save_checkpoint(tmp_path / "ckpt")
    fresh = build()
    fresh.load_checkpoint(tmp_path / "ckpt")
    torch.testing.assert_close(fresh.compute_values(batch, 2), critic.compute_values(batch, 2), rtol=0, atol=0)
