"""The SFT trainer: next batch -> masked next-token NLL -> actor update -> validation loss -> checkpoint.

Launch: `algorithm.name: sft` in an RLJob (see examples/llama-sft-megatron.yaml); the operator builds
the same PyTorchJob as for GRPO and `rljob_worker.trainer.run` hands the spec to `run` here, so
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
- Checkpoints, resume, telemetry, status and the HF export are the GRPO trainer's (CheckpointIO,
  TrainerTelemetry, StatusReporter); there is no rollout engine and no reference model.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rljob_api.enums import LRSchedule
from rljob_api.models import RLJobSpec

from rljob_worker.data import EpochSampler
from rljob_worker.distributed import DistEnv, dist_env_from_environ, init_distributed
from rljob_worker.flops import active_parameters
from rljob_worker.sft_data import IGNORE_INDEX, collate, load_sft_datasets
from rljob_worker.trainer import EXIT_PREEMPTED, Preempted, RunContext, StepResult, _torch_dtype

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


class SFTTrainer:
    def __init__(self, spec: RLJobSpec, ctx: RunContext, env: DistEnv | None = None):
        self.spec, self.ctx = spec, ctx
        self.env = env or dist_env_from_environ(os.environ)
        self.history: list[StepResult] = []
        self.step = 0
        self.last_val_loss: float | None = None
        self._stop_requested = False
        self._status_reporter = None

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Everything that can fail on bad input fails here, before any training."""
        spec, env, t = self.spec, self.env, self.spec.training
        init_distributed(env)
        self.is_main = env.rank == 0
        self.device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        random.seed(t.seed + env.rank)
        np.random.seed(t.seed + env.rank)
        torch.manual_seed(t.seed)
        self.dtype = _torch_dtype(spec.model.dtype.value, self.device)

        # Configuration first: model folder, tokenizer, data.
        from transformers import AutoTokenizer

        from rljob_worker.model_source import fetch_file, resolve_model_dir, resolve_tokenizer_dir

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
        if self.device.type == "cpu":
            from rljob_worker.megatron.cpu_compat import apply_cpu_patches

            apply_cpu_patches()

        from rljob_worker.checkpoint_io import CheckpointIO

        self.checkpoints = CheckpointIO(spec, self.ctx, self.env)
        self.checkpoints.check_access()

        # The model: megatron-core actor (TP, distributed optimizer; vocab-parallel log-probs).
        from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig, RecomputeConfig

        m = spec.megatron
        parallel = ParallelConfig.from_spec(m)
        # No warm-up here: _set_lr hands the actor each step's lr from lr_at.
        optim = OptimConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, lr_warmup_steps=0)
        self.actor = MegatronActor.from_hf(
            self.model_dir, parallel=parallel, optim=optim, dtype=self.dtype, seed=t.seed,
            recompute=RecomputeConfig.from_spec(m, spec.model.gradient_checkpointing),
            transformer_overrides=m.override_transformer_config)
        self.dp_rank, self.dp_size = self.actor.dp_rank, self.actor.dp_size
        self.per_rank = self.global_batch // self.dp_size
        self.micro_batches = self.per_rank // t.micro_batch_size_per_gpu
        self._num_params = active_parameters(self.actor.hf_config)  # MoE: top-k experts only

        self.telemetry = self._make_telemetry()
        signal.signal(signal.SIGTERM, self._request_stop)
        self._resume()
        if self.is_main:
            log.info("SFT: %d train / %s val sequences, global batch %d = %d DP x %d micro-batches x %d, %d planned steps",
                     len(self.train_set), len(self.val_set) if self.val_set else 0, self.global_batch, self.dp_size,
                     self.micro_batches, t.micro_batch_size_per_gpu, self.planned_steps)

    def _make_telemetry(self):
        from rljob_worker.telemetry import TrainerTelemetry

        telemetry = TrainerTelemetry(job=self.ctx.job_name, namespace=self.ctx.namespace, rank=self.env.rank,
                                     model=self.spec.model.path, algorithm=self.spec.algorithm.name.value,
                                     nnodes=self.spec.nnodes, save_freq=self.spec.checkpoint.save_freq,
                                     tensorboard_dir=self.spec.metrics.tensorboard_dir if self.is_main else None)
        if self.spec.metrics.enabled and self.env.local_rank == 0:
            port = int(os.environ.get("RLJOB_METRICS_PORT", self.spec.metrics.port))
            self.metrics_port = telemetry.serve(port)
        telemetry.set_total_steps(self.total_steps)
        return telemetry

    def _request_stop(self, signum, _frame) -> None:
        log.warning("signal %d: finishing the current step, then saving a checkpoint", signum)
        self._stop_requested = True

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[StepResult]:
        spec, t = self.spec, self.spec.training
        if self.step >= self.total_steps and self.is_main:
            print(f"nothing to train: resumed at step {self.step} of {self.total_steps} from {self.checkpoints.uri}; "
                  "delete that checkpoint folder (or `rljob run --fresh`) to train again", flush=True)
        if t.val_before_train and self.val_set is not None and self.step == 0:
            self._append_metrics_log({"val/loss": self.validate()})
        while self.step < self.total_steps:
            step_start = time.perf_counter()
            self.step += 1
            metrics = self.train_step()
            metrics["timing/step_s"] = time.perf_counter() - step_start
            self.history.append(StepResult(self.step, metrics))
            self.telemetry.record_step(self.step, metrics, metrics["timing/step_s"])
            self.telemetry.record_gpu_memory()
            self._poll_checkpoint()

            last = self.step == self.total_steps
            logged = dict(metrics)
            if self.val_set is not None and t.test_freq > 0 and (self.step % t.test_freq == 0 or last):
                logged["val/loss"] = self.validate()
            self._append_metrics_log(logged)
            self._report_progress(metrics)
            stop = self._agree_to_stop()
            due = last or (spec.checkpoint.save_freq > 0 and self.step % spec.checkpoint.save_freq == 0)
            if due or (stop and spec.checkpoint.save_on_preemption):
                with self.telemetry.stage("checkpoint"):
                    self.checkpoints.save(self.step, self.actor, self.trainer_state(), metrics)
                self._poll_checkpoint()
            if stop:
                self.checkpoints.wait()
                raise Preempted(f"stopped by SIGTERM after step {self.step}")
        self.checkpoints.wait()
        self._poll_checkpoint()
        self._publish_status(force=True)
        if spec.checkpoint.export_hf:
            self.checkpoints.export_hf(self.actor, self.tokenizer, self.model_dir)
        return self.history

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
        with self.telemetry.stage("actor_update"):
            out = self.actor.update(batch, _loss_fn, micro_batch_size=t.micro_batch_size_per_gpu)
        seconds = time.perf_counter() - start

        # 3. metrics: loss is the global token-mean NLL (the actor averages it over micro-batches and DP)
        tokens = float(sum(len(ex.input_ids) for ex in examples))
        metrics = {"actor/loss": out["loss"], "actor/grad_norm": out["grad_norm"], "actor/lr": lr,
                   "actor/skipped": out["skipped"], "data/target_tokens": float(target_tokens),
                   "data/tokens": tokens, "data/epoch": float(self.sampler.epoch),
                   "throughput/train_tokens_per_s": tokens / max(seconds, 1e-9)}
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

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "last_val_loss": self.last_val_loss,
                "history": [{"step": r.step, "metrics": r.metrics} for r in self.history[-1000:]]}

    def _resume(self) -> None:
        state = self.checkpoints.resume(self.actor)
        if state is None:
            return
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.last_val_loss = state.get("last_val_loss")
        self.history = [StepResult(h["step"], h["metrics"]) for h in state.get("history", [])]
        if self.is_main:
            log.info("resumed from step %d (epoch %d, batch %d)", self.step, self.sampler.epoch, self.sampler.position)

    def _poll_checkpoint(self) -> None:
        """Rank 0: publish a checkpoint once its upload has committed (metrics, RLJob status)."""
        if not self.is_main:
            return
        committed = self.checkpoints.poll()
        if committed is not None:
            self.telemetry.record_checkpoint(committed["step"], time.time())
            self._publish_status(force=True)

    # ------------------------------------------------------------------ helpers
    def _agree_to_stop(self) -> bool:
        """Every rank must stop at the same step: OR the SIGTERM flags over the world."""
        flag = torch.tensor([1 if self._stop_requested else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = flag.to(self.device) if self.device.type == "cuda" else flag
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _report_progress(self, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        recent = self.history[-10:]
        eta = sum(r.metrics.get("timing/step_s", 0.0) for r in recent) / len(recent) * (self.total_steps - self.step)
        val = f" | val_loss {self.last_val_loss:.4f}" if self.last_val_loss is not None else ""
        print(f"step {self.step}/{self.total_steps} | loss {metrics['actor/loss']:.4f}{val} | "
              f"grad_norm {metrics['actor/grad_norm']:.3f} | lr {metrics['actor/lr']:.2e} | "
              f"{metrics['throughput/train_tokens_per_s']:.0f} tok/s | {metrics['timing/step_s']:.2f}s | "
              f"ETA {eta:.0f}s", flush=True)
        self._publish_status()

    def _append_metrics_log(self, metrics: dict[str, float]) -> None:
        """One JSON line per step in <workdir>/metrics.jsonl (rank 0); step 0 holds the first validation."""
        if not self.is_main:
            return
        Path(self.ctx.workdir).mkdir(parents=True, exist_ok=True)
        with open(Path(self.ctx.workdir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, **metrics}) + "\n")

    def _publish_status(self, force: bool = False) -> None:
        """Progress for RLJob.status (step, total, checkpoint; the reward fields stay empty)."""
        if not self.is_main:
            return
        if self._status_reporter is None:
            from rljob_worker.status_report import StatusReporter

            self._status_reporter = StatusReporter.from_environ(self.ctx.job_name, self.ctx.namespace)
        self._status_reporter.report(step=self.step, total_steps=self.total_steps, reward_mean=None,
                                     val_reward_mean=None, last_checkpoint=self.checkpoints.last_committed,
                                     force=force)


def _loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: dict[str, Any]):
    """The actor's loss hook: micro["labels"] (b, T) and the step's micro["normaliser"] (a float)."""
    return sft_loss(logprobs, micro["labels"], micro["normaliser"])


def run(spec: RLJobSpec, ctx: RunContext) -> int:
    """Entry from `rljob_worker.trainer.run` for algorithm sft: returns the process exit code."""
    trainer = SFTTrainer(spec, ctx)
    try:
        trainer.setup()
        trainer.fit()
    except Preempted as exc:
        log.warning("%s; checkpoint committed, exiting %d", exc, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    finally:
        telemetry = getattr(trainer, "telemetry", None)
        if telemetry is not None:
            telemetry.close()
    if trainer.is_main and trainer.history:
        print(f"done: {trainer.step} steps, loss {trainer.history[0].metrics['actor/loss']:.4f} (first step) -> "
              f"{trainer.history[-1].metrics['actor/loss']:.4f} (last step)"
              + (f", val loss {trainer.last_val_loss:.4f}" if trainer.last_val_loss is not None else ""), flush=True)
    return 0
