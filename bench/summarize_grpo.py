"""Summarise a GRPO run's metrics.jsonl: reward over the first and last 50 steps, median step time and
the per-stage time breakdown (PPO: the critic's explained variance and value loss; a split critic: how much
of the critic pool's time overlapped the actor's).   python bench/summarize_grpo.py WORKDIR/metrics.jsonl [label]"""
from __future__ import annotations

import json
import statistics
import sys


def main(path: str, label: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if '"reward/mean"' in line]
    if not rows:
        print(f"RESULT {label}: no steps recorded in {path}")
        return
    reward = [r["reward/mean"] for r in rows]
    first, last = reward[:50], reward[-50:]
    stages = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step_s"})
    breakdown = ", ".join(f"{k[7:-2]} {statistics.median(r.get(k, 0.0) for r in rows[5:] or rows) * 1e3:.1f} ms" for k in stages)
    print(f"RESULT {label}: {len(rows)} steps, reward first 50 {statistics.mean(first):.3f} -> last 50 "
          f"{statistics.mean(last):.3f}, median step {statistics.median(r['timing/step_s'] for r in rows) * 1e3:.1f} ms "
          f"({breakdown})")
    if "critic/value_loss" in rows[-1]:  # PPO: how the critic did
        ev = [r["critic/explained_variance"] for r in rows]
        print(f"RESULT {label} critic: explained variance first 50 {statistics.mean(ev[:50]):.2f} -> last 50 "
              f"{statistics.mean(ev[-50:]):.2f}, value loss first 50 "
              f"{statistics.mean(r['critic/value_loss'] for r in rows[:50]):.4f} -> last 50 "
              f"{statistics.mean(r['critic/value_loss'] for r in rows[-50:]):.4f}")
    if any("timing/critic_wait_s" in r for r in rows):  # split critic: how much of its time the actor did not wait for
        steady = [r for r in rows[5:] or rows if "timing/critic_wait_s" in r]
        critic = statistics.median(r.get("timing/critic_values_s", 0.0) + r.get("timing/critic_update_s", 0.0)
                                   for r in steady)
        wait = statistics.median(r["timing/critic_wait_s"] for r in steady)
        print(f"RESULT {label} overlap: critic pool {critic * 1e3:.1f} ms per step (values + update), the actor pool "
              f"waited {wait * 1e3:.1f} ms for it: {max(critic - wait, 0.0) * 1e3:.1f} ms hidden behind the actor's work")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])
