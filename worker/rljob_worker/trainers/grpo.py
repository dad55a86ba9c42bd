"""The GRPO trainer: rollout -> reward -> advantages -> log-probs -> actor update -> weight sync.

Launch: the operator's PyTorchJob runs `torchrun -m rljob_worker --spec /etc/rljob/spec.json`
on every pod (torchrun reads PET_NNODES / PET_NODE_RANK / PET_NPROC_PER_NODE / PET_MASTER_*);
`rljob run FILE` starts the same processes locally with the same environment.

How this departs from textbook GRPO (Shao et al. 2024):
- Loss aggregation, KL estimator and clip range are configurable (token-mean, low_var_kl in
  the loss and symmetric 0.2 by default, as verl); Dr.GRPO (no std normalisation,
  seq-mean-token-sum-norm), DAPO (clip-higher, dynamic sampling, overlong shaping) and GSPO
  (sequence-level ratio) are settings, not forks.
- Old log-probs: when a rollout batch gets exactly one optimizer step (one mini-batch, one
  epoch) the sampling policy *is* the policy being updated, so the ratio is 1 by
  construction; the trainer then uses the current log-probs, detached, and skips a forward
  pass. Otherwise they are recomputed by the megatron actor with the trainer's numerics
  (not taken from the rollout engine, whose kernels differ); the difference to the
  engine's own log-probs is reported as `rollout/logprob_mismatch_*`, and
  `algorithm.rolloutCorrection` can weight the policy gradient by that gap (truncated
  importance sampling, sequence masking).
- KL in the reward (`klPlacement: reward`) is subtracted from the token rewards before the
  advantage estimator runs (as verl's apply_kl_penalty before compute_advantage), so it is
  group-centred and std-scaled with the reward; the advantages are then computed after the
  reference log-probs, on every rank, from the DP-gathered KL.
- Loss aggregation is over the whole mini-batch of an optimizer step, whatever the
  micro-batch size and parallel layout: the actor counts the mini-batch's response tokens and
  sequences over the DP ranks and each micro-batch's loss is its share (see
  megatron.actor.MegatronActor.update). The reported
  actor/loss is the mini-batch loss, actor/pg_loss, actor/kl and actor/entropy micro-batch means.
- Rollouts (spec.rollout.ranks): with the hf engines on GPUs every rank holds the whole model and
  samples its share of whole prompt groups, and the pieces are gathered in prompt order before the
  estimator (rljob_worker.rollout.every_rank); with `rank0` (the default on CPU) global rank 0
  samples the whole batch. The vLLM engine samples per rollout-TP group. Rewards and advantages
  are computed on rank 0 over whole groups and the batch goes to every rank; each data-parallel
  rank trains on its contiguous slice. The hf engines release their KV cache after each rollout,
  so the actor's update gets that memory back.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rljob_api.enums import KLPlacement
from rljob_api.enums import RolloutEngine as RolloutEngineName
from rljob_api.validation import (
    actor_gpus_per_node,
    actor_token_budget_in_effect,
    rollout_in_own_pool,
    rollout_lookahead,
    token_truncation_in_effect,
)

from rljob_worker import algorithms as algo
from rljob_worker.data.batching import (
    pad_batch,
    scatter_response_values,
    slice_batch,
    split_batch,
    take_rows,
    trim_padding,
)
from rljob_worker.data.prompts import EpochSampler, load_datasets
from rljob_worker.data.token_budget import balanced_dp_order
from rljob_worker.rewards import RewardRouter
from rljob_worker.rollout import RolloutOutput, SamplingParams
from rljob_worker.rollout.every_rank import (
    check_hf_engine_layout,
    prompt_shares,
    replica_seed,
    sample_share_and_gather,
    samples_on_every_rank,
)
from rljob_worker.rollout.factory import make_engine, resolve_engine_name
from rljob_worker.rollout.routed_experts import routing_batch
from rljob_worker.rollout.weight_sync import plan_rollout_layout
from rljob_worker.run_health import sanitize_rewards
from rljob_worker.run_loop import RunLoop
from rljob_worker.runtime.distributed import all_gather_rows, broadcast_object
from rljob_worker.startup_errors import StartupError
from rljob_worker.telemetry.flops import active_parameters

log = logging.getLogger("rljob.trainer")
VALIDATION_TABLE_ROWS = 64  # validation samples (prompt, response, ground truth, reward) sent to the trackers


class GRPOTrainer(RunLoop):
    """GRPO on the shared run loop (:mod:`rljob_worker.run_loop`): this class supplies the data, the
    models (actor, reference, rollout engine), the step and the validation."""

    progress_name = "grpo"

    # ------------------------------------------------------------------ set-up
    def __init__(self, spec, ctx, env=None, pools=None):
        super().__init__(spec, ctx, env=pools.env if pools is not None else env)
        self.pools = pools  # the actor pool's process groups when a critic or rollout pool runs beside it
        self.separate = rollout_in_own_pool(spec)  # the rollout pool samples (rljob_worker.rollout.rollout_pool)
        self.lookahead = rollout_lookahead(spec)  # batches the rollout pool generates ahead (rollout.mode)
        self.rollout_pool = None
        self._ahead: collections.deque[_Ahead] = collections.deque()
        self._pool_replies: list = []  # (reply, seconds waited, rows kept) behind this step's batch
        self._dropped_stale = 0  # samples of this step's batch dropped for staleness

    def build_data(self) -> None:
        """Reward, model folder, tokenizer, data: the usual mistakes fail here, before any model is built."""
        spec, env = self.spec, self.env
        self.reward_pool = _reward_pool(spec.reward.num_workers) if self.is_main else None
        # every rank resolves the functions and reads the remote headers' env; rank 0 scores and probes
        from rljob_api.models import judge_url

        self.rewards = RewardRouter(spec.reward, pool=self.reward_pool,
                                    judge_url=judge_url(self.ctx.job_name, self.ctx.namespace))
        if self.is_main:
            self.rewards.probe()
        from rljob_worker.data.model_source import resolve_model_dir

        self.model_dir = resolve_model_dir(spec, self.ctx.workdir, local_rank=env.local_rank)
        from transformers import AutoTokenizer

        tokenizer_dir = self.model_dir
        if spec.model.tokenizer_path:
            from rljob_worker.data.model_source import resolve_tokenizer_dir

            tokenizer_dir = resolve_tokenizer_dir(spec, self.ctx.workdir, local_rank=env.local_rank)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=spec.model.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        self.train_set, self.val_set = load_datasets(spec.data, self.tokenizer, spec.training.seed,
                                                     fetch=self._fetcher(),
                                                     reward=None if spec.reward.remote else spec.reward.function)
        if self.is_main and spec.reward.by_source:
            warning = self.rewards.unused_routes_warning(
                {r.data_source for ds in (self.train_set, self.val_set) if ds is not None for r in ds.records})
            if warning:
                log.warning("%s", warning)
        self.agent = _build_agent(spec, self.tokenizer) if spec.rollout.agent is not None else None
        self.prompts_per_step = spec.training.train_batch_size_per_node * spec.nnodes
        self.sampler = EpochSampler(len(self.train_set), self.prompts_per_step, spec.training.seed, spec.data.shuffle)
        self.total_steps = self._total_steps()

    def build_model(self) -> None:
        """The actor, the reference model (klCoef > 0) and the rollout engine."""
        spec = self.spec
        self._plan_rollout()  # cheap, and refuses layouts the engine cannot serve before the actor is built
        from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig, RecomputeConfig

        m, t = spec.megatron, spec.training
        parallel = ParallelConfig.from_spec(m)
        optim = OptimConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, lr_warmup_steps=t.lr_warmup_steps)
        recompute = RecomputeConfig.from_spec(m, spec.model.gradient_checkpointing)
        from rljob_worker.megatron.lora import LoraConfig

        lora = LoraConfig.from_spec(spec.lora, seed=t.seed, base_uri=spec.model.path) if spec.lora else None
        self.actor = MegatronActor.from_hf(self.model_dir, parallel=parallel, optim=optim, dtype=self.dtype,
                                           seed=t.seed, recompute=recompute,
                                           transformer_overrides=m.override_transformer_config, lora=lora)
        a = spec.algorithm
        if a.routing_replay:  # the rollout's expert choices drive the actor's routers (the reference routes itself)
            self.actor.enable_routing_replay()
        self.use_ref = a.kl_coef > 0
        # with LoRA the reference policy is the actor with its adapters off: no second copy of the weights
        self.ref = (MegatronActor.from_hf(self.model_dir, parallel=parallel, optim=optim, dtype=self.dtype, seed=t.seed,
                                            trainable=False, transformer_overrides=m.override_transformer_config)
                    if self.use_ref and lora is None else None)
        # log-probs of the distribution the rollout sampled (temperature 0, greedy, has no such distribution: raw)
        temperature = spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0
        for model in (self.actor, self.ref):
            if model is not None:
                model.logit_temperature = temperature
        # megatron.*Offload: free the actor's (and the reference model's) GPU memory during rollout
        flags = {"params": m.param_offload, "grads": m.grad_offload, "optimizer": m.optimizer_offload}
        ref_flags = {"params": m.param_offload, "grads": False, "optimizer": False}
        self._offload_plan = [(model, f) for model, f in ((self.actor, flags), (self.ref, ref_flags))
                              if model is not None and any(f.values()) and not self.separate]
        self._offload_checked = False  # after the first rollout: does the state fit beside it after all?
        self.dp_rank, self.dp_size = self.actor.dp_rank, self.actor.dp_size
        self._num_params = active_parameters(self.actor.hf_config)  # MoE: top-k experts only
        self.loss_config = algo.LossConfig(
            clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high, dual_clip_c=a.dual_clip_c,
            kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_placement=a.kl_placement,
            entropy_coef=a.entropy_coeff, aggregation=a.loss_aggregation, importance=a.importance_level,
            norm_length=spec.data.max_response_length)

        # Rollout engine (see _plan_rollout). hf engines: on every rank (each samples a share of the prompt
        # groups) or on global rank 0 only. vLLM lives on every rank (its process groups span the torchrun
        # world): each rollout-TP group is one replica that samples a slice of the prompts.
        r, world = spec.rollout, dist.get_world_size() if dist.is_initialized() else 1
        self.rollout_layout = (plan_rollout_layout(world, actor_gpus_per_node(spec), m.tensor_model_parallel_size,
                                                   r.tensor_model_parallel_size)
                               if self.engine_everywhere and self.engine_is_vllm else None)
        if self.agent is not None:
            self.agent.tools.shared = self.engine_everywhere
        self.engine = None
        self._partial_sync: bool | None = None  # decided at the first weight sync (_partial_weight_sync)
        # the static engine's cache between steps (_release_engine): undecided until a step's training was measured;
        # RLJOB_ROLLOUT_CACHE is read here so that a wrong value fails at start-up, not at step 2
        from rljob_worker.rollout.cache_residency import residency_forced_off

        self._cache_resident: bool | None = False if residency_forced_off() else None
        self._training_peak_bytes: int | None = None
        if self.separate:
            from rljob_worker.rollout.rollout_pool import RolloutPoolClient

            self.rollout_pool = RolloutPoolClient(self.pools, self.device)
            engine = self.rollout_pool.build(name=RolloutEngineName.HF, model_dir=str(self.model_dir),
                                             dtype=self.dtype, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                             seed=t.seed, compile=r.compile, record_routing=a.routing_replay)
            if self.is_main:
                log.info("rollout engines: the rollout pool's (%d GPU(s) per node, %s, mode %s%s)", r.gpus, engine,
                         r.mode.value, f", up to {self.lookahead} batch(es) ahead" if self.lookahead else "")
        elif self.is_main or self.engine_everywhere:
            self.engine = make_engine(self.engine_name, str(self.model_dir), dtype=self.dtype, device=self.device,
                                      eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                      tensor_parallel_size=r.tensor_model_parallel_size,
                                      gpu_memory_utilization=r.gpu_memory_utilization,
                                      max_model_len=spec.data.max_prompt_length + spec.data.max_response_length,
                                      enforce_eager=r.enforce_eager, max_num_batched_tokens=r.max_num_batched_tokens,
                                      seed=t.seed, compile=r.compile, record_routing=a.routing_replay,
                                      max_rows=self._most_rows_per_call())
        if self.engine is not None and self.is_main:
            log.info("rollout engine: %s on %s (rollout.engine: %s; %s%s)", type(self.engine).__name__, self.device,
                     r.engine.value, "every rank samples a share" if self.engine_everywhere else "rank 0 samples",
                     "; decode step compiled" if getattr(self.engine, "compile_decode", False) else "")
        if self.is_main and self.actor_token_budget and spec.training.max_tokens_per_micro_batch is None:
            log.info("actor update: micro-batches of rows grouped by length, <= %d tokens each (on a GPU with "
                     "training.maxTokensPerMicroBatch unset: microBatchSizePerGpu full rows; 0 keeps "
                     "microBatchSizePerGpu rows)", self.actor_token_budget)

    def _most_rows_per_call(self) -> int:
        """The most rows one generate call hands the engine: a step's prompts x samples, or the validation set x
        valN (sampled in one call). An upper bound where replicas share a call; vLLM captures graphs up to it."""
        r = self.spec.rollout
        val = len(self.val_set.records) * r.val_n if self.val_set is not None else 0
        return max(self.prompts_per_step * r.samples_per_prompt, val)

    @functools.cached_property
    def actor_token_budget(self) -> int | None:
        """Token budget of the actor update's micro-batches; None: microBatchSizePerGpu rows each."""
        return actor_token_budget_in_effect(self.spec, on_gpu=self.device.type == "cuda")

    def _plan_rollout(self) -> None:
        """Which engine, which ranks sample (spec.rollout.ranks), and whether an hf engine can serve the
        model at all: it holds the whole model on each sampling GPU (RolloutLayoutError otherwise)."""
        spec, r = self.spec, self.spec.rollout
        if self.separate:  # hf engines in the rollout pool, one per rollout GPU; none in this pool
            self.engine_name, self.engine_is_vllm, self.engine_everywhere = RolloutEngineName.HF, False, False
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        from rljob_worker.megatron.hf_weights import load_hf_config

        hf_config = load_hf_config(self.model_dir)
        self.engine_name = resolve_engine_name(r.engine, self.device, world_size=world,
                                               rollout_tp=r.tensor_model_parallel_size,
                                               num_params=active_parameters(hf_config))
        self.engine_is_vllm = self.engine_name == RolloutEngineName.VLLM
        self.engine_everywhere = samples_on_every_rank(r.ranks, engine_is_vllm=self.engine_is_vllm,
                                                       on_gpu=self.device.type == "cuda", world_size=world)
        if not self.engine_is_vllm:
            check_hf_engine_layout(rollout_tp=r.tensor_model_parallel_size, gpus_per_node=actor_gpus_per_node(spec),
                                   gpu_memory_utilization=r.gpu_memory_utilization, dtype_name=str(self.dtype)[6:],
                                   **self._engine_memory(hf_config))

    def _engine_memory(self, hf_config) -> dict[str, int]:
        """{weight_bytes, card_bytes} of an hf engine on this GPU ({} on CPU): the model's parameters in the
        engine's dtype (counted on the meta device, nothing allocated) and the card's memory."""
        if self.device.type != "cuda":
            return {}
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=self.spec.model.trust_remote_code)
        params = sum(p.numel() for p in model.parameters())
        return {"weight_bytes": params * self.dtype.itemsize,
                "card_bytes": torch.cuda.get_device_properties(self.device).total_memory}

    def _fetcher(self):
        from rljob_worker.data.model_source import fetch_file

        return lambda uri: fetch_file(uri, self.spec, self.ctx.workdir / "data")

    def _total_steps(self) -> int:
        t = self.spec.training
        if self.ctx.max_steps is not None:
            return self.ctx.max_steps
        if t.total_training_steps is not None:
            return t.total_training_steps
        return t.total_epochs * self.sampler.batches_per_epoch

    def _check_offload_needed(self, offloaded: int) -> None:
        """After the first rollout with offload: when its measured peak plus the state the offload moved fits
        the GPU on every rank, stop offloading (each step saves the copies out and back). Only with the hf
        engines, whose memory comes from torch's allocator and so is in the peak; vLLM reserves its share
        outside it. ``RLJOB_OFFLOAD=always`` keeps offloading."""
        from rljob_worker.megatron.offload import HEADROOM, OFFLOAD_MODE_ENV, offload_still_needed

        self._offload_checked = True
        if (self.device.type != "cuda" or self.engine_is_vllm or not offloaded
                or os.environ.get(OFFLOAD_MODE_ENV, "").strip().lower() == "always"):
            return
        peak = self.telemetry.pending_stage_peak_bytes().get("rollout", 0)
        total = torch.cuda.get_device_properties(self.device).total_memory
        need = torch.tensor([float(offload_still_needed(total, peak, offloaded))], device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(need, op=dist.ReduceOp.MAX)  # every rank decides the same
        if need.item():
            return
        self._offload_plan = []
        if self.is_main:  # on the progress output, like the start-up lines
            print(f"offload off from step 2: the rollout peaked at {peak / 2**30:.1f} GiB with {offloaded / 2**30:.1f} "
                  f"GiB offloaded, together below {100 * (1 - HEADROOM):.0f}% of the GPU's {total / 2**30:.1f} GiB "
                  "(RLJOB_OFFLOAD=always keeps offloading)", flush=True)

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, float]:
        spec, a = self.spec, self.spec.algorithm
        metrics: dict[str, float] = {}

        # 1. rollout + reward + advantages on rank 0, then the batch goes to every rank.
        #    batch tensors are (N, T): N = prompts x n responses, T = prompt + response columns.
        offloaded = 0
        if self._offload_plan:
            with self.telemetry.stage("actor_offload"):  # the rollout engine gets their GPU memory
                for model, flags in self._offload_plan:
                    offloaded += sum(model.offload(**flags).values())
        samples_here = self.is_main or self.engine_everywhere
        # a remote reward scores in the background while the log-probs below are computed (joined in 3.)
        defer = (self.rewards.overlap and not a.dynamic_sampling
                 and not (self.use_ref and a.kl_placement == KLPlacement.REWARD))
        payload = self._rollout_and_score(metrics, defer=defer) if samples_here else None  # stages: rollout, reward
        payload = broadcast_object(payload)
        if self._offload_plan:
            with self.telemetry.stage("actor_offload"):
                for model, _ in self._offload_plan:
                    model.onload()
            if not self._offload_checked:
                self._check_offload_needed(offloaded)
        batch = payload["batch"]
        metrics.update(payload["metrics"])
        metrics["batch/tokens"] = float(batch["attention_mask"].sum())  # prompt + response tokens of the step

        # 2. this data-parallel rank's slice (N / dp responses)
        mini_batches_per_step = self.prompts_per_step // (spec.training.ppo_mini_batch_size_per_node * spec.nnodes)
        kl_in_reward = self.use_ref and a.kl_placement == KLPlacement.REWARD
        budget = self.actor_token_budget
        order = None
        if budget and self.dp_size > 1 and not kl_in_reward:
            # token budget: ranks get rows of equal token totals (each optimizer step keeps its rows;
            # the advantages are already per row; KL in the reward computes them later by prompt group)
            order = balanced_dp_order(batch["attention_mask"].sum(-1).tolist(), self.dp_size, mini_batches_per_step)
            batch = take_rows(batch, order)
        per_rank = batch["input_ids"].shape[0] // self.dp_size
        lo = self.dp_rank * per_rank
        local = slice_batch(batch, lo, lo + per_rank)
        single_update = mini_batches_per_step == 1 and spec.training.ppo_epochs == 1 and not kl_in_reward
        lp_micro = spec.rollout.log_prob_micro_batch_size_per_gpu

        # 3. old and reference log-probs (N/dp, T), from the megatron model
        self._old_and_ref_logprobs(local, old=not single_update, micro_batch_size=lp_micro)
        if payload["deferred"]:  # join the background scoring: rank 0's advantages (N, T) go to every rank
            joined = broadcast_object(self._join_scores() if self.is_main else None)
            metrics.update(joined["metrics"])
            advantages = joined["advantages"] if order is None else joined["advantages"][order]
            local["advantages"] = advantages[lo:lo + per_rank]
        if kl_in_reward:  # the KL-shaped rewards feed the advantage estimator
            local["advantages"] = self._kl_in_reward_advantages(batch, local, lo, metrics)
        local.pop("token_rewards", None)
        local = trim_padding(local)

        # 4. actor update: ppoEpochs x mini-batches, each one optimizer step
        update_start = time.perf_counter()
        lora_before = self.actor.lora.snapshot() if self.actor.lora is not None else None
        with self.telemetry.stage("actor_update"):
            update_metrics = []
            for _ in range(spec.training.ppo_epochs):
                for mini in split_batch(local, mini_batches_per_step):
                    # the loss is normalised by the mini-batch's response tokens / sequences over all DP ranks
                    update_metrics.append(self.actor.update(
                        mini, self._loss_fn(single_update), micro_batch_size=spec.training.micro_batch_size_per_gpu,
                        with_entropy=a.entropy_coeff > 0, normalise_by="response_mask",
                        max_tokens_per_micro_batch=budget))
        for key, value in _mean_dicts(update_metrics).items():
            metrics[key if key.startswith("rollout/") else f"actor/{key}"] = value
        metrics.update(self._training_throughput(local, time.perf_counter() - update_start))
        if lora_before is not None:
            metrics.update(self.actor.lora.norms(lora_before, self.actor.tp_group, self.actor.pp_group))

        # 5. weight sync: stream HF-named tensors from megatron into the engine
        with self.telemetry.stage("weight_sync"):
            self._sync_weights()
        self._note_training_peak()
        return metrics

    def _note_training_peak(self) -> None:
        """The peak allocation of this step's stages outside the rollout (log-prob passes, updates, weight sync)."""
        if self.device.type != "cuda" or self.engine is None or self._cache_resident is not None:
            return  # nothing to decide (or decided)
        peaks = [v for k, v in self.telemetry.pending_stage_peak_bytes().items() if k not in ("rollout", "reward")]
        if peaks:
            self._training_peak_bytes = max(self._training_peak_bytes or 0, *peaks)

    def _training_throughput(self, local: dict[str, torch.Tensor], seconds: float) -> dict[str, float]:
        """Tokens/s of the actor update over all data-parallel ranks, and MFU on a GPU.

        FLOPs per token: 6 N (forward + backward of the weights) + 12 L h s (attention scores and
        values, causal, forward + backward) with s the mean sequence length."""
        tokens = float(local["attention_mask"].sum()) * self.spec.training.ppo_epochs * self.dp_size
        out = {"throughput/train_tokens_per_s": tokens / max(seconds, 1e-9)}
        if self.device.type == "cuda":
            cfg = self.actor.hf_config
            seq = float(local["attention_mask"].sum(-1).float().mean())
            flops_per_token = 6 * self._num_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
            world = dist.get_world_size() if dist.is_initialized() else 1
            peak = float(os.environ.get("RLJOB_PEAK_TFLOPS", "989")) * 1e12 * world
            out["perf/mfu"] = tokens * flops_per_token / max(seconds, 1e-9) / peak
        return out

    def _rollout_and_score(self, metrics: dict[str, float], defer: bool = False) -> dict[str, Any]:
        """Rank 0: sample n responses per prompt, score them, compute advantages (N,) and build the batch.
        With `defer` the remote scores are still coming: the batch goes without advantages and
        :meth:`_join_scores` adds them after the log-prob passes."""
        spec, n = self.spec, self.spec.rollout.samples_per_prompt
        self._step_nonfinite, self._step_scored = 0, 0  # counted by _sample_and_score, refills included
        self._step_dropped, self._step_remote = None, {}  # drop-group rows; remote counts (_collect_scores)
        self._pool_replies = []
        records, responses, rewards, rollout_s, generated = self._sample_and_score(self.prompts_per_step, defer=defer,
                                                                                   ahead=True)
        if spec.algorithm.dynamic_sampling:
            records, responses, rewards = self._dynamic_sampling(records, responses, rewards, metrics)
            rollout_s, generated = rollout_s + self._refill_seconds, generated + self._refill_tokens
        prompts = [r for r in records for _ in range(n)]
        out = RolloutOutput([r[0] for r in responses], [r[1] for r in responses], [r[2] for r in responses])
        lengths = torch.tensor([len(r) for r in out.response_ids], dtype=torch.float32)
        loss_masks = [r[3] for r in responses] if self.agent is not None else None
        batch = pad_batch([r.prompt_ids for r in prompts], out.response_ids, self.pad_id, loss_masks=loss_masks)
        # the engine's log-probs of the tokens it sampled (a tool response has none): on the loss positions
        sampled_logprobs = (out.response_logprobs if loss_masks is None else
                            [[lp for lp, m in zip(lps, mask) if m] for lps, mask in zip(out.response_logprobs, loss_masks)])
        batch["rollout_logprobs"] = scatter_response_values(sampled_logprobs, batch["response_mask"])
        if spec.algorithm.routing_replay:  # (N, T, layers, k) beside input_ids: the actor's routers replay them
            batch["routed_experts"] = routing_batch([r[4] for r in responses], [len(p.prompt_ids) for p in prompts],
                                                    max(len(p.prompt_ids) for p in prompts), batch["input_ids"].shape[1])
        metrics.update({
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": algo.response_length_clip_ratio(lengths, spec.data.max_response_length),
            "throughput/rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
            **(self._tool_metrics if self.agent is not None else {}),
            **(self._pool_metrics(len(out.response_ids)) if self.separate else {}),
        })
        sources = [r.data_source for r in prompts]
        if defer and self.is_main:
            self._deferred = (lengths, batch["response_mask"], sources)
        if not defer:
            metrics.update(self._advantages_from_rewards(batch, rewards, lengths, sources))
        return {"batch": batch, "metrics": metrics, "deferred": defer}

    def _join_scores(self) -> dict[str, Any]:
        """Rank 0, deferred scoring: wait for the scores, then {advantages (N, T), reward metrics}."""
        lengths, response_mask, sources = self._deferred
        with self.telemetry.stage("reward"):  # only the wait the log-prob passes did not hide
            rewards = self._collect_scores(self._pending_scores)
        self._pending_scores = self._deferred = None
        batch = {"response_mask": response_mask}
        metrics = self._advantages_from_rewards(batch, rewards, lengths, sources)
        return {"advantages": batch["advantages"], "metrics": metrics}

    def _advantages_from_rewards(self, batch: dict[str, torch.Tensor], rewards: torch.Tensor, lengths: torch.Tensor,
                                 sources: list[str]) -> dict[str, float]:
        """batch["scores"] and batch["advantages"] (or "token_rewards" with KL in the reward) from the (N,)
        rewards; the reward and advantage metrics. Groups with a drop-group sample get zero advantages."""
        spec, n, a = self.spec, self.spec.rollout.samples_per_prompt, self.spec.algorithm
        shaped = rewards.clone()
        ob = a.overlong_buffer
        if ob.enable:
            shaped = shaped + algo.overlong_penalty(lengths, spec.data.max_response_length, ob.length, ob.penalty_factor)
        batch["scores"] = shaped  # (N,) the shaped outcome reward of each response (PPO's critic reads them)
        dropped = self._step_dropped if self._step_dropped is not None else torch.zeros(rewards.shape, dtype=torch.bool)
        group_dropped = dropped.view(-1, n).any(-1).repeat_interleave(n)  # (N,)
        adv_metrics = {}
        if self.use_ref and a.kl_placement == KLPlacement.REWARD:
            # the outcome on each response's last token; KL joins it once the reference log-probs exist
            batch["token_rewards"] = _outcome_on_last_token(shaped, batch["response_mask"])
        else:
            advantages, adv_metrics = self._outcome_advantages(shaped, n, batch["response_mask"])
            advantages = advantages.masked_fill(group_dropped, 0.0)  # onFailure drop-group: no gradient
            batch["advantages"] = algo.broadcast_to_tokens(advantages, batch["response_mask"])
        kept = rewards[~group_dropped] if bool(group_dropped.any()) and not bool(group_dropped.all()) else rewards
        metrics = {
            "reward/mean": float(kept.mean()), "reward/std": float(kept.std(unbiased=False)),
            "reward/min": float(kept.min()), "reward/max": float(kept.max()),
            "reward/nonfinite_count": float(self._step_nonfinite), "reward/samples": float(self._step_scored),
            **{f"advantage/{k}": v for k, v in adv_metrics.items()},
            **{f"reward/remote_{k}" if k != "seconds" else "timing/reward_remote_s": float(v)
               for k, v in self._step_remote.items()},
        }
        if bool(group_dropped.any()):
            metrics["reward/dropped_groups"] = float(group_dropped.sum()) / n
        for source in sorted(set(sources)):
            rows = torch.tensor([s == source and not d for s, d in zip(sources, group_dropped.tolist())])
            if bool(rows.any()):
                metrics[f"reward/{source}/mean"] = float(rewards[rows].mean())
            metrics[f"reward/{source}/count"] = float(rows.sum())
        return metrics

    def _collect_scores(self, pending) -> torch.Tensor:
        """Rank 0: the (N,) rewards of a scoring call, NaN/Inf sanitised and counted; the drop-group rows
        in self._step_dropped; remote counts in the step's metrics and Prometheus."""
        scored = pending.result()
        rewards, bad = sanitize_rewards(torch.tensor(scored.scores, dtype=torch.float32))
        self._step_nonfinite += bad
        self._step_scored += rewards.numel()
        if bad:
            log.warning("step %d: %d of %d rewards were NaN or Inf and are scored 0; spec.reward.function %r "
                        "returns non-finite values", self.step, bad, rewards.numel(), self.spec.reward.function)
        if not self.spec.algorithm.dynamic_sampling:  # (validation refuses drop-group with dynamic sampling)
            self._step_dropped = torch.tensor(scored.dropped, dtype=torch.bool)
        for route, counts in scored.routes.items():
            if self.rewards.routes[route].remote is not None:
                self.telemetry.record_remote_reward(route, requests=counts.requests, retries=counts.retries,
                                                    failures=counts.failures, zeroed=counts.zeroed,
                                                    dropped=counts.dropped, seconds=counts.seconds)
                for key in ("requests", "retries", "failures", "zeroed", "dropped"):
                    self._step_remote[key] = self._step_remote.get(key, 0) + getattr(counts, key)
                # remote routes run side by side: the step waited for the slowest
                self._step_remote["seconds"] = max(self._step_remote.get("seconds", 0.0), counts.seconds)
                if counts.failures:
                    log.warning("step %d: %s", self.step, self.rewards.failure_report(route, counts))
        return rewards

    def _outcome_advantages(self, scores: torch.Tensor, group_size: int,
                            response_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """(N,) advantages from the (N,) shaped scores, and their metrics (GRPO / RLOO / REINFORCE++)."""
        a = self.spec.algorithm
        return algo.compute_outcome_advantages(scores, group_size, a.advantage_estimator, norm_by_std=a.norm_adv_by_std,
                                               response_lengths=response_mask.sum(-1))

    def _draw(self, num_prompts: int, step: int):
        """The next `num_prompts` prompts and the sampling settings of `step` (its seed): (records, params)."""
        spec, n = self.spec, self.spec.rollout.samples_per_prompt
        indices = [i for _ in range(num_prompts // self.prompts_per_step) for i in self.sampler.next_batch()]
        records = [self.train_set.records[i] for i in indices]
        params = SamplingParams(n=n, temperature=spec.rollout.temperature, top_p=spec.rollout.top_p,
                                top_k=spec.rollout.top_k, max_new_tokens=spec.data.max_response_length,
                                seed=spec.training.seed * 1_000_003 + step * 131 + self.sampler.position)
        return records, params

    def _sample_and_score(self, num_prompts: int, defer: bool = False, ahead: bool = False):
        """Draw `num_prompts` prompts, sample n responses each and score them (`defer`: start scoring in the
        background, rewards None; see _join_scores). `ahead`: the step's batch, which a rollout pool working
        ahead of the trainer (rollout.mode one-step, async) may have generated already.

        Returns (records (P,), responses (P*n,) of (ids, logprobs, finished), rewards (P*n,), seconds, tokens).
        """
        spec, n = self.spec, self.spec.rollout.samples_per_prompt
        if ahead and self.lookahead:
            with self.telemetry.stage("rollout"):  # only the wait for the pool: the generating happened meanwhile
                records, reply = self._batch_from_ahead()
            out, trajectories, seconds = reply.out, None, reply.seconds
            texts = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            loss_masks = [None] * len(out.response_ids)
        else:
            records, params = self._draw(num_prompts, self.step)
            with self.telemetry.stage("rollout"):
                start = time.perf_counter()
                out, texts, trajectories, loss_masks = self._rollout(records, params)
                seconds = time.perf_counter() - start
        prompts = [r for r in records for _ in range(n)]
        extras = [{**r.extra, "max_response_length": spec.data.max_response_length, "data_source": r.data_source}
                  for r in prompts]
        if trajectories is not None:  # the reward sees the whole trajectory; `completion` is the last turn's text
            for extra, trajectory in zip(extras, trajectories):
                extra["trajectory"] = trajectory
        rewards = None
        if self.is_main:  # rank 0 scores; with vLLM on every rank its scores are shared so all ranks agree
            with self.telemetry.stage("reward"):  # local routes score here; remote ones too unless deferred
                pending = self.rewards.submit([r.prompt_text for r in prompts], texts, [r.ground_truth for r in prompts],
                                              [r.data_source for r in prompts], extras,
                                              timeout_s=spec.reward.timeout_seconds, background=defer)
                if defer:
                    self._pending_scores = pending
                else:  # NaN/Inf would poison every advantage of the batch: sanitised and counted
                    rewards = self._collect_scores(pending)
        if self.engine_everywhere:
            rewards = broadcast_object(rewards)
        routed = out.routed_experts or [None] * len(out.response_ids)  # algorithm.routingReplay
        responses = list(zip(out.response_ids, out.response_logprobs, out.finished, loss_masks, routed))
        generated = sum(sum(m) for m in loss_masks) if self.agent is not None else sum(len(r) for r in out.response_ids)
        return records, responses, rewards, seconds, float(generated)

    def _rollout(self, records, params: SamplingParams, release: bool = True):
        """Sample params.n responses per record: one turn, or the agent loop (spec.rollout.agent). ``release``:
        free the engine's memory afterwards.

        Returns (RolloutOutput (N,), final texts (N,), trajectories as dicts or None, loss masks (N,) or [None]s).
        """
        if self.agent is None:
            out = self._generate([r.prompt_ids for r in records], params, release=release)
            texts = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            return out, texts, None, [None] * len(out.response_ids)
        from rljob_worker.rollout.agent_loop import agent_output, merge_loop_results, run_agent_loop

        a = self.agent
        contexts = [{"prompt": r.prompt_text, "ground_truth": r.ground_truth, "extra": r.extra} for r in records]
        prompt_ids = [r.prompt_ids for r in records]
        loop = {"parser": a.parser, "renderer": a.renderer, "call_end_id": a.call_end_id, "eos_id": self.eos_id,
                "config": a.config, "decode": lambda ids, skip: self.tokenizer.decode(ids, skip_special_tokens=skip)}
        try:
            if self._agent_per_share():  # each rank runs the loop over its share, its own tools, then all gather
                rank, world = dist.get_rank(), dist.get_world_size()
                share = prompt_shares(len(records), world)[rank]
                mine = ([], {"outcomes": collections.Counter()})
                if share.stop > share.start:
                    mine = run_agent_loop(
                        self.engine.generate, prompt_ids[share],
                        dataclasses.replace(params, seed=replica_seed(params.seed, share, params.n)),
                        tools=a.tools.box, contexts=contexts[share], open_stream=self._row_streams(), **loop)
                parts: list[Any] = [None] * world
                dist.all_gather_object(parts, mine)
                trajs, tool_metrics = merge_loop_results(parts)
            else:
                trajs, tool_metrics = run_agent_loop(
                    lambda ids, p: self._generate(ids, p, release=False), prompt_ids, params, tools=a.tools,
                    contexts=contexts, open_stream=self._row_streams(), **loop)
        finally:
            if release:
                self._release_engine()
        outcomes = tool_metrics.pop("outcomes")
        if self.is_main:
            self.telemetry.record_tool_calls(outcomes)
        self._tool_metrics = tool_metrics
        return (agent_output(trajs), [t.final_text for t in trajs], [t.as_dict() for t in trajs],
                [t.loss_mask for t in trajs])

    def _agent_per_share(self) -> bool:
        """Whether the agent loop runs on every rank over its share of the prompts: hf engines on every rank of a
        world of several (vLLM's replicas span ranks, so its loop stays turn-batched over the whole batch)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return self.engine_everywhere and not self.engine_is_vllm and self.rollout_pool is None and world > 1

    def _row_streams(self):
        """The static engine's continuous rows for the agent loop where this process runs the loop over what its
        engine samples (one process, rank 0, or its share on every rank), else None (turn-batched;
        RLJOB_AGENT_STREAM=0 forces that)."""
        from rljob_worker.rollout.hf_static_engine import HFStaticEngine
        from rljob_worker.rollout.static_stream import RowStreams

        if (os.environ.get("RLJOB_AGENT_STREAM", "1") == "0" or self.rollout_pool is not None
                or not isinstance(self.engine, HFStaticEngine)):
            return None
        return RowStreams(self.engine)

    # ------------------------------------------------------------------ a separate rollout pool
    def _policy_version(self) -> int:
        """The version of the weights this step trains: the number of optimizer steps behind them."""
        return self.step - 1

    def _ask_pool(self, prompt_ids: list[list[int]], params: SamplingParams):
        """Generate now, with the current policy (sync mode, validation, refills and agent turns)."""
        rid = self.rollout_pool.submit(prompt_ids, params, min_version=self._policy_version())
        start = time.perf_counter()
        reply = self.rollout_pool.result(rid)
        self._pool_replies.append((reply, time.perf_counter() - start, len(reply.out.response_ids)))
        return reply

    def _request_ahead(self, step: int) -> _Ahead:
        """Send the batch of `step` to the rollout pool, drawn as that step would draw it."""
        before = self.sampler.state_dict()
        records, params = self._draw(self.prompts_per_step, step)
        rid = self.rollout_pool.submit([r.prompt_ids for r in records], params, min_version=self._policy_version())
        return _Ahead(rid, records, params, before)

    def _batch_from_ahead(self):
        """This step's batch from the rollout pool, then the requests topped up to rollout.mode's lookahead (never
        past the last step). A batch more versions behind than allowed is dropped, counted and generated again.
        Returns (records, reply)."""
        if not self._ahead:  # the first step, or after a resume: nothing was generated ahead
            self._ahead.append(self._request_ahead(self.step))
        request = self._ahead.popleft()
        start = time.perf_counter()
        reply = self.rollout_pool.result(request.rid)
        waited = time.perf_counter() - start
        self._dropped_stale = 0
        if self._policy_version() - reply.version > self.lookahead:
            self._dropped_stale = len(reply.out.response_ids)
            log.warning("step %d: dropped a batch of policy version %d (%d behind, rollout.maxStaleness %d)",
                        self.step, reply.version, self._policy_version() - reply.version, self.lookahead)
            self._pool_replies.append((reply, waited, 0))
            reply = self._ask_pool([r.prompt_ids for r in request.records], request.params)
        else:
            self._pool_replies.append((reply, waited, len(reply.out.response_ids)))
        while len(self._ahead) < self.lookahead and self.step + len(self._ahead) < self.total_steps:
            self._ahead.append(self._request_ahead(self.step + 1 + len(self._ahead)))
        return request.records, reply

    def _pool_metrics(self, samples: int) -> dict[str, float]:
        """Staleness of every sample in the batch (policy versions behind the trainer), from the pool's replies."""
        staleness = [self._policy_version() - version for reply, _, rows in self._pool_replies
                     for version in reply.sample_versions()[:rows]]
        staleness = staleness[-samples:]  # dynamic sampling keeps a subset; the newest replies bound it
        out = {"rollout/staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
               "rollout/staleness_max": float(max(staleness, default=0)),
               "rollout/policy_version": float(self._policy_version()),
               "rollout/buffer_depth": float(len(self._ahead)),
               "rollout/dropped_stale_samples": float(self._dropped_stale),
               "timing/trainer_idle_s": sum(waited for _, waited, _ in self._pool_replies),
               "timing/rollout_idle_s": sum(reply.idle_s for reply, _, _ in self._pool_replies)}
        if any(reply.verified for reply, _, _ in self._pool_replies):
            out["rollout/weights_verified"] = 1.0
        if self.spec.rollout.partial:  # responses whose tokens came from more than one version
            spans = [len(set(v)) > 1 for reply, _, rows in self._pool_replies if reply.token_versions
                     for v in reply.token_versions[:rows]]
            out["rollout/partial_resumed_frac"] = float(np.mean(spans)) if spans else 0.0
        return out

    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams, release: bool = True) -> RolloutOutput:
        """Sample with the engine. On every rank: each replica samples its share of whole prompts (seeds
        offset per share), then the shares are gathered in prompt order. ``release``: free the engine's memory
        afterwards (the agent loop keeps it between turns and releases it once). A separate rollout pool
        samples for the actor leader."""
        if self.rollout_pool is not None:
            return self._ask_pool(prompt_ids, params).out
        if self.engine_is_vllm and self.engine.state != "awake":
            self.engine.wake_up()
        if not self.engine_everywhere:
            out = self.engine.generate(prompt_ids, params)
        elif not self.engine_is_vllm:  # hf on every rank: one replica per rank, whole groups each
            out = sample_share_and_gather(self.engine, prompt_ids, params, rank=dist.get_rank(),
                                          world_size=dist.get_world_size())
        else:
            layout = self.rollout_layout
            rank = dist.get_rank()
            part = layout.prompt_slice(len(prompt_ids), layout.replica_of(rank))
            seed = None if params.seed is None else params.seed + part.start * params.n
            mine = self.engine.generate(prompt_ids[part], dataclasses.replace(params, seed=seed))
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine if layout.rollout_rank_of(rank) == 0 else None)
            out = RolloutOutput([], [], [])
            for piece in (g for g in gathered if g is not None):  # replica order = prompt order
                out.extend(piece)
        if release:
            self._release_engine()
        return out

    def _release_engine(self) -> None:
        if not self.spec.rollout.free_cache_engine or self.engine is None:
            return
        if self.engine_is_vllm:
            self.engine.sleep()  # the actor gets the GPU back until the next weight sync
            return
        if self._cache_resident:
            return  # measured to fit beside training (_decide_cache_residency)
        deciding = self._cache_resident is None and self._training_peak_bytes is not None  # measured on a GPU only
        reserved = torch.cuda.memory_reserved(self.device) if deciding else 0
        self.engine.release_cache()  # the KV cache (and the static engine's graphs) go; the weights stay
        if deciding:
            self._decide_cache_residency(reserved - torch.cuda.memory_reserved(self.device))

    def _decide_cache_residency(self, cache_bytes: int) -> None:
        """Once, at the first release after a measured step: keep the static engine's KV cache and CUDA graphs from
        the next rollout on when they fit beside training's measured peak (rollout/cache_residency.py)."""
        from rljob_worker.rollout.cache_residency import KEEP_HEADROOM, keep_cache_resident
        from rljob_worker.rollout.hf_static_engine import HFStaticEngine

        total = torch.cuda.get_device_properties(self.device).total_memory
        self._cache_resident = (isinstance(self.engine, HFStaticEngine) and not self._offload_plan
                                and keep_cache_resident(total, self._training_peak_bytes, cache_bytes))
        if self._cache_resident and self.is_main:  # on the progress output, like the offload decision
            print(f"rollout: the static engine keeps its KV cache and CUDA graphs between steps from step "
                  f"{self.step + 1}: training peaked at {self._training_peak_bytes / 2**30:.1f} GiB and the cache "
                  f"holds {cache_bytes / 2**30:.1f} GiB, together below {100 * (1 - KEEP_HEADROOM):.0f}% of the "
                  f"GPU's {total / 2**30:.1f} GiB (RLJOB_ROLLOUT_CACHE=release frees it every step)", flush=True)

    def _dynamic_sampling(self, records, responses, rewards, metrics):
        """DAPO: keep prompt groups whose rewards differ (the others carry no gradient) and refill
        from the next prompts, at most algorithm.maxRefillBatches extra batches. If still short, the
        batch is completed with zero-variance groups (zero advantage: no gradient) to keep its shape."""
        n, want = self.spec.rollout.samples_per_prompt, self.prompts_per_step
        kept_groups, spare_groups = [], []
        self._refill_seconds, self._refill_tokens, refills = 0.0, 0.0, 0

        def split(records, responses, rewards):
            keep = algo.nonzero_variance_groups(rewards, n).tolist()
            for g, ok in enumerate(keep):
                group = (records[g], responses[g * n:(g + 1) * n], rewards[g * n:(g + 1) * n])
                (kept_groups if ok else spare_groups).append(group)

        split(records, responses, rewards)
        first_kept = len(kept_groups)
        while len(kept_groups) < want and refills < self.spec.algorithm.max_refill_batches:
            refills += 1
            more = self._sample_and_score(self.prompts_per_step)
            self._refill_seconds += more[3]
            self._refill_tokens += more[4]
            split(*more[:3])
        groups = (kept_groups + spare_groups)[:want]
        metrics["dynamic_sampling/kept_group_fraction"] = first_kept / want
        metrics["dynamic_sampling/refills"] = float(refills)
        return ([g[0] for g in groups], [resp for g in groups for resp in g[1]],
                torch.cat([g[2] for g in groups]))

    def _loss_fn(self, single_update: bool):
        config, correction = self.loss_config, self.spec.algorithm.rollout_correction
        truncate = token_truncation_in_effect(self.spec)  # on by default when the samples may be off-policy
        correct = truncate or correction.sequence_masking

        def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: dict[str, torch.Tensor],
                    num_tokens: float | None = None, num_sequences: float | None = None):
            old = logprobs.detach() if single_update else micro["old_logprobs"]
            mask = micro["response_mask"].bool()
            # pi_train / pi_rollout: the trainer's log-probs of the sampling policy against the engine's own
            weights, correction_metrics = algo.rollout_correction_weights(
                old, micro["rollout_logprobs"], mask, threshold=correction.threshold,
                token_truncation=truncate, sequence_masking=correction.sequence_masking,
                mask_threshold=correction.sequence_masking_threshold)
            loss, metrics = algo.grpo_loss(logprobs, old, micro["advantages"], mask, config,
                                           ref_logprobs=micro.get("ref_logprobs"), entropy=entropy,
                                           token_weights=weights if correct else None,
                                           num_tokens=num_tokens, num_sequences=num_sequences)
            # How far the engine's sampling log-probs are from the trainer's (kernel/numerics drift).
            gap = (old - micro["rollout_logprobs"]).abs()[mask]
            if gap.numel():
                metrics["rollout/logprob_mismatch_mean"] = float(gap.mean())
                metrics["rollout/logprob_mismatch_frac"] = float((gap > 0.1).float().mean())
            metrics.update({f"rollout/correction_{k}": v for k, v in correction_metrics.items()})
            return loss, metrics

        return loss_fn

    def _old_and_ref_logprobs(self, local: dict, *, old: bool, micro_batch_size: int) -> None:
        """local["old_logprobs"] (when the batch gets more than one update) and local["ref_logprobs"] (with a
        reference model), (N/dp, T) each, from the megatron models."""
        if old:
            with self.telemetry.stage("old_logprob"):
                local["old_logprobs"] = self.actor.compute_logprobs(local, micro_batch_size=micro_batch_size)["logprobs"]
        if self.use_ref:
            with self.telemetry.stage("ref_logprob"):
                local["ref_logprobs"] = self._reference_logprobs(local, micro_batch_size)

    def _partial_weight_sync(self) -> bool:
        """LoRA: only the adapted weights (merged) travel after the engine has the base model, unless the
        engine drops its weights when asleep (vLLM sleep level 2). The same on every rank (rank 0 decides:
        it always has an engine)."""
        if self.actor.lora is None:
            return False
        if self._partial_sync is None:
            self._partial_sync = bool(broadcast_object(getattr(self.engine, "sleep_level", 1) == 1))
        return self._partial_sync

    def _reference_logprobs(self, local: dict, micro_batch_size: int) -> torch.Tensor:
        if self.ref is not None:
            return self.ref.compute_logprobs(local, micro_batch_size=micro_batch_size)["logprobs"]
        with self.actor.lora.disabled():  # LoRA: the base model is the reference
            return self.actor.compute_logprobs(local, micro_batch_size=micro_batch_size)["logprobs"]

    def _kl_in_reward_advantages(self, batch: dict[str, torch.Tensor], local: dict[str, torch.Tensor], lo: int,
                                 metrics: dict[str, float]) -> torch.Tensor:
        """KL in the reward, before the estimator: token rewards - coef x KL(rollout policy || ref), with
        the KL of every data-parallel rank's rows gathered, so each rank computes the advantages of
        the whole batch (groups may span ranks) and keeps its rows. Returns (N/dp, T)."""
        a, n = self.spec.algorithm, self.spec.rollout.samples_per_prompt
        kl = algo.kl_penalty(local["old_logprobs"], local["ref_logprobs"], a.kl_estimator)  # (N/dp, T)
        kl = all_gather_rows(kl.float(), self.actor.dp_group, self.device)  # (N, T)
        token_rewards = algo.apply_kl_to_rewards(batch["token_rewards"], kl, a.kl_coef, batch["response_mask"])
        advantages, adv_metrics = algo.compute_token_reward_advantages(
            token_rewards, batch["response_mask"], n, a.advantage_estimator, norm_by_std=a.norm_adv_by_std)
        seq_kl = algo.masked_zero(kl, batch["response_mask"]).sum(-1)
        metrics.update({f"advantage/{k}": v for k, v in adv_metrics.items()})
        metrics["reward/kl_penalty_mean"] = float(a.kl_coef * seq_kl.mean())
        return advantages[lo:lo + local["input_ids"].shape[0]]

    def _sync_weights(self) -> None:
        partial = self._partial_weight_sync()
        stream = self.actor.export_hf_weights(only_changed=partial)  # collective: every rank iterates
        if self.rollout_pool is not None:  # the weights after step `step` are policy version `step`
            self.rollout_pool.push(stream, version=self.step, partial=partial)
            return
        if self.engine is None:
            for _ in stream:
                pass
            return
        if self.engine_is_vllm:  # weights back first, refill them, then the KV cache
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.engine.wake_up(tags=["weights"])
            self.engine.update_weights(stream, partial=partial)
            self.engine.wake_up(tags=["kv_cache"])
        else:
            self.engine.update_weights(stream, partial=partial)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        with self.telemetry.stage("validation"):
            result = self._validate_main() if (self.is_main or self.engine_everywhere) else None
        result = broadcast_object(result)
        self.telemetry.record_validation(self.step, result)
        if self.is_main:
            n = self.spec.rollout.val_n
            log.info("validation at step %d: reward %.3f accuracy %.3f pass@%d %.3f", self.step,
                     result["val/reward_mean"], result["val/accuracy"], n, result[f"val/pass@{n}"])
        self.last_validation = result
        return result

    def validate_for_log(self) -> dict[str, float]:
        self.validate()  # recorded in telemetry and the RLJob status, not in the step's metrics line
        return {}

    def _validate_main(self) -> dict[str, float]:
        spec, records = self.spec, self.val_set.records
        params = SamplingParams(n=spec.rollout.val_n, temperature=spec.rollout.val_temperature,
                                top_p=spec.rollout.top_p, max_new_tokens=spec.data.max_response_length, seed=12345)
        # vLLM stays awake: the next rollout wants it so, and a level-2 sleep would drop weights that no sync refills
        # before that rollout (the step's sync comes after its update)
        _, texts, trajectories, _ = self._rollout(records, params, release=not self.engine_is_vllm)
        if not self.is_main:
            return None
        prompts = [r for r in records for _ in range(spec.rollout.val_n)]
        extras = [{**r.extra, "max_response_length": spec.data.max_response_length, "data_source": r.data_source}
                  for r in prompts]
        for extra, trajectory in zip(extras, trajectories or []):
            extra["trajectory"] = trajectory
        # a remote sample that failed every retry counts as 0 here (onFailure fail still stops the run)
        scored = self.rewards.score([r.prompt_text for r in prompts], texts, [r.ground_truth for r in prompts],
                                    [r.data_source for r in prompts], extras, timeout_s=spec.reward.timeout_seconds)
        for route, counts in scored.routes.items():
            if counts.failures:
                log.warning("validation at step %d: %s", self.step,
                            self.rewards.failure_report(route, counts, validation=True))
        scores = sanitize_rewards(torch.tensor(scored.scores, dtype=torch.float32))[0].tolist()
        self._validation_rows = [[r.prompt_text, text, str(r.ground_truth), float(score)] for r, text, score in
                                 zip(prompts[:VALIDATION_TABLE_ROWS], texts, scores)]
        return algo.sample_metrics(scores, spec.rollout.val_n, [r.data_source for r in records])

    # ------------------------------------------------------------------ the loop's hooks
    def validation_table(self) -> tuple[list[str], list[list]] | None:
        rows = getattr(self, "_validation_rows", None)
        return (["prompt", "response", "ground_truth", "reward"], rows) if rows else None

    def after_resume(self) -> None:
        self._sync_weights()  # the rollout engine samples from the resumed policy

    def trainer_state(self) -> dict[str, Any]:
        """Batches generated ahead are not saved: a resume draws their prompts again (from the sampler's state
        before the oldest of them) and generates them with the resumed policy."""
        state = super().trainer_state()
        if self._ahead:
            state["sampler"] = self._ahead[0].sampler_before
        return state

    def progress_line(self, metrics: dict[str, float], eta_s: float) -> str:
        return (f"step {self.step}/{self.total_steps} | reward {metrics.get('reward/mean', float('nan')):.3f} | "
                f"resp_len {metrics.get('response_length/mean', 0):.1f} | kl {metrics.get('actor/kl', 0.0):.4f} | "
                f"grad_norm {metrics.get('actor/grad_norm', 0.0):.3f} | {metrics['timing/step_s']:.2f}s | "
                f"ETA {eta_s:.0f}s")

    def progress_postfix(self, metrics: dict[str, float]) -> str:
        return f"reward {metrics.get('reward/mean', 0):.3f}"

    def status_values(self, metrics: dict[str, float]) -> dict[str, float | None]:
        last = getattr(self, "last_validation", None) or {}
        return {"reward_mean": metrics.get("reward/mean"), "val_reward_mean": last.get("val/reward_mean"),
                "val_pass_at_k": {k[4:]: v for k, v in last.items() if k.startswith(("val/pass@", "val/mean@"))}
                or None}

    def summary_line(self) -> str | None:
        first = [r.metrics["reward/mean"] for r in self.history[:5]]
        last = [r.metrics["reward/mean"] for r in self.history[-5:]]
        if not (first and last):
            return None
        return f"done: {self.step} steps, reward {np.mean(first):.3f} (first 5) -> {np.mean(last):.3f} (last 5)"

    def close(self) -> None:
        if self.rollout_pool is not None:  # batches still being generated are awaited, then the pool stops
            self.rollout_pool.stop()
        agent = getattr(self, "agent", None)
        if agent is not None:
            agent.tools.box.close()
        rewards = getattr(self, "rewards", None)
        if rewards is not None:
            rewards.close()  # remote scoring threads
        pool = getattr(self, "reward_pool", None)
        if pool is not None:
            # A reward that hung past its timeout would keep the process alive: stop the workers.
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)
        super().close()


