"""Issue 32's whole-job figure: useful tokens per second per GPU of two GRPO runs on the same GPUs, from their
metrics.jsonl (response tokens of every step after the warm-up over the time of those steps).

    python bench/long_tail_job.py SYNC_METRICS SEP_METRICS --responses 128 --gpus 2 [--skip 3]

Writes a results.jsonl line for the separate pool with the colocated sync run of the same call as its baseline.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tokens_per_s_per_gpu(path: str, responses: int, gpus: int, skip: int) -> tuple[float, int, float]:
    """(tok/s/GPU, steps counted, mean response length) over the steps after the first ``skip``."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if "\"reward/mean\"" in line][skip:]
    if not rows:
        raise SystemExit(f"{path}: no steps after the first {skip}")
    tokens = sum(r["response_length/mean"] * responses for r in rows)
    seconds = sum(r["timing/step_s"] for r in rows)
    return tokens / seconds / gpus, len(rows), tokens / responses / len(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sync")
    ap.add_argument("separate")
    ap.add_argument("--responses", type=int, default=128, help="responses a step")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    ap.add_argument("--shape", default="")
    a = ap.parse_args()
    from results import record

    base, n_base, len_base = tokens_per_s_per_gpu(a.sync, a.responses, a.gpus, a.skip)
    sep, n_sep, len_sep = tokens_per_s_per_gpu(a.separate, a.responses, a.gpus, a.skip)
    print(f"RESULT long tail, {a.gpus} GPUs: colocated sync {base:,.0f} tok/s/GPU ({n_base} steps, mean response "
          f"{len_base:.0f}); separate pool {sep:,.0f} tok/s/GPU ({n_sep} steps, mean response {len_sep:.0f}); "
          f"{sep / base:.2f}x (goal >= 1.3x)")
    record("long_tail_job", a.shape or f"{a.gpus} GPUs, {a.responses} responses a step", "useful response tokens/s/GPU, "
           "separate rollout pool (async, partial, refilling rows)", sep, "tok/s/GPU",
           baseline="colocated sync on the same GPUs", baseline_value=base, same_run=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
