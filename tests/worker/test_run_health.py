"""Non-finite rewards are counted and scored 0; a run that cannot learn fails (hand-built cases)."""
from __future__ import annotations

import math

import pytest
import torch
from rljob_worker.run_health import RunFailed, RunHealth, sanitize_rewards


def test_sanitize_rewards_zeroes_and_counts_non_finite_ones():
    clean, bad = sanitize_rewards(torch.tensor([1.0, float("nan"), 0.5, float("inf"), -float("inf")]))
    assert bad == 3 and clean.tolist() == [1.0, 0.0, 0.5, 0.0, 0.0]
    same, none = sanitize_rewards(torch.tensor([0.25, 1.0]))
    assert none == 0 and same.tolist() == [0.25, 1.0]


def test_all_rewards_non_finite_fails_after_patience_steps():
    health = RunHealth(total_steps=30, patience=3)
    for step in (1, 2):
        health.record(step, {"reward/nonfinite_count": 8, "reward/samples": 8})
    with pytest.raises(RunFailed, match=r"3 steps in a row could not learn .*step 3: every reward was NaN/Inf.*"
                                        r"24 non-finite rewards so far.*spec\.reward\.function"):
        health.record(3, {"reward/nonfinite_count": 8, "reward/samples": 8})


def test_some_non_finite_rewards_are_counted_but_the_run_goes_on():
    health = RunHealth(total_steps=30, patience=2)
    for step in range(1, 6):
        health.record(step, {"reward/nonfinite_count": 1, "reward/samples": 8, "actor/skipped": 0.0})
    assert health.nonfinite_rewards == 5


def test_skipped_updates_fail_only_in_a_row_and_short_runs_use_their_length():
    health = RunHealth(total_steps=30, patience=2)
    health.record(1, {"actor/skipped": 1.0})
    health.record(2, {"actor/skipped": 0.5})  # one mini-batch of two learned: the streak ends
    health.record(3, {"actor/skipped": 1.0})
    with pytest.raises(RunFailed, match="non-finite gradients"):
        health.record(4, {"actor/skipped": 1.0})
    short = RunHealth(total_steps=1)
    with pytest.raises(RunFailed):
        short.record(1, {"actor/skipped": 1.0, "actor/grad_norm": math.nan})
