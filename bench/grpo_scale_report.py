"""Report GRPO runs at scale from their metrics.jsonl: tokens/s/GPU, stage breakdown, update MFU, peak memory.

    python bench/grpo_scale_report.py --gpus 4 LABEL=WORKDIR/metrics.jsonl [BASELINE_LABEL=PATH ...]

The first run is the subject; each further run is a baseline from the same call (ratio = subject /
baseline). Step 1 is a warm-up (CUDA graph capture, first allocations) and is left out of the
medians when there are later steps. tokens/s/GPU = (prompt + response tokens of the step's batch,
``batch/tokens``) / step seconds / GPUs, the figure NeMo-RL publishes (1,581 tok/s/GPU on-policy for
Llama-3.1-8B GRPO on 16 H100s). Prints one RESULT line per run and writes bench/results.jsonl-style
JSON lines to $OUT/results.jsonl (card and commit filled in from the machine and git).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
from pathlib import Path

from results import make_record  # bench/ is on the path (bench/gpu_all.sh; python bench/...)

NEMO_RL_TOK_S_GPU = 1581.0
STAGES = ("rollout", "reward", "actor_offload", "old_logprob", "ref_logprob", "actor_update", "weight_sync")


def load(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if '"timing/step_s"' in line]
    return rows[1:] if len(rows) > 1 else rows


def med(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def summary(rows: list[dict], gpus: int) -> dict:
    step = med(rows, "timing/step_s")
    tokens = med(rows, "batch/tokens")
    out = {"steps": len(rows), "step_s": step, "tokens": tokens,
           "tok_s_gpu": tokens / step / gpus if tokens and step else None, "mfu": med(rows, "perf/mfu"),
           "stages": {s: med(rows, f"timing/{s}_s") for s in STAGES if med(rows, f"timing/{s}_s") is not None},
           "peak_gib": {k[7:-9]: max(r[k] for r in rows if k in r) for k in sorted({k for r in rows for k in r})
                        if k.startswith("memory/") and k.endswith("_peak_gib")},
           "rollout_tok_s": med(rows, "throughput/rollout_tokens_per_s")}
    staged = sum(v for k, v in out["stages"].items() if k != "reward")
    out["stages"]["other"] = step - staged if step else None
    return out


def line(label: str, s: dict) -> str:
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in s["stages"].items() if v is not None)
    peaks = ", ".join(f"{k} {v:.1f}" for k, v in s["peak_gib"].items())
    mfu = f"{s['mfu'] * 100:.1f}%" if s["mfu"] is not None else "n/a"
    tok = f"{s['tok_s_gpu']:.0f}" if s["tok_s_gpu"] else "n/a"
    return (f"RESULT {label}: {tok} tok/s/GPU ({tok}/{NEMO_RL_TOK_S_GPU:.0f} = "
            f"{(s['tok_s_gpu'] or 0) / NEMO_RL_TOK_S_GPU:.2f}x NeMo-RL's 8B figure), median step {s['step_s']:.1f} s "
            f"over {s['steps']} step(s), {s['tokens'] or 0:.0f} tokens/step; stages: {stages}; update MFU {mfu}; "
            f"peak GiB (max over ranks) by stage: {peaks}")


def card() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20, check=False).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
        return f"{len(names)}x {names[0]}" if names else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--shape", default="Qwen2.5-7B shape, random init, bf16, 8 samples of 1024 + 2048 tokens per prompt")
    ap.add_argument("--command", default="bash bench/gpu_all.sh q7bprep q7bevery q7brank0 q7breport")
    ap.add_argument("runs", nargs="+", metavar="LABEL=METRICS_JSONL")
    a = ap.parse_args()
    results = []
    for spec in a.runs:
        label, _, path = spec.partition("=")
        if not Path(path).exists():
            print(f"RESULT {label}: no metrics at {path}")
            continue
        s = summary(load(path), a.gpus)
        print(line(label, s))
        results.append((label, s))
    if not results:
        return 1
    (label, subject), baselines = results[0], results[1:]
    today, gpu_card, sha = datetime.date.today().isoformat(), card(), commit()
    records = []
    for base_label, base in baselines or [(None, None)]:
        for metric, unit, key in (("tokens_per_s_per_gpu", "tok/s/GPU", "tok_s_gpu"), ("step_seconds", "s", "step_s")):
            value, base_value = subject[key], (base or {}).get(key)
            if base_value is None:
                base_label = None
            shape = f"{a.shape}, {subject['tokens'] or 0:.0f} tokens/step"
            rec = make_record(f"grpo {label}", shape, metric, value, unit, baseline=base_label, baseline_value=base_value,
                              card=gpu_card, command=a.command, commit=sha, date=today)
            records.append(rec)
            if rec["ratio"] is not None:
                print(f"RATIO {label} vs {base_label}: {metric} {rec['ratio']:.2f}x (> 1 = better)")
    out = Path(os.environ.get("OUT", ".")) / "results.jsonl"
    with open(out, "a") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
