"""Reward curves of the digit-sum task under a separate rollout pool: sync (two seeds, whose gap is the noise)
against async at maxStaleness 1 and 2, same steps and settings (issue 32). Also checks, from every step's
``rollout/staleness_max``, that no trained sample was older than its run's maxStaleness.

    python bench/staleness_curves.py sync=/tmp/a/metrics.jsonl sync2=... async1=... async2=... [--window 50]

"Within the sync run's noise" is taken as: over the windows of ``--window`` steps, the mean absolute gap between
an async run's reward and the mean of the two sync seeds is no larger than the mean absolute gap between the two
sync seeds (their spread), with a binomial allowance for the async run's own sampling noise.
Records to results.jsonl (bench/results.py).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if '"reward/mean"' in line]


def windows(rows: list[dict], width: int) -> list[float]:
    rewards = [r["reward/mean"] for r in rows]
    return [statistics.mean(rewards[i:i + width]) for i in range(0, len(rewards) - width + 1, width)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="label=metrics.jsonl (sync, sync2, async1, async2)")
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--samples-per-step", type=int, default=128)
    ap.add_argument("--card", default=None)
    a = ap.parse_args()
    runs = {label: load(path) for label, path in (arg.split("=", 1) for arg in a.runs)}
    steps = min(len(rows) for rows in runs.values())
    runs = {k: v[:steps] for k, v in runs.items()}
    curves = {k: windows(v, a.window) for k, v in runs.items()}
    sync = [(x + y) / 2 for x, y in zip(curves["sync"], curves["sync2"])]
    spread = statistics.mean(abs(x - y) for x, y in zip(curves["sync"], curves["sync2"]))
    # one window's reward mean is over window x samples; its binomial std at the sync mean
    binomial = statistics.mean(math.sqrt(max(p * (1 - p), 1e-6) / (a.window * a.samples_per_step)) for p in sync)
    allowance = spread + 2 * binomial
    print(f"{steps} steps, windows of {a.window}: sync seeds' mean gap {spread:.3f} (binomial std of a window "
          f"{binomial:.3f}; allowance {allowance:.3f})")
    for label, rows in runs.items():
        stale = [r.get("rollout/staleness_max", 0.0) for r in rows]
        step_s = statistics.median(r["timing/step_s"] for r in rows[5:])
        idle = statistics.median(r.get("timing/trainer_idle_s", 0.0) for r in rows[5:])
        print(f"{label}: windows {' '.join(f'{x:.3f}' for x in curves[label])}; staleness max {max(stale):.0f}; "
              f"median step {step_s * 1e3:.1f} ms, trainer idle {idle * 1e3:.1f} ms")
    import results as bench_results

    card = a.card or bench_results.card_name()
    shape = (f"built-in tiny Qwen2, 16 prompts x 8, {steps} steps, bf16, 1 trainer GPU + 1 rollout GPU (hf engine), "
             f"windows of {a.window} steps")
    verdicts = {}
    for label in ("async1", "async2"):
        if label not in curves:
            continue
        gap = statistics.mean(abs(x - y) for x, y in zip(curves[label], sync))
        worst = max(r.get("rollout/staleness_max", 0.0) for r in runs[label])
        bound = int(label[-1])
        verdicts[label] = gap <= allowance and worst <= bound
        print(f"{label}: mean gap to the sync seeds' mean {gap:.3f} vs allowance {allowance:.3f}; "
              f"staleness max {worst:.0f} (bound {bound}): {'WITHIN' if verdicts[label] else 'OUTSIDE'} the noise")
        last = statistics.mean(r["reward/mean"] for r in runs[label][-100:])
        sync_last = statistics.mean(r["reward/mean"] for k in ("sync", "sync2") for r in runs[k][-100:])
        bench_results.record(f"grpo digit-sum, separate rollout pool, async maxStaleness {bound}", shape,
                             "reward_mean_last100", last, "reward", card=card,
                             baseline="sync, same pool layout, mean of 2 seeds, same call", baseline_value=sync_last,
                             same_run=True)
        bench_results.record(f"grpo digit-sum, separate rollout pool, async maxStaleness {bound}: reward-curve gap",
                             shape, "mean_abs_window_gap_to_sync", gap, "reward", card=card,
                             baseline="gap between the 2 sync seeds + 2 binomial std", baseline_value=allowance,
                             same_run=True)
        step_s = statistics.median(r["timing/step_s"] for r in runs[label][5:])
        sync_step = statistics.median(r["timing/step_s"] for r in runs["sync"][5:])
        bench_results.record(f"grpo digit-sum, separate rollout pool, async maxStaleness {bound}: step time", shape,
                             "step_s_median", step_s, "s", card=card, baseline="sync, same pool layout, same call",
                             baseline_value=sync_step, same_run=True)
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
