"""PPO with a megatron-core critic: rollout -> reward -> values -> GAE -> critic update -> actor update.

The GRPO trainer (:mod:`rljob_worker.trainers.grpo`) with a value model (``spec.critic``,
``algorithm.advantageEstimator: gae``). One step, on every rank (batch tensors (n, T), n = this
data-parallel rank's responses, T = prompt + response columns)::

    rollout + reward on rank 0 (as GRPO; scores (N,) instead of group advantages), batch to all ranks
    old / reference log-probs (n, T)           when the ratio or a KL-in-reward needs them
    values (n, T) = critic(batch)              the value of the state before each token
    token rewards (n, T) = score on the last response token - klCoef x KL per token (klPlacement reward)
    advantages, returns (n, T) = GAE(gamma, lambda); advantages whitened over each mini-batch's (or with
                                 algorithm.whitenScope batch, the whole batch's) response tokens, across
                                 the data-parallel ranks
    critic update: critic.ppoEpochs x mini-batches, clipped value loss aggregated like the policy loss
    actor update (after critic.warmupSteps steps): the GRPO loss with the GAE advantages, weight sync

Placement: ``shared`` runs both models on every rank, taking turns (with offload flags set, the idle
model's memory goes to CPU while the other runs). At the actor's parallel layout both live in one process;
a critic with a megatron layout of its own (megatron's parallel state is one per process) runs in a second
process per GPU, a pool as split placement's below, and the pools take turns on the shared GPUs (values
before the actor's log-probs, the critic update before the actor's). ``split`` runs the critic on its own ranks
(critic.gpus of every node, :mod:`rljob_worker.runtime.pools`), each pool its own torch.distributed world, so
the critic's megatron sizes may differ from the actor's. The actor pool runs the step above; the critic
pool (:mod:`rljob_worker.trainers.critic_pool`) computes the values while the actor computes its log-probs, and
its update runs at the same time as the actor update and weight sync; GAE, token rewards and whitening
stay on the actor side, so the trajectory is the shared one's. The critic's metrics of a step reach
the actor leader at the end of that step. Validation refuses the critic's offload flags there (its GPUs
hold nothing else).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from rljob_api.enums import KLPlacement

from rljob_worker import algorithms as algo
from rljob_worker.algorithms import gae
from rljob_worker.data.batching import slice_batch, split_batch, trim_padding
from rljob_worker.run_loop import Preempted
from rljob_worker.runtime.distributed import all_gather_rows, broadcast_object
from rljob_worker.startup_errors import StartupError
from rljob_worker.trainers.critic_step import update_critic
from rljob_worker.trainers.grpo import GRPOTrainer, _mean_dicts

log = logging.getLogger("rljob.ppo")


def check_critic_vocabulary(critic_vocab: int, actor_vocab: int, tokenizer_len: int, critic_path: str) -> None:
    """The critic reads the actor's token ids, which both the actor's model and its tokenizer produce: a critic
    model with fewer embeddings than either (a model of another family) failed its first forward pass with an
    IndexError. (A smaller model of the actor's family may have fewer padding rows than the actor, and passes.)
    StartupError naming spec.critic.model.path."""
    needed = min(actor_vocab, tokenizer_len)
    if critic_vocab < needed:
        raise StartupError(
            f"spec.critic.model.path {critic_path}: its vocabulary has {critic_vocab} entries and the actor's token "
            f"ids reach {needed - 1}; the critic reads the actor's token ids, so it needs the actor's tokenizer: "
            "use a critic of spec.model.path's model family, or unset critic.model.path to start it from the actor")


class PPOTrainer(GRPOTrainer):
    """GRPO's trainer plus a critic; see the module docstring. ``pools``: split placement's process groups
    (:func:`rljob_worker.runtime.pools.init_pools`), set up before; this trainer is then the actor pool's."""

    progress_name = "ppo"

    def __init__(self, spec, ctx, env=None, pools=None):
        super().__init__(spec, ctx, env=env, pools=pools)
        # the critic in its own process pool (split, or shared taking turns)
        self.split = pools is not None and pools.cross is not None
        self._critic_wait = 0.0

    # ------------------------------------------------------------------ set-up
    def build_model(self) -> None:
        spec = self.spec
        from rljob_worker.trainers.critic_step import build_critic

        c = spec.critic
        critic_dir = self.model_dir
        if c.model.path and c.model.path != spec.model.path:
            from rljob_worker.data.model_source import resolve_model_dir

            critic_dir = resolve_model_dir(spec.model_copy(update={"model": spec.model.model_copy(
                update={"path": c.model.path})}), self.ctx.workdir / "critic-model", local_rank=self.env.local_rank)
            from rljob_worker.megatron.hf_weights import load_hf_config

            check_critic_vocabulary(load_hf_config(critic_dir).vocab_size, load_hf_config(self.model_dir).vocab_size,
                                    len(self.tokenizer), c.model.path)
        if self.split:  # the critic pool builds its critic while this pool builds the actor
            from rljob_worker.trainers.critic_pool import CriticPoolClient

            self.critic = CriticPoolClient(self.pools, make_room=self._on_gpu)
            self.critic.request_build(critic_dir)
            if self.critic.takes_turns:  # one build at a time on the shared GPUs (the critic then offloads)
                self.critic.wait_built()
            super().build_model()
            if not self.critic.takes_turns:
                self.critic.wait_built()
            return
        # The critic first: a MoE model sizes megatron's aux-loss tracker by the last model built (the actor).
        self.critic = build_critic(spec, critic_dir, self.dtype)
        super().build_model()
        cm = c.megatron
        flags = {"params": cm.param_offload, "grads": cm.grad_offload, "optimizer": cm.optimizer_offload}
        if any(flags.values()) and not self.separate:  # (no rollout on these GPUs with a rollout pool)
            self._offload_plan.append((self.critic, flags))

    def export_final_models(self) -> None:
        super().export_final_models()
        if self.spec.checkpoint.export_critic:
            self._on_gpu(self.critic)
            self.checkpoints.export_critic(self.critic, self.tokenizer)

    def checkpoint_models(self) -> dict[str, Any]:
        return {"critic": self.critic}

    def save_checkpoint(self, metrics: dict[str, float]) -> None:
        self._on_gpu(self.actor, self.ref, self.critic)  # a model's state is saved from where it trains
        super().save_checkpoint(metrics)

    def fit(self):
        """Split placement: the critic pool stops when this pool does (finished or preempted, after the save)."""
        if not self.split:
            return super().fit()
        try:
            history = super().fit()
        except Preempted:
            self.critic.stop()
            raise
        self.critic.stop()
        return history

    def _outcome_advantages(self, scores: torch.Tensor, group_size: int, response_mask: torch.Tensor):
        """PPO's advantages come from the critic later in the step: none here (the scores travel)."""
        return torch.zeros_like(scores), {}

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, float]:
        spec, a, c = self.spec, self.spec.algorithm, self.spec.critic
        metrics: dict[str, float] = {}

        # 1. rollout + reward on rank 0 (every model offloaded when its flags say so), batch to all ranks
        self._on_gpu()
        samples_here = self.is_main or self.engine_everywhere
        payload = self._rollout_and_score(metrics) if samples_here else None  # stages: rollout, reward
        payload = broadcast_object(payload)
        batch = payload["batch"]
        metrics.update(payload["metrics"])
        metrics["batch/tokens"] = float(batch["attention_mask"].sum())  # prompt + response tokens of the step
        remote_values = None
        if self.split:  # the critic pool computes the values while this pool computes its log-probs ...
            self.critic.request_values(batch)
            if self.critic.takes_turns:  # ... or first, when the two pools share the GPUs
                remote_values = self._wait_for_critic(self.critic.values, since=self.critic.sent_at)

        # 2. this data-parallel rank's rows (shared: the critic shares the actor's layout): (n, T)
        per_rank = batch["input_ids"].shape[0] // self.dp_size
        lo = self.dp_rank * per_rank
        local = slice_batch(batch, lo, lo + per_rank)
        local.pop("token_rewards", None)  # GRPO's KL-in-reward input; PPO builds its token rewards below
        mini_batches_per_step = self.prompts_per_step // (spec.training.ppo_mini_batch_size_per_node * spec.nnodes)
        kl_in_reward = self.use_ref and a.kl_placement == KLPlacement.REWARD
        single_update = mini_batches_per_step == 1 and spec.training.ppo_epochs == 1 and not kl_in_reward
        lp_micro = spec.rollout.log_prob_micro_batch_size_per_gpu

        # 3. old and reference log-probs (n, T)
        if not single_update or self.use_ref:
            self._on_gpu(self.actor, self.ref)
        self._old_and_ref_logprobs(local, old=not single_update, micro_batch_size=lp_micro)

        # 4. values, token rewards, GAE, whitened advantages (n, T)
        if self.split:
            values, seconds = (remote_values if remote_values is not None
                               else self._wait_for_critic(self.critic.values))  # (N, T)
            local["old_values"] = values[lo:lo + per_rank]
            self.telemetry.record_stage("critic_values", seconds)
        else:
            self._on_gpu(self.critic)
            with self.telemetry.stage("critic_values"):
                local["old_values"] = self.critic.compute_values(local, micro_batch_size=c.micro_batch_size_per_gpu)
        mask = local["response_mask"]
        kl = algo.kl_penalty(local["old_logprobs"], local["ref_logprobs"], a.kl_estimator) if kl_in_reward else None
        rewards = gae.token_level_rewards(local["scores"], mask, kl, a.kl_coef)
        if kl is not None:  # what the KL took off each response's reward, mean over the batch
            penalty = (a.kl_coef * algo.masked_zero(kl, mask)).sum(-1)  # (n,)
            totals = self._dp_sum(torch.stack([penalty.sum().double(), torch.tensor(float(len(penalty)))]))
            metrics["reward/kl_penalty_mean"] = float(totals[0] / totals[1].clamp(min=1))
        advantages, local["returns"] = gae.compute_gae(rewards, local["old_values"], mask, a.gamma, a.gae_lambda)
        critic_metrics = None
        if self.split:  # the critic pool trains on the returns of every row, while this pool updates the actor
            self.critic.request_update(all_gather_rows(local["returns"], self.actor.dp_group, self.device),
                                       mini_batches_per_step)
            if self.critic.takes_turns:  # (or first, when the two pools share the GPUs)
                critic_metrics = self._wait_for_critic(self.critic.update_metrics, since=self.critic.sent_at)
        # whitened over the batch's or each mini-batch's response tokens (algorithm.whitenScope) on all DP ranks
        advantages = gae.whiten_advantages(advantages, mask, a.whiten_scope, mini_batches_per_step, self._dp_sum)
        minis = split_batch({**local, "advantages": advantages}, mini_batches_per_step)
        minis = [trim_padding(mini) for mini in minis]
        ev = gae.explained_variance_from_moments(
            self._dp_sum(gae.explained_variance_moments(local["old_values"], local["returns"], mask)))
        metrics.update({"critic/explained_variance": ev,
                        "critic/returns_mean": float(algo.masked_mean(local["returns"], mask)),
                        "critic/values_mean": float(algo.masked_mean(local["old_values"], mask))})

        # 5. critic update: critic.ppoEpochs x mini-batches (split: on the critic pool, at the same time as 6.)
        if not self.split:
            with self.telemetry.stage("critic_update"):
                metrics.update(update_critic(self.critic, minis, spec))

        # 6. actor update (after the critic's warm-up) and weight sync
        if self.step > c.warmup_steps:
            self._on_gpu(self.actor)
            start = time.perf_counter()
            with self.telemetry.stage("actor_update"):
                actor_metrics = [self.actor.update(mini, self._loss_fn(single_update),
                                                   micro_batch_size=spec.training.micro_batch_size_per_gpu,
                                                   with_entropy=a.entropy_coeff > 0, normalise_by="response_mask")
                                 for _ in range(spec.training.ppo_epochs) for mini in minis]
            for key, value in _mean_dicts(actor_metrics).items():
                metrics[key if key.startswith("rollout/") else f"actor/{key}"] = value
            metrics.update(self._training_throughput(trim_padding(local), time.perf_counter() - start))
            with self.telemetry.stage("weight_sync"):
                self._sync_weights()
        if self.split:  # the critic update's metrics, once it is done
            metrics.update(critic_metrics if critic_metrics is not None
                           else self._wait_for_critic(self.critic.update_metrics))
            self.telemetry.record_stage("critic_update", metrics["critic/update_s"])
            metrics["timing/critic_wait_s"] = self._critic_wait  # the actor pool idle, waiting for the critic pool
            self._critic_wait = 0.0
        self._note_training_peak()
        return metrics

    def _wait_for_critic(self, reply, since: float | None = None):
        """``reply()`` from the critic pool, adding the time this pool waited for it to the step's critic wait:
        from now, or from ``since`` (taking turns: the command's hand-over, so that the wait holds the critic's
        whole turn; the broadcast that hands it over may return after the critic pool has begun working)."""
        start = time.perf_counter() if since is None else since
        try:
            return reply()
        finally:
            self._critic_wait += time.perf_counter() - start

    def _on_gpu(self, *wanted) -> None:
        """Shared placement taking turns: the models of ``wanted`` onloaded, every other model with
        offload flags offloaded (nothing happens for models without flags)."""
        moves = [(m, f) for m, f in self._offload_plan if (m in wanted) == m.is_offloaded]
        if not moves:
            return
        with self.telemetry.stage("actor_offload"):
            for model, flags in moves:  # offload first: the memory it frees is what the onload takes
                if not model.is_offloaded:
                    model.offload(**flags)
            for model, _ in moves:
                if model.is_offloaded and model in wanted:
                    model.onload()

    def _sync_weights(self) -> None:
        self._on_gpu(self.actor)
        super()._sync_weights()

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return t
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = t.to(device)
        dist.all_reduce(t, group=self.actor.dp_group)
        return t.cpu()

    # ------------------------------------------------------------------ the loop's hooks
    def progress_line(self, metrics: dict[str, float], eta_s: float) -> str:
        critic = (f" | value_loss {metrics.get('critic/value_loss', float('nan')):.4f} | "
                  f"ev {metrics.get('critic/explained_variance', float('nan')):.2f}")
        line = super().progress_line(metrics, eta_s)
        head, sep, tail = line.partition(" | grad_norm")
        return head + critic + sep + tail
