"""Machine-readable bench results: one JSON object per result, appended to a JSON-lines file.

Every bench script calls :func:`record` for each figure it measures. Fields (all present in every
line): date (UTC ISO time), card, work, shape, metric, value, unit, baseline (name or null),
baseline_value, ratio (value / baseline_value, or the inverse for a time; > 1 = better than the
baseline), same_run (the baseline was measured in the same process or call), command, commit.

Where the line goes: ``$RLJOB_BENCH_RESULTS`` if set, else ``$OUT/results.jsonl`` when ``$OUT`` is
set (the device returns only ``$OUT``), else ``bench/results.jsonl`` in this repository. The commit
is ``$RLJOB_BENCH_COMMIT`` if set (the device's copy of the tree has no ``.git``), else
``git rev-parse HEAD``, else ``"unknown"``.

    python bench/results.py merge OUT/results.jsonl   # append a device run's lines to bench/results.jsonl
    python bench/results.py check [FILE]              # every line complete and consistent
    python bench/results.py show [FILE]               # a table
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FILE = REPO / "bench" / "results.jsonl"
FIELDS = ("date", "card", "work", "shape", "metric", "value", "unit", "baseline", "baseline_value", "ratio",
          "same_run", "command", "commit")
LOWER_IS_BETTER_UNITS = {"s", "ms", "us", "s/step", "ms/step", "s/GB", "GiB"}


def results_path() -> Path:
    if os.environ.get("RLJOB_BENCH_RESULTS"):
        return Path(os.environ["RLJOB_BENCH_RESULTS"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "results.jsonl"
    return DEFAULT_FILE


def card_name() -> str:
    """The GPU's name from torch, else nvidia-smi, else "cpu"."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip().splitlines()
        if out:
            return out[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def git_commit() -> str:
    if os.environ.get("RLJOB_BENCH_COMMIT"):
        return os.environ["RLJOB_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def this_command() -> str:
    return shlex.join(["python3", os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else "-", *sys.argv[1:]])


def speed_ratio(value: float, baseline_value: float | None, unit: str) -> float | None:
    """value relative to the baseline, > 1 = better: value / baseline, or baseline / value for times."""
    if baseline_value is None or not value or not baseline_value:
        return None
    return baseline_value / value if unit in LOWER_IS_BETTER_UNITS else value / baseline_value


def make_record(
    work: str,
    shape: str,
    metric: str,
    value: float,
    unit: str,
    *,
    baseline: str | None = None,
    baseline_value: float | None = None,
    same_run: bool = True,
    card: str | None = None,
    command: str | None = None,
    commit: str | None = None,
    date: str | None = None,
) -> dict[str, Any]:
    if (baseline is None) != (baseline_value is None):
        raise ValueError(f"{work}/{metric}: baseline and baseline_value go together (got {baseline!r}, "
                         f"{baseline_value!r})")
    if not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{work}/{metric}: value must be a number, got {value!r}")
    return {
        "date": date or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "card": card or card_name(),
        "work": work,
        "shape": shape,
        "metric": metric,
        "value": float(value),
        "unit": unit,
        "baseline": baseline,
        "baseline_value": None if baseline_value is None else float(baseline_value),
        "ratio": speed_ratio(value, baseline_value, unit),
        "same_run": bool(same_run) if baseline is not None else None,
        "command": command or this_command(),
        "commit": commit or git_commit(),
    }


def record(work: str, shape: str, metric: str, value: float, unit: str, *, path: Path | None = None,
           **kwargs: Any) -> dict[str, Any]:
    """Append one result line (see :func:`make_record` for the arguments); returns it."""
    rec = make_record(work, shape, metric, value, unit, **kwargs)
    target = path or results_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def load(path: Path = DEFAULT_FILE) -> list[dict[str, Any]]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def check(records: list[dict[str, Any]]) -> list[str]:
    """Problems with the records (empty = fine): missing or extra fields, inconsistent ratios."""
    problems = []
    for i, r in enumerate(records, 1):
        missing, extra = set(FIELDS) - set(r), set(r) - set(FIELDS)
        if missing or extra:
            problems.append(f"line {i}: missing {sorted(missing)} extra {sorted(extra)}")
            continue
        if r["baseline"] is None:
            if r["baseline_value"] is not None or r["ratio"] is not None:
                problems.append(f"line {i}: no baseline but a baseline_value or ratio")
            continue
        expected = speed_ratio(r["value"], r["baseline_value"], r["unit"])
        if r["ratio"] is None or expected is None or abs(r["ratio"] - expected) > 0.005 * expected:
            problems.append(f"line {i}: ratio {r['ratio']} but value/baseline give {expected}")
        if not isinstance(r["same_run"], bool):
            problems.append(f"line {i}: same_run must be true or false when there is a baseline")
    return problems


def merge(src: Path, dst: Path = DEFAULT_FILE) -> int:
    """Append the records of ``src`` not already in ``dst``; returns how many were added."""
    have = {json.dumps(r, sort_keys=True) for r in load(dst)}
    new = [r for r in load(src) if json.dumps(r, sort_keys=True) not in have]
    problems = check(new)
    if problems:
        raise ValueError(f"{src}: " + "; ".join(problems))
    with open(dst, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in new)
    return len(new)


def show(records: list[dict[str, Any]]) -> None:
    print("| date | card | work | shape | metric | value | baseline | ratio | same run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        base = f"{r['baseline']} {r['baseline_value']:,.4g}" if r["baseline"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(f"| {r['date'][:10]} | {r['card']} | {r['work']} | {r['shape']} | {r['metric']} | "
              f"{r['value']:,.4g} {r['unit']} | {base} | {ratio} | {r['same_run']} |")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("merge", "check", "show"):
        print(__doc__)
        return 2
    if argv[0] == "merge":
        print(f"added {merge(Path(argv[1]))} records to {DEFAULT_FILE}")
        return 0
    records = load(Path(argv[1]) if len(argv) > 1 else DEFAULT_FILE)
    if argv[0] == "show":
        show(records)
        return 0
    problems = check(records)
    print("\n".join(problems) or f"{len(records)} records, all complete")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