@dataclasses.dataclass
class _Ahead:
    """A batch sent to the rollout pool ahead of its step: request id, prompts, sampling settings, and the
    sampler's state before they were drawn (what a checkpoint saved now resumes from)."""

    rid: int
    records: list
    params: SamplingParams
    sampler_before: dict[str, int]


@dataclasses.dataclass
class _Agent:
    """What the agent loop needs from the spec and the tokenizer, built once (start-up errors surface early)."""

    config: Any
    parser: Any
    tools: Any
    renderer: Any
    call_end_id: int


def _build_agent(spec, tokenizer) -> _Agent:
    from rljob_worker.rollout.agent_loop import AgentConfig, ToolResponseRenderer
    from rljob_worker.rollout.tool_parser import make_parser
    from rljob_worker.rollout.tools import ToolBox, ToolConfig

    a = spec.rollout.agent
    parser = make_parser(a.tool_call_format.value, [t.name for t in spec.tools])
    end = tokenizer(parser.end_marker, add_special_tokens=False)["input_ids"]
    if len(end) != 1:
        raise StartupError(f"spec.rollout.agent.toolCallFormat {a.tool_call_format.value}: {parser.end_marker!r} is "
                           f"{len(end)} tokens in this tokenizer; the engines stop a turn on one token, so pick a "
                           "tokenizer that has it as one (Qwen2.5 / Qwen3 do; builtin://tiny-qwen2-tools)")

    def truncate(text: str, max_tokens: int) -> str:
        # a token holds at least one UTF-8 byte (byte-level BPE, SentencePiece with byte fallback, characters), plus
        # at most one standalone word-start marker: text that short fits without tokenizing it (most outputs)
        if len(text.encode("utf-8")) + 1 <= max_tokens:
            return text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_tokens:
            return text
        return tokenizer.decode(ids[:max_tokens]) + f"\n[output cut at {max_tokens} tokens]"

    tools = [ToolConfig(name=t.name, function=t.function, builtin=t.builtin, timeout_seconds=t.timeout_seconds,
                        max_output_tokens=t.max_output_tokens, memory_mb=t.memory_mb) for t in spec.tools]
    try:
        box = ToolBox(tools, truncate=truncate)
    except ValueError as exc:  # a spec.tools[i].function that does not import: one line, as the reward's
        raise StartupError(str(exc)) from None
    return _Agent(AgentConfig(max_turns=a.max_turns, max_tool_calls_per_turn=a.max_tool_calls_per_turn,
                              max_response_length=spec.data.max_response_length),
                  parser, _SharedToolBox(box), ToolResponseRenderer(tokenizer), end[0])


