"""Metrics of the simulated trainers as a real Prometheus scraped them (every second): present,
labelled as documented, and with sane values."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from obs_support import NAMESPACE, wait_until

H = f'rljob="healthy", namespace="{NAMESPACE}"'


def value(prom, expr: str) -> float:
    result = prom.wait_for(expr, timeout=20)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def test_step_increases(observed_run):
    prom = observed_run.prom
    step1, count1 = value(prom, f"rljob_step{{{H}}}"), value(prom, f"rljob_steps_total{{{H}}}")
    time.sleep(2.5)
    step2, count2 = value(prom, f"rljob_step{{{H}}}"), value(prom, f"rljob_steps_total{{{H}}}")
    assert step2 > step1 >= 1
    assert count2 - count1 == step2 - step1  # one process, no restart: counter and step move together
    assert value(prom, f"rljob_total_steps{{{H}}}") == 10_000
    assert value(prom, f"rljob_step_seconds_count{{{H}}}") == pytest.approx(count2, abs=2 * 10)


def test_stage_times_add_up_to_step_time(observed_run):
    """The stages inside steps (all but validation and checkpoint, which follow the step) account for
    (almost) all of the step time: compared in one scrape, the
    stage totals exceed the step total by at most the step in progress, and trail it by at most the
    bookkeeping between stages (a few per cent)."""
    prom = observed_run.prom
    wait_until(lambda: prom.value(f"rljob_steps_total{{{H}}}") >= 30, timeout=20, what="30 healthy steps")
    (row,) = prom.query(f'sum(rljob_stage_seconds_sum{{{H}, stage!~"validation|checkpoint"}}) - on() '
                        f'sum(rljob_step_seconds_sum{{{H}}})')
    excess = float(row["value"][1])
    steps = value(prom, f"rljob_step_seconds_sum{{{H}}}")
    assert steps > 3
    assert -0.05 * steps <= excess <= 0.25, (excess, steps)
    window = "10s"
    # Each stage's mean matches what the fake trainer sleeps (plus scheduling slack).
    means = prom.query(f"increase(rljob_stage_seconds_sum{{{H}}}[{window}]) / increase(rljob_stage_seconds_count{{{H}}}[{window}])")
    mean = {r["metric"]["stage"]: float(r["value"][1]) for r in means}
    assert set(mean) == {"rollout", "reward", "old_logprob", "ref_logprob", "critic_values", "critic_update",
                         "actor_update", "weight_sync",
                         "checkpoint", "validation"}
    assert 0.04 <= mean["rollout"] < 0.08 and 0.04 <= mean["actor_update"] < 0.08, mean
    assert 0.01 <= mean["weight_sync"] < 0.04, mean
    # The last-value gauges agree with the histograms.
    assert 0.04 <= value(prom, f'rljob_stage_last_seconds{{{H}, stage="rollout"}}') < 0.2


def test_scalars_have_sane_values(observed_run):
    prom = observed_run.prom
    r1 = value(prom, f"rljob_reward_mean{{{H}}}")
    time.sleep(2)
    r2 = value(prom, f"rljob_reward_mean{{{H}}}")
    assert 0 <= r1 < r2 <= 1  # the simulated reward rises
    assert value(prom, f"rljob_reward_min{{{H}}}") <= r2 <= value(prom, f"rljob_reward_max{{{H}}}")
    assert value(prom, f"rljob_mfu_ratio{{{H}}}") == pytest.approx(0.31)
    assert value(prom, f"rljob_actor_learning_rate{{{H}}}") == pytest.approx(1e-6)
    assert value(prom, f'rljob_trainer_metric{{{H}, key="custom/extra_scalar"}}') == 42
    assert 0 <= value(prom, f"rljob_validation_accuracy{{{H}}}") <= 1
    assert value(prom, f"rljob_gpu_memory_reserved_bytes{{{H}}}") >= value(prom, f"rljob_gpu_memory_allocated_bytes{{{H}}}")


def test_heartbeat_and_checkpoints_are_fresh_for_the_healthy_run(observed_run):
    prom = observed_run.prom
    assert value(prom, f"time() - rljob_heartbeat_timestamp_seconds{{{H}}}") < 3
    ckpt_step = value(prom, f"rljob_last_checkpoint_step{{{H}}}")
    assert ckpt_step % 2 == 0 and 0 < ckpt_step <= value(prom, f"rljob_step{{{H}}}")
    assert value(prom, f"time() - rljob_last_checkpoint_timestamp_seconds{{{H}}}") < 3
    assert value(prom, f"rljob_checkpoint_save_freq_steps{{{H}}}") == 2
    # saveFreq 2 x the mean recent step: at least 2 x the step's sleeps (0.16 s), and near 2 x the mean step of
    # the last 30 s (the estimate averages the last 20 steps: within 1.5x of it on a machine whose load changes)
    estimate = value(prom, f"rljob_checkpoint_interval_seconds_estimate{{{H}}}")
    mean_step = value(prom, f"increase(rljob_step_seconds_sum{{{H}}}[30s]) / increase(rljob_step_seconds_count{{{H}}}[30s])")
    assert 2 * 0.16 <= estimate <= 2 * 1.5 * mean_step, (estimate, mean_step)
    assert estimate >= 2 * mean_step / 1.5, (estimate, mean_step)


def test_labels_survive_scraping(observed_run):
    """The exported labels are kept as they are (none clash with the target's job/instance)."""
    prom = observed_run.prom
    (info,) = prom.wait_for(f"rljob_job_info{{{H}}}")
    labels = info["metric"]
    assert labels["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (labels["algorithm"], labels["nnodes"], labels["rank"]) == ("grpo", "2", "0")
    assert labels["job"] == "rljob" and labels["instance"] == observed_run.healthy.target  # Prometheus' own
    assert prom.query('count({exported_job!=""} or {exported_instance!=""} or {exported_namespace!=""})') == []
    unlabelled = prom.query('{__name__=~"rljob_.+", __name__!~"rljob_operator_.+", job="rljob", rank=""}')
    assert unlabelled == []
    worker_series = prom.query('count({__name__=~"rljob_.+", __name__!~"rljob_operator_.+", rljob="healthy"})')
    assert float(worker_series[0]["value"][1]) > 80
