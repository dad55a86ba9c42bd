"""The SFT trainer: next batch -> masked next-token NLL -> actor update -> validation loss -> checkpoint.

Launch: `algorithm.name: sft` in an RLJob (see examples/llama-sft-megatron.yaml); the operator builds
the same PyTorchJob as for GRPO and `rljob_worker.__main__` picks this trainer by the algorithm, so
`rljob run FILE` and `torchrun -m rljob_worker --spec spec.json` work unchanged.

What it is, and where it departs from a textbook SFT loop:
- Loss: mean NLL over the target tokens of the *global* batch (labels != -100), each token weighing
  the same whatever the micro-batch split, padding, packing or data-parallel layout; the megatron
  actor computes log-probs with vocab-parallel cross entropy (no rank gathers the vocab under TP).
- Batches: trainBatchSizePerNode x nnodes sequences per optimizer step; each data-parallel rank takes
  an equal contiguous share of the sampled batch and accumulates gradients over micro-batches of
  microBatchSizePerGpu. With sft.packing the share is sorted by length first (less padding work).
- LR: linear warm-up over training.lrWarmupSteps, then constant or cosine to lr x sft.minLrRatio.
  The trainer owns the schedule (the actor's OptimConfig knows warm-up only): each step it hands the
  actor an OptimConfig whose lr is that step's. The schedule spans the spec's planned steps
  (totalTrainingSteps, else totalEpochs x batches per epoch); `rljob run --steps N` only stops a run
  early, so a later run resumes onto the same schedule.
- Start-up, checkpoints, resume, telemetry, status and the HF export are the shared run loop's
  (rljob_worker.run_loop); there is no rollout engine and no reference model.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from rljob_api.enums import LRSchedule

from rljob_worker.data.prompts import EpochSampler
from rljob_worker.data.sft_samples import IGNORE_INDEX, collate, load_sft_datasets
from rljob_worker.run_loop import RunLoop
from rljob_worker.telemetry.flops import active_parameters

log = logging.getLogger("rljob.sft")


# --------------------------------------------------------------------------- pure functions


def sft_loss(logprobs: torch.Tensor, labels: torch.Tensor, normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked next-token NLL.

    logprobs (B, T): log p(input_ids[:, t] | tokens < t), aligned with input_ids (the actor's convention).
    labels (B, T): input_ids where token t is a target, IGNORE_INDEX (-100) elsewhere.
    normaliser: what the summed NLL is divided by (the caller's token count; see SFTTrainer._loss_fn).
    Returns (loss, {"target_tokens"}). Ignored positions contribute nothing, not even a NaN.
    """
    mask = labels != IGNORE_INDEX
    nll = torch.where(mask, -logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    return nll.sum() / normaliser, {"target_tokens": float(mask.sum())}


def lr_at(step: int, planned_steps: int, peak: float, warmup_steps: int, schedule: LRSchedule,
          min_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warm-up to `peak` over `warmup_steps`, then
    constant, or cosine from `peak` (first step after warm-up) towards peak x min_ratio (reached after
    the last planned step; steps past the plan stay there)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return peak * step / warmup_steps
    if schedule == LRSchedule.CONSTANT:
        return peak
    progress = min(1.0, (step - 1 - warmup_steps) / max(1, planned_steps - warmup_steps))
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- the trainer


class SFTTrainer(RunLoop):
    """SFT on the shared run loop (:mod:`rljob_worker.run_loop`): this class supplies the data, the
    model, the step and the validation."""

    progress_name = "sft"
    last_val_loss: float | None = None

    # ------------------------------------------------------------------ set-up
    def build_data(self) -> None:
        """Model folder, tokenizer, data: the usual mistakes fail here, before the model is built."""
        spec, env, t = self.spec, self.env, self.spec.training
        # Configuration first: model folder, tokenizer, data.
        from transformers import AutoTokenizer

        from rljob_worker.data.model_source import fetch_file, resolve_model_dir, resolve_tokenizer_dir

        self.model_dir = resolve_model_dir(spec, self.ctx.workdir, local_rank=env.local_rank)
        tokenizer_dir = (resolve_tokenizer_dir(spec, self.ctx.workdir, local_rank=env.local_rank)
                         if spec.model.tokenizer_path else self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=spec.model.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.train_set, self.val_set = load_sft_datasets(
            spec, self.tokenizer, t.seed, fetch=lambda uri: fetch_file(uri, spec, self.ctx.workdir / "data"))
        self.global_batch = t.train_batch_size_per_node * spec.nnodes
        self.sampler = EpochSampler(len(self.train_set), self.global_batch, t.seed, spec.data.shuffle)
        self.planned_steps = t.total_training_steps or t.total_epochs * self.sampler.batches_per_epoch
        self.total_steps = self.ctx.max_steps or self.planned_steps  # where this run stops

    def build_model(self) -> None:
        """The megatron-core actor (TP, distributed optimizer; vocab-parallel log-probs)."""
        spec, t = self.spec, self.spec.training
        from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig, RecomputeConfig

        m = spec.megatron
        parallel = ParallelConfig.from_spec(m)
        # No warm-up here: _set_lr hands the actor each step's lr from lr_at.
        optim = OptimConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, lr_warmup_steps=0)
        from rljob_worker.megatron.lora import LoraConfig

        lora = LoraConfig.from_spec(spec.lora, seed=t.seed, base_uri=spec.model.path) if spec.lora else None
        self.actor = MegatronActor.from_hf(
            self.model_dir, parallel=parallel, optim=optim, dtype=self.dtype, seed=t.seed,
            recompute=RecomputeConfig.from_spec(m, spec.model.gradient_checkpointing),
            transformer_overrides=m.override_transformer_config, lora=lora)
        self.dp_rank, self.dp_size = self.actor.dp_rank, self.actor.dp_size
        self.per_rank = self.global_batch // self.dp_size
        self.micro_batches = self.per_rank // t.micro_batch_size_per_gpu
        self._num_params = active_parameters(self.actor.hf_config)  # MoE: top-k experts only
        if self.is_main:
            log.info("SFT: %d train / %s val sequences, global batch %d = %d DP x %d micro-batches x %d, %d planned steps",
                     len(self.train_set), len(self.val_set) if self.val_set else 0, self.global_batch, self.dp_size,
                     self.micro_batches, t.micro_batch_size_per_gpu, self.planned_steps)

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, float]:
        t = self.spec.training
        # 1. the global batch (indices into the train set, the same on every rank); this DP rank's share
        indices = self.sampler.next_batch()
        examples = [self.train_set.examples[i] for i in indices]
        local = examples[self.dp_rank * self.per_rank:(self.dp_rank + 1) * self.per_rank]
        if self.spec.sft.packing:  # similar lengths share a micro-batch: each is cut to about its own length
            local = sorted(local, key=lambda ex: len(ex.input_ids), reverse=True)
        batch = collate(local, self.pad_id)  # input_ids, attention_mask, labels: (per_rank, T)
        # Token-mean over the global batch: every rank divides by the same global target count.
        target_tokens = sum(ex.num_targets for ex in examples)
        batch["normaliser"] = max(target_tokens, 1) / (self.micro_batches * self.dp_size)

        # 2. one optimizer step: micro-batches of microBatchSizePerGpu, gradients accumulated
        lr = self._set_lr()
        start = time.perf_counter()
        lora_before = self.actor.lora.snapshot() if self.actor.lora is not None else None
        with self.telemetry.stage("actor_update"):
            out = self.actor.update(batch, _loss_fn, micro_batch_size=t.micro_batch_size_per_gpu)
        seconds = time.perf_counter() - start

        # 3. metrics: loss is the global token-mean NLL (the actor averages it over micro-batches and DP)
        tokens = float(sum(len(ex.input_ids) for ex in examples))
        metrics = {"actor/loss": out["loss"], "actor/grad_norm": out["grad_norm"], "actor/lr": lr,
                   "actor/skipped": out["skipped"], "data/target_tokens": float(target_tokens),
                   "data/tokens": tokens, "data/epoch": float(self.sampler.epoch),
                   "throughput/train_tokens_per_s": tokens / max(seconds, 1e-9)}
        if lora_before is not None:
            metrics.update(self.actor.lora.norms(lora_before, self.actor.tp_group, self.actor.pp_group))
        if self.device.type == "cuda":
            cfg = self.actor.hf_config
            seq = tokens / len(examples)
            flops_per_token = 6 * self._num_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
            peak = float(os.environ.get("RLJOB_PEAK_TFLOPS", "989")) * 1e12 * dist.get_world_size()
            metrics["perf/mfu"] = tokens * flops_per_token / max(seconds, 1e-9) / peak
        return metrics

    def _set_lr(self) -> float:
        t, s = self.spec.training, self.spec.sft
        lr = lr_at(self.step, self.planned_steps, t.lr, t.lr_warmup_steps, s.lr_schedule, s.min_lr_ratio)
        self.actor.optim = dataclasses.replace(self.actor.optim, lr=lr, lr_warmup_steps=0)
        return lr

    # ------------------------------------------------------------------ validation
    def validate_for_log(self) -> dict[str, float]:
        return {"val/loss": self.validate()}

    def validate(self) -> float:
        """Token-mean NLL over every target token of the validation set (each DP rank takes every dp-th row)."""
        micro = self.spec.training.micro_batch_size_per_gpu
        rows = sorted(self.val_set.examples[self.dp_rank::self.dp_size], key=lambda ex: len(ex.input_ids))
        totals = torch.zeros(2, dtype=torch.float64)  # summed NLL, target tokens
        with self.telemetry.stage("validation"):
            for lo in range(0, len(rows), micro):
                batch = collate(rows[lo:lo + micro], self.pad_id)
                logprobs = self.actor.compute_logprobs(batch, micro_batch_size=micro)["logprobs"]
                nll, info = sft_loss(logprobs.double(), batch["labels"], 1.0)
                totals += torch.tensor([float(nll), info["target_tokens"]], dtype=torch.float64)
            if self.dp_size > 1:
                totals = totals.to(self.actor.device)
                dist.all_reduce(totals, group=self.actor.dp_group)
        loss = float(totals[0] / totals[1].clamp(min=1))
        self.telemetry.record_validation(self.step, {"val/loss": loss})
        self.last_val_loss = loss
        if self.is_main:
            log.info("validation at step %d: loss %.4f over %d target tokens", self.step, loss, int(totals[1]))
        return loss

    # ------------------------------------------------------------------ the loop's hooks
    def trainer_state(self) -> dict[str, Any]:
        return {**super().trainer_state(), "last_val_loss": self.last_val_loss}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        super().load_trainer_state(state)
        self.last_val_loss = state.get("last_val_loss")

    def progress_line(self, metrics: dict[str, float], eta_s: float) -> str:
        val = f" | val_loss {self.last_val_loss:.4f}" if self.last_val_loss is not None else ""
        return (f"step {self.step}/{self.total_steps} | loss {metrics['actor/loss']:.4f}{val} | "
                f"grad_norm {metrics['actor/grad_norm']:.3f} | lr {metrics['actor/lr']:.2e} | "
                f"{metrics['throughput/train_tokens_per_s']:.0f} tok/s | {metrics['timing/step_s']:.2f}s | "
                f"ETA {eta_s:.0f}s")

    def progress_postfix(self, metrics: dict[str, float]) -> str:
        return f"loss {metrics['actor/loss']:.4f}"

    def summary_line(self) -> str | None:
        if not self.history:
            return None
        return (f"done: {self.step} steps, loss {self.history[0].metrics['actor/loss']:.4f} (first step) -> "
                f"{self.history[-1].metrics['actor/loss']:.4f} (last step)"
                + (f", val loss {self.last_val_loss:.4f}" if self.last_val_loss is not None else ""))


def _loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: dict[str, Any]):
    """The actor's loss hook: micro["labels"] (b, T) and the step's micro["normaliser"] (a float)."""
    return sft_loss(logprobs, micro["labels"], micro["normaliser"])
