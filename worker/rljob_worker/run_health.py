"""Runs that cannot learn fail instead of "succeeding": non-finite rewards and skipped updates.

A reward function that returns NaN or +-Inf used to poison the whole batch's advantages, every
optimizer step was skipped (non-finite gradients), and the run exited 0 with `nan` in its progress
lines as the only trace. Now each non-finite reward is scored 0 and counted (metric
``reward/nonfinite_count``, ``status.trainer.nonfiniteRewards``), and a run whose last
``patience`` steps all skipped their update or got no finite reward at all stops with one line.
"""
from __future__ import annotations

import torch

DEFAULT_PATIENCE = 5


class RunFailed(RuntimeError):
    """Training cannot make progress; the message says why and what to check."""


def sanitize_rewards(rewards: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(N,) rewards with NaN/+-Inf replaced by 0, and how many there were."""
    bad = ~torch.isfinite(rewards)
    count = int(bad.sum())
    return (torch.where(bad, torch.zeros_like(rewards), rewards) if count else rewards), count


class RunHealth:
    """Counts non-finite rewards and fails after `patience` steps in a row that could not learn."""

    def __init__(self, total_steps: int, patience: int = DEFAULT_PATIENCE):
        self.patience = max(1, min(patience, total_steps))
        self.nonfinite_rewards = 0
        self._streak = 0
        self._reasons: list[str] = []

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """After each step; raises RunFailed once `patience` consecutive steps could not learn."""
        bad = int(metrics.get("reward/nonfinite_count", 0))
        self.nonfinite_rewards += bad
        samples = int(metrics.get("reward/samples", 0))
        no_finite_reward = samples > 0 and bad >= samples
        skipped = float(metrics.get("actor/skipped", 0.0)) >= 1.0  # every mini-batch of the step
        if not (no_finite_reward or skipped):
            self._streak, self._reasons = 0, []
            return
        self._streak += 1
        self._reasons.append(f"step {step}: " + ("every reward was NaN/Inf" if no_finite_reward
                                                 else "the update was skipped (non-finite gradients)"))
        if self._streak >= self.patience:
            raise RunFailed(
                f"stopping: {self._streak} steps in a row could not learn ({'; '.join(self._reasons[-3:])}); "
                f"{self.nonfinite_rewards} non-finite rewards so far. Check spec.reward.function for NaN/Inf "
                "results, and spec.training.lr / gradClip if the gradients diverged")
