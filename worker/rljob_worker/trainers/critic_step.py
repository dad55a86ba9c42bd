"""The critic's part of a PPO step, wherever the critic runs (shared placement: the trainer's ranks; split:
the critic pool, :mod:`rljob_worker.trainers.critic_pool`): build it from spec.critic, and update it over the step's
mini-batches with the clipped value loss."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from rljob_worker.algorithms import gae


def build_critic(spec, critic_dir: Path, dtype: torch.dtype):
    """The megatron critic of ``spec.critic`` (its own parallel layout, optimizer, recompute, output layer)."""
    from rljob_worker.megatron.actor import OptimConfig, ParallelConfig, RecomputeConfig
    from rljob_worker.megatron.critic import MegatronCritic
    from rljob_worker.megatron.lora import LoraConfig

    c = spec.critic
    lora = (LoraConfig.from_spec(c.lora, seed=spec.training.seed, base_uri=c.model.path or spec.model.path,
                                 keep_trainable=("output_layer",)) if c.lora else None)  # the value head: in full
    return MegatronCritic.from_hf(
        critic_dir, parallel=ParallelConfig.from_spec(c.megatron),
        optim=OptimConfig(lr=c.lr, weight_decay=c.weight_decay, grad_clip=c.grad_clip,
                          lr_warmup_steps=c.lr_warmup_steps),
        dtype=dtype, seed=spec.training.seed, recompute=RecomputeConfig.from_spec(c.megatron),
        transformer_overrides=c.megatron.override_transformer_config, output_layer_index=c.output_layer_index,
        lora=lora)


def value_loss_fn(spec):
    """``loss_fn(values (b, T), micro, num_tokens=, num_sequences=)`` of the critic engine: the clipped value
    loss against ``micro["returns"]`` around ``micro["old_values"]``, aggregated like the policy loss."""
    c, a = spec.critic, spec.algorithm
    norm_length = spec.data.max_response_length

    def loss_fn(values: torch.Tensor, micro: dict[str, torch.Tensor], num_tokens: float | None = None,
                num_sequences: float | None = None):
        return gae.value_loss(values, micro["old_values"], micro["returns"], micro["response_mask"],
                              c.cliprange_value, a.loss_aggregation, norm_length,
                              num_tokens=num_tokens, num_sequences=num_sequences)

    return loss_fn


def update_critic(critic, minis: list[dict[str, torch.Tensor]], spec) -> dict[str, float]:
    """critic.ppoEpochs passes over ``minis`` (each: input_ids, attention_mask, response_mask, old_values,
    returns (b, T)), one optimizer step per mini-batch; the value loss is normalised by the mini-batch's
    response tokens / sequences over the critic's data-parallel ranks. Metrics under ``critic/``:
    ``value_loss`` (the mini-batch loss), the engine's (grad_norm, value_clip_fraction, ...), ``update_s``."""
    c = spec.critic
    start = time.perf_counter()
    results = [critic.update(mini, value_loss_fn(spec), micro_batch_size=c.micro_batch_size_per_gpu,
                             normalise_by="response_mask")
               for _ in range(c.ppo_epochs) for mini in minis]
    keys = {k for d in results for k in d}
    metrics = {k if k.startswith("critic/") else f"critic/{k}": float(np.mean([d[k] for d in results if k in d]))
               for k in keys}
    metrics["critic/value_loss"] = metrics.pop("critic/loss")
    metrics["critic/update_s"] = time.perf_counter() - start
    return metrics