class _SharedToolBox:
    """Rank 0 runs the tools and every sampling rank gets its results, so ranks that sample shares of the batch
    (spec.rollout.ranks every-rank, vLLM) continue the same trajectories and no tool call runs twice."""

    def __init__(self, box):
        self.box = box
        self.shared = False  # set once the trainer knows whether every rank samples

    def call_all(self, calls):
        if not self.shared:
            return self.box.call_all(calls)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        return broadcast_object(self.box.call_all(calls) if rank0 else None)


def _reward_pool(num_workers: int):
    """Processes that score rewards (reward.numWorkers > 0): slow or hanging reward code then times out
    instead of stalling the step. Spawned, so they never inherit the trainer's threads or CUDA state."""
    if num_workers <= 0:
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from rljob_worker.runtime.process_guard import ignore_stop_signals

    # The workers ignore the SIGTERM torchrun sends the trainer's process group: the step that is
    # finishing before the preemption save still needs its rewards.
    return ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=ignore_stop_signals)


def _outcome_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(N,) sequence scores -> (N, T) token rewards: each score on its response's last token, 0 elsewhere."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    cols = torch.arange(response_mask.shape[1])
    last = torch.where(response_mask.bool(), cols, -1).amax(dim=-1)  # (N,), -1 for an empty response
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] = scores[rows].float()
    return out


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: float(np.mean([d[k] for d in dicts if k in d])) for k in keys}
