"""Where the actor's offload time goes (issue 35): the GRPO trainer's `actor_offload` stage (gradients and
optimizer state out before the rollout, back after it) against the copy bandwidth of one pinned buffer of the
same bytes, measured in the same process.

Builds a random-init Qwen2.5 shape as a megatron actor on one GPU, runs one update (so Adam's state exists),
then times `offload(params=False, grads=True, optimizer=True)` + `onload()` rounds with the offloader's
per-phase seconds (host allocation, copy issue, copy wait, release / allocation) and torch.cuda.empty_cache.

    python bench/offload.py [--model 1.5b] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pinned_bandwidth(nbytes: int, rounds: int = 3) -> dict[str, float]:
    """GB/s of one pinned host buffer <-> one device buffer of ``nbytes`` (the floor an offload can reach)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(rounds):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[f"{name}_s"] = best
        out[f"{name}_gb_s"] = nbytes / best / 1e9
    del dev, host
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.5b")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    from actor_update import grpo_batch, pg_loss, qwen_config
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
    from transformers import AutoModelForCausalLM

    card = torch.cuda.get_device_name()
    cfg = qwen_config(a.model)
    tmp = tempfile.mkdtemp(prefix="offload_bench_")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    del model
    torch.cuda.empty_cache()
    actor = MegatronActor.from_hf(tmp, ParallelConfig(use_distributed_optimizer=a.distributed_optimizer),
                                  OptimConfig(lr=1e-6, weight_decay=0.0), dtype=torch.bfloat16, seed=0)
    batch = grpo_batch(8, cfg.vocab_size, 0)

    phases: list[tuple[str, str, dict]] = []
    real_off, real_on = actor._offloader.offload, actor._offloader.onload

    def offload(category, named, keep_values=True):
        n = real_off(category, named, keep_values)
        phases.append(("offload", category, dict(actor._offloader.last_timing)))
        return n

    def onload(category):
        n = real_on(category)
        phases.append(("onload", category, dict(actor._offloader.last_timing)))
        return n

    actor._offloader.offload, actor._offloader.onload = offload, onload
    rounds = []
    for r in range(a.rounds):
        actor.update(batch, pg_loss, 4)  # as in GRPO: an update between offloads (Adam's state exists from the first)
        phases.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        freed = actor.offload(params=False, grads=True, optimizer=True)
        off_s = time.perf_counter() - t
        t = time.perf_counter()
        actor.onload()
        on_s = time.perf_counter() - t
        rounds.append({"round": r, "offload_s": off_s, "onload_s": on_s, "bytes": freed,
                       "host_gib": actor._offloader.host_bytes() / 2**30,
                       "phases": [{"dir": d, "category": c, **{k: round(v, 4) for k, v in p.items()}}
                                  for d, c, p in phases]})
        print(json.dumps(rounds[-1]), flush=True)
    moved = rounds[-1]["bytes"].get("optimizer", 0)
    floor = pinned_bandwidth(moved)
    print(json.dumps({"optimizer_gib": moved / 2**30, **floor}), flush=True)
    warm = rounds[-1]
    total = warm["offload_s"] + warm["onload_s"]
    (Path(os.environ.get("OUT", ".")) / f"offload_{a.model}{a.tag}.json").write_text(json.dumps(
        {"card": card, "rounds": rounds, "floor": floor, "optimizer_bytes": moved}, indent=1))

    import results as bench_results

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    shape = (f"Qwen2.5-{a.model} shape, megatron actor on 1 GPU, bf16 params, fp32 Adam state "
             f"({moved / 2**30:.1f} GiB optimizer state), gradients dropped, "
             f"{'distributed' if a.distributed_optimizer else 'plain'} optimizer, an update before each round; "
             f"round {len(rounds)} of {a.rounds}" + (f"; PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else ""))
    floor_s = floor["d2h_s"] + floor["h2d_s"]
    bench_results.record("actor offload + onload (optimizer state and gradients)", shape, "offload_round_s", total,
                         "s", card=card, baseline="one pinned buffer of the same bytes, out and back",
                         baseline_value=floor_s, same_run=True)
    first = rounds[0]["offload_s"] + rounds[0]["onload_s"]
    bench_results.record("actor offload + onload, first round (pins the host buffers)", shape, "offload_round_s",
                         first, "s", card=card, baseline="the same, a later round (buffers reused)",
                         baseline_value=total, same_run=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
