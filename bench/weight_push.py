"""The weight push of a separate rollout pool (issue 32): the trainer's megatron model on GPU 0 sends every weight
to the rollout pool's engine on GPU 1 over NCCL, as the GRPO trainer does after each optimizer step.

    torchrun --nproc_per_node 2 bench/weight_push.py --model 1.5b [--rounds 3]

The same pool machinery as a job with ``rollout.placement: separate`` (runtime/pools.py: one world, the trainer
and the rollout pool each with a default group of their own, the weights group between the two leaders). Timed:
- push: the trainer's side, export (``export_hf_weights``) + bucketed broadcasts until the last bucket is sent:
  what the trainer spends per step;
- ready: from the push's start until the rollout engine holds the new weights (received, installed by
  ``update_weights``, synchronised): when the next batch can start with them;
- floor: one NCCL broadcast of the same bytes as a single buffer, same call.
Records to results.jsonl (bench/results.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.5b")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from actor_update import qwen_config
    from rljob_worker.runtime.distributed import dist_env_from_environ
    from rljob_worker.runtime.pools import PoolLayout, init_pools

    env = dist_env_from_environ(os.environ)
    pools = init_pools(env, PoolLayout(nnodes=1, actor_per_node=1, rollout_per_node=1))
    device = torch.device("cuda", pools.cuda_index) if torch.cuda.is_available() else torch.device("cpu")
    trainer = pools.role == "actor"
    if a.model == "7b":
        from transformers import Qwen2Config

        cfg = Qwen2Config.from_json_file(str(Path(__file__).resolve().parent / "qwen2.5-7b-shape.json"))
    else:
        cfg = qwen_config(a.model)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    folder = Path(tempfile.gettempdir()) / f"weight_push_{a.model}"
    if trainer:  # one random-init checkpoint both sides load
        from transformers import AutoModelForCausalLM

        if not (folder / "config.json").exists():
            torch.manual_seed(0)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            model.save_pretrained(folder)
            del model
    pools.rollout_link.broadcast_object(None, 0)  # the folder is written

    if trainer:
        from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
        from rljob_worker.rollout.weight_push import push_weights

        actor = MegatronActor.from_hf(str(folder), ParallelConfig(), OptimConfig(lr=1e-6), dtype=torch.bfloat16, seed=0)
        pools.rollout_link.broadcast_object(None, 0)
        rounds = []
        for version in range(1, a.rounds + 1):
            sync()
            start = time.time()
            pools.rollout_link.send_object({"start": start}, 1).wait()
            sent = push_weights(pools.weights_link, actor.export_hf_weights(), version=version, device=device)
            sync()
            push_s = time.time() - start
            ready_s = pools.rollout_link.recv_object(1)["ready"] - start
            rounds.append((push_s, ready_s, sent["gb"], sent["buckets"]))
            print(f"push {version}: trainer {push_s:.2f} s, engine ready {ready_s:.2f} s after the start, "
                  f"{sent['gb']:.2f} GB in {sent['buckets']:.0f} buckets", flush=True)
        nbytes = int(rounds[-1][2] * 1e9)
    else:
        from rljob_worker.rollout.factory import make_engine
        from rljob_worker.rollout.weight_push import WeightReceiver

        pools.rollout_link.broadcast_object(None, 0)
        engine = make_engine("hf", str(folder), dtype=torch.bfloat16, device=device, eos_token_id=1, pad_token_id=0,
                             max_model_len=2048, compile="disabled")
        receiver = WeightReceiver(pools.weights_link, device)
        receiver.start()
        for version in range(1, a.rounds + 1):
            pools.rollout_link.recv_object(0)
            receiver.wait_for(version)
            _, tensors, partial, _ = receiver.take()
            engine.update_weights(iter(tensors.items()), partial=partial)
            del tensors
            sync()
            pools.rollout_link.send_object({"ready": time.time()}, 0).wait()
        nbytes = None
    # the receiver stops, then the floor: the same bytes as one buffer over the same NCCL pair
    from rljob_worker.rollout.weight_push import stop_receivers

    if trainer:
        stop_receivers(pools.weights_link)
    else:
        receiver.join(timeout=60)
    nbytes = pools.rollout_link.broadcast_object(nbytes, 0)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    floor = float("inf")
    for _ in range(3):
        pools.rollout_link.broadcast_object(None, 0)
        sync()
        t = time.perf_counter()
        pools.weights_link.tensors.broadcast([flat], opts).wait()
        sync()
        floor = min(floor, time.perf_counter() - t)
    if not trainer:
        return 0
    import results as bench_results

    push_s = min(r[0] for r in rounds[1:] or rounds)
    ready_s = min(r[1] for r in rounds[1:] or rounds)
    gb = rounds[-1][2]
    card = f"{bench_results.card_name()} x2"
    shape = (f"Qwen2.5-{a.model} shape ({gb:.1f} GB bf16), megatron trainer on GPU 0 (TP1), static hf engine on GPU 1, "
             f"NCCL weights group, {rounds[-1][3]:.0f} buckets; best of rounds 2-{a.rounds}")
    print(f"RESULT {a.model}: push {push_s:.2f} s (trainer side), engine ready {ready_s:.2f} s, floor {floor:.3f} s "
          f"({gb / floor:.0f} GB/s)", flush=True)
    bench_results.record("weight push to a separate rollout pool, trainer side (export + send)", shape,
                         "weight_push_s", push_s, "s", card=card,
                         baseline="one NCCL broadcast of the same bytes as a single buffer", baseline_value=floor,
                         same_run=True)
    bench_results.record("weight push to a separate rollout pool, until the engine holds the weights", shape,
                         "weight_push_ready_s", ready_s, "s", card=card,
                         baseline="one NCCL broadcast of the same bytes as a single buffer", baseline_value=floor,
                         same_run=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
