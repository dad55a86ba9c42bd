"""A stand-in trainer for the observability tests: drives the REAL TrainerTelemetry with sleeps.

    python fake_trainer.py --job NAME --namespace NS --mode healthy|diverged|sick

Prints ``PORT <n>`` once /metrics is served on 127.0.0.1, waits for a line on stdin (the test
sends one once Prometheus scrapes it, so no value is missed), then trains until killed:

- ``healthy``: steps forever (~0.15 s each): every stage, a rising reward, a checkpoint every 2
  steps (save_freq=2), a validation every 5 steps, simulated GPU memory, and one trainer key
  without a dedicated metric (``custom/extra_scalar``), so that every dashboard panel has data.
- ``diverged``: like ``healthy``, but the mean reward and the policy loss are NaN and the
  gradient norm is infinite.
- ``sick``: slower steps (~1.1 s, so every value is scraped), steps 1-3 with rising rewards, a checkpoint at step 2 only (later saves "fail"),
  then the reward collapses to 0 with zero variance (steps 4-6), and the process stalls inside a
  long ``actor_update`` stage without heartbeats.

The values are made up; the durations are real sleeps, so stage times add up to step times.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from rljob_worker.telemetry.trainer_metrics import TrainerTelemetry

STAGE_SLEEP = {  # seconds per stage of a healthy step
    "rollout": 0.04,
    "reward": 0.01,
    "old_logprob": 0.015,
    "ref_logprob": 0.015,
    "critic_values": 0.01,
    "critic_update": 0.02,
    "actor_update": 0.04,
    "weight_sync": 0.01,
}
GIB = 1024**3


def step_metrics(step: int, reward: float, std: float, diverged: bool = False) -> dict[str, float]:
    metrics = {
        "reward/mean": reward,
        "reward/std": std,
        "reward/min": max(0.0, reward - 2 * std),
        "reward/max": min(1.0, reward + 2 * std),
        "response_length/mean": 120.0 + step % 7,
        "response_length/max": 256.0,
        "response_length/clip_ratio": 0.05,
        "actor/kl": 0.001 * step,
        "actor/entropy": 1.2 - 0.001 * step,
        "actor/clip_fraction": 0.02,
        "actor/grad_norm": 1.0,
        "actor/lr": 1e-6,
        "actor/pg_loss": -0.01,
        "critic/value_loss": 0.05 + 0.5 * math.exp(-step / 20),
        "critic/explained_variance": 0.9 * (1 - math.exp(-step / 20)),
        "critic/value_clip_fraction": 0.1,
        "critic/vpred_mean": reward - 0.05,
        "critic/grad_norm": 0.5,
        "critic/lr": 1e-5,
        "critic/update_s": 0.02,
        "throughput/rollout_tokens_per_s": 5000.0,
        "throughput/train_tokens_per_s": 12000.0,
        "perf/mfu": 0.31,
        "rollout/logprob_mismatch_mean": 0.002,
        "rollout/logprob_mismatch_frac": 0.001,
        "rollout/correction_weight_mean": 0.98,
        "rollout/correction_clipped_frac": 0.01,
        "rollout/correction_masked_frac": 0.0,
        "custom/extra_scalar": 42.0,  # no dedicated metric: exported as rljob_trainer_metric{key=...}
    }
    if diverged:
        metrics.update({"reward/mean": math.nan, "actor/pg_loss": math.nan, "actor/grad_norm": math.inf})
    return metrics


def run_stages(tel: TrainerTelemetry, scale: float = 1.0) -> None:
    for name, seconds in STAGE_SLEEP.items():
        with tel.stage(name):
            time.sleep(seconds * scale)


def healthy(tel: TrainerTelemetry, diverged: bool = False) -> None:
    step = 0
    while True:
        step += 1
        t0 = time.perf_counter()
        run_stages(tel)
        reward = 0.2 + 0.6 * (1 - math.exp(-step / 30))
        tel.record_step(step, step_metrics(step, reward, 0.2, diverged), time.perf_counter() - t0)
        # Simulated: this machine has no GPU, and record_gpu_memory() reads torch.cuda.
        tel.set_gpu_memory(allocated_bytes=20 * GIB, reserved_bytes=24 * GIB, max_allocated_bytes=30 * GIB,
                           total_bytes=80 * GIB)
        # As in the real trainer, validation and checkpoints follow the step, outside its time.
        if step % 5 == 0:
            with tel.stage("validation"):
                time.sleep(0.01)
            tel.record_validation(step, {"val/reward_mean": reward, "val/accuracy": reward * 0.9})
        if step % 2 == 0:
            with tel.stage("checkpoint"):
                time.sleep(0.01)
            tel.record_checkpoint(step, time.time())


def sick(tel: TrainerTelemetry) -> None:
    rewards = [0.2, 0.5, 0.8, 0.0, 0.0, 0.0]
    for step, reward in enumerate(rewards, start=1):
        t0 = time.perf_counter()
        run_stages(tel, scale=8.0)  # ~1.1 s steps: Prometheus (1 s scrapes) sees every reward
        std = 0.2 if reward > 0 else 0.0
        tel.record_step(step, step_metrics(step, reward, std), time.perf_counter() - t0)
        if step == 2:
            with tel.stage("checkpoint"):
                time.sleep(0.01)
            tel.record_checkpoint(step, time.time())
    with tel.stage("actor_update"):  # the hang: no heartbeat from here on
        while True:
            time.sleep(3600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--mode", choices=("healthy", "diverged", "sick"), required=True)
    args = p.parse_args()
    tel = TrainerTelemetry(job=args.job, namespace=args.namespace, rank=0, model="Qwen/Qwen2.5-0.5B-Instruct",
                           algorithm="grpo", nnodes=2, save_freq=2)
    port = tel.serve(0, addr="127.0.0.1")
    tel.set_total_steps(10_000)
    print(f"PORT {port}", flush=True)
    sys.stdin.readline()
    try:
        if args.mode == "sick":
            sick(tel)
        else:
            healthy(tel, diverged=args.mode == "diverged")
    finally:
        tel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
