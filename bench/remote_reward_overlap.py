"""The reward stage's share of a GRPO step with a remote reward, scoring overlapped with the log-prob
passes (spec.reward.remote.overlap true) or not, on CPU with the quickstart model.

    python3 bench/remote_reward_overlap.py [--steps 6] [--delay 0.5] [--record]

A real http-json verifier (tests/worker/reward_servers.py) on 127.0.0.1 answers each batch after
`--delay` seconds (a judge's latency). The step has an old-log-prob pass (two mini-batches) and a
reference pass (klCoef > 0), the work the scoring can hide behind. Both runs are in this call, same
seed; the median over steps 2.. of timing/reward_s / timing/step_s is reported (step 1 warms up).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "worker"))
sys.path.insert(0, str(REPO / "bench"))

from reward_servers import Verifier
from test_learning import quickstart_spec, run_trainer


def spec_for(url: str, steps: int, overlap: bool) -> dict:
    spec = quickstart_spec()
    spec["reward"] = {"remote": {"url": url, "batchSize": 256, "overlap": overlap}}
    spec["algorithm"].update(klCoef=0.001)  # a reference pass
    spec["training"].update(trainBatchSizePerNode=8, ppoMiniBatchSizePerNode=4, microBatchSizePerGpu=16,
                            totalTrainingSteps=steps, testFreq=-1, valBeforeTrain=False)  # two updates: old pass
    spec["checkpoint"].update(saveFreq=0, exportHf=False)
    return spec


def record(out: dict, delay: float, command: str) -> None:
    """One results.jsonl line: the reward stage's median seconds with overlap against without (same call)."""
    import results as R

    b, o = out["blocking"], out["overlap"]
    shape = (f"tiny-qwen2 quickstart on CPU, 8 prompts x 8, 16 tokens, 2 mini-batches + reference pass, verifier "
             f"latency {delay} s; reward share of the step {o['reward_share']:.3f} (overlap) vs "
             f"{b['reward_share']:.3f}; step {o['timing/step_s']:.2f} s vs {b['timing/step_s']:.2f} s; old+ref "
             f"log-probs {o['timing/old_logprob_s'] + o['timing/ref_logprob_s']:.2f} s")
    R.record("grpo step reward stage (wait for a remote reward), overlapped with the log-prob passes", shape,
             "reward_stage_s", o["timing/reward_s"], "s", card="CPU (2 cores, shared with other jobs)",
             baseline="same, reward.remote.overlap false", baseline_value=b["timing/reward_s"], same_run=True,
             command=command)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--workdir", default="/tmp/rljob-bench-remote-reward")
    parser.add_argument("--record", action="store_true", help="append the result to bench/results.jsonl")
    args = parser.parse_args()
    server = Verifier(delay_s=args.delay)
    out = {}
    try:
        for overlap in (False, True):
            workdir = Path(args.workdir) / ("overlap" if overlap else "blocking")
            if workdir.exists():
                import shutil

                shutil.rmtree(workdir)
            start = time.perf_counter()
            records = run_trainer(spec_for(server.url, args.steps, overlap), workdir)[1:]
            keys = ("timing/step_s", "timing/reward_s", "timing/reward_remote_s", "timing/old_logprob_s",
                    "timing/ref_logprob_s")
            med = {k: statistics.median(r.get(k, 0.0) for r in records) for k in keys}
            med["reward_share"] = statistics.median(r["timing/reward_s"] / r["timing/step_s"] for r in records)
            med["wall_s"] = time.perf_counter() - start
            med["reward_mean"] = [round(r["reward/mean"], 4) for r in records]
            out["overlap" if overlap else "blocking"] = med
    finally:
        server.close()
    print(json.dumps(out, indent=1))
    if args.record:
        record(out, args.delay, f"python3 bench/remote_reward_overlap.py --steps {args.steps} --delay {args.delay} --record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
