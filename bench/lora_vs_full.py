"""LoRA against full fine-tuning over the same steps of one task (issue 34), from two runs' metrics.jsonl and
checkpoint folders: the reward curve at fixed steps, the median step and weight-sync times, the committed
checkpoint's size. Prints a table and records each comparison (LoRA's value, full fine-tuning's as baseline).

    python bench/lora_vs_full.py LORA_WORKDIR FULL_WORKDIR LORA_CKPT_DIR FULL_CKPT_DIR --shape TEXT --command TEXT
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record

CURVE_STEPS = (1, 25, 50, 100, 150, 200, 300, 400)


def steps_of(workdir: Path) -> list[dict]:
    path = workdir / "work" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"reward/mean"' in line]


def reward_near(rows: list[dict], step: int, width: int = 5) -> float:
    """Mean reward over `width` steps ending at `step` (1-based): one step's reward of 128 samples is noisy."""
    window = rows[max(step - width, 0):step]
    return statistics.mean(r["reward/mean"] for r in window)


def folder_bytes(folder: Path) -> int:
    """Bytes of the newest committed step under a checkpoint folder (the step folder with the largest number)."""
    steps = sorted((p for p in folder.rglob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    if not steps:
        return 0
    return sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lora")
    ap.add_argument("full")
    ap.add_argument("lora_ckpt")
    ap.add_argument("full_ckpt")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--command", required=True)
    a = ap.parse_args()
    runs = {"lora": steps_of(Path(a.lora)), "full": steps_of(Path(a.full))}
    n = min(len(r) for r in runs.values())
    if n == 0:
        print("RESULT lora-vs-full: a run recorded no steps")
        return 1
    curve = [s for s in CURVE_STEPS if s <= n]
    print(f"| step | {' | '.join(map(str, curve))} |")
    print(f"|---|{'---|' * len(curve)}")
    for name, rows in runs.items():
        print(f"| {name} | {' | '.join(f'{reward_near(rows, s):.3f}' for s in curve)} |")
    summary = {}
    for name, rows in runs.items():
        rows = rows[:n]
        steady = rows[5:] or rows
        summary[name] = {
            "first50": statistics.mean(r["reward/mean"] for r in rows[:50]),
            "last50": statistics.mean(r["reward/mean"] for r in rows[-50:]),
            "step_ms": statistics.median(r["timing/step_s"] for r in steady) * 1e3,
            "sync_ms": statistics.median(r.get("timing/weight_sync_s", 0.0) for r in steady) * 1e3,
        }
    summary["lora"]["ckpt_mib"] = folder_bytes(Path(a.lora_ckpt)) / 2**20
    summary["full"]["ckpt_mib"] = folder_bytes(Path(a.full_ckpt)) / 2**20
    for name, s in summary.items():
        print(f"RESULT {name}: {n} steps, reward first 50 {s['first50']:.3f} -> last 50 {s['last50']:.3f}, "
              f"median step {s['step_ms']:.1f} ms, weight sync {s['sync_ms']:.1f} ms, checkpoint {s['ckpt_mib']:.1f} MiB")
    lora, full = summary["lora"], summary["full"]
    shape = f"{a.shape}; {n} steps each"
    base = "full fine-tuning, same steps, same call"
    for metric, unit, key in (("reward_last50", "reward", "last50"), ("step_time", "ms", "step_ms"),
                              ("weight_sync", "ms", "sync_ms"), ("checkpoint_size", "MiB", "ckpt_mib")):
        if full[key] > 0:
            record(f"digit-sum GRPO, LoRA vs full fine-tuning: {metric}", shape, metric, lora[key], unit,
                   baseline=base, baseline_value=full[key], command=a.command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
