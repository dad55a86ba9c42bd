"""The agent loop's rollout overhead over single-turn generation of the same number of tokens (issue 31).

    python3 bench/agent_overhead.py AGENT/metrics.jsonl SINGLE/metrics.jsonl [ENGINE]

Both runs: the same model, batch and token budget (bench/gpu_secret_tool.yaml and bench/gpu_secret_single.yaml).
The rollout stage's seconds per token of the trajectory (model tokens and rendered tool tokens: both pass through
the engine's prefill or decode), median over the steps after the first 10 (compile and warm-up). The agent loop
pays for its turns (a prefill of the whole context per turn with the hf engines), the tool calls and the
rendering; overhead = agent / single - 1.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import results


def seconds_per_token(path: str) -> tuple[float, dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if '"timing/rollout_s"' in line][10:]
    per_token = [r["timing/rollout_s"] / (r["response_length/mean"] * r["reward/samples"]) for r in rows]
    return statistics.median(per_token), rows[-1]


def main(agent_path: str, single_path: str, engine: str = "hf static engine") -> None:
    agent, last_agent = seconds_per_token(agent_path)
    single, last_single = seconds_per_token(single_path)
    overhead = agent / single - 1
    shape = (f"builtin tiny-qwen2-tools, {engine}, {int(last_agent['reward/samples'])} trajectories a step, <= 16 tokens; "
             f"agent: {last_agent.get('tool/turns_mean', 0):.2f} turns, tool share {last_agent.get('tool/time_share', 0):.3f}, "
             f"reward {last_agent['reward/mean']:.3f}; single turn: {last_single['response_length/mean']:.1f} tokens")
    print(f"RESULT agent loop overhead: {overhead * 100:+.1f}% rollout seconds per token "
          f"({agent * 1e6:.1f} us vs {single * 1e6:.1f} us single-turn); {shape}")
    results.record("agent loop rollout vs single-turn, same model/batch/budget", shape, "rollout_us_per_token",
                   agent * 1e6, "us", baseline="single-turn rollout (no agent, no tools)",
                   baseline_value=single * 1e6, same_run=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
