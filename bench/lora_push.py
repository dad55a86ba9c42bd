"""LoRA at the Qwen2.5-7B shape on one GPU (issue 34): what a weight push and a checkpoint cost with adapters
against full weights, in one process on the same card.

    python bench/lora_push.py [--model /tmp/q7b/model] [--rank 32]

- weight push: the merged adapted weights only (``export_hf_weights(only_changed=True)`` into the static hf
  engine, ``partial``) against every weight (what a full fine-tuning job pushes), each timed to completion;
- checkpoint: the LoRA step folder (adapters + Adam moments + metadata) written by ``save_checkpoint``,
  against the size a full fine-tuning step would have (bf16 weights + fp32 main params + two Adam moments:
  14 bytes a parameter; not written: it does not fit one H100's training state anyway).
Records to results.jsonl (bench/results.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from results import record


def timed_sync(actor, engine, only_changed: bool) -> tuple[float, float, int]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sent = {"bytes": 0, "tensors": 0}

    def counted(stream):
        for name, tensor in stream:
            sent["bytes"] += tensor.numel() * tensor.element_size()
            sent["tensors"] += 1
            yield name, tensor

    engine.update_weights(counted(actor.export_hf_weights(only_changed=only_changed)), partial=only_changed)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, sent["bytes"] / 2**30, sent["tensors"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/q7b/model")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--ckpt", default="/tmp/q7b-lora-push-ckpt")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
    from rljob_worker.megatron.lora import LoraConfig
    from rljob_worker.rollout.factory import make_engine

    t0 = time.perf_counter()
    actor = MegatronActor.from_hf(a.model, ParallelConfig(), OptimConfig(lr=1e-5), dtype=torch.bfloat16, seed=1,
                                  lora=LoraConfig(rank=a.rank, alpha=2.0 * a.rank, seed=1))
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in actor.core.parameters())
    n_adapter = sum(p.numel() for p in actor.lora.parameters())
    engine = make_engine("hf", a.model, dtype=torch.bfloat16, device=actor.device, eos_token_id=0, pad_token_id=0,
                         max_model_len=2048, compile="disabled")
    with torch.no_grad():  # trained-looking adapters: B non-zero, so the merge does real work
        for p in actor.lora.parameters():
            p.normal_(0, 0.01)
    print(f"actor built in {build_s:.1f}s: {n_params / 1e9:.2f}B parameters, adapters {n_adapter / 1e6:.1f}M "
          f"(rank {a.rank}); GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
    timed_sync(actor, engine, only_changed=True)  # warm-up (allocator, kernels)
    results = {}
    for only_changed in (True, False, True, False):
        results.setdefault(only_changed, []).append(timed_sync(actor, engine, only_changed))
    lora_s, lora_gib, lora_n = min(results[True])
    full_s, full_gib, full_n = min(results[False])
    print(f"weight push: changed-only {lora_s:.2f}s ({lora_gib:.1f} GiB, {lora_n} tensors) vs every weight "
          f"{full_s:.2f}s ({full_gib:.1f} GiB, {full_n} tensors)", flush=True)
    shape = (f"Qwen2.5-7B shape (random init), bf16, 1 GPU, TP1, LoRA rank {a.rank} on qkv/proj/fc1/fc2 "
             f"({n_adapter / 1e6:.1f}M adapter parameters); merged weights into the static hf engine")
    record("lora weight push (merged adapted weights only) vs every weight", shape, "weight_push_s", lora_s, "s",
           baseline="every weight (full fine-tuning's push)", baseline_value=full_s, same_run=True)

    shutil.rmtree(a.ckpt, ignore_errors=True)
    t0 = time.perf_counter()
    actor.save_checkpoint(a.ckpt)
    save_s = time.perf_counter() - t0
    saved = sum(f.stat().st_size for f in Path(a.ckpt).rglob("*") if f.is_file())
    full_bytes = n_params * 14
    print(f"checkpoint: LoRA {saved / 2**20:.0f} MiB in {save_s:.1f}s; a full fine-tuning step would hold "
          f"{full_bytes / 2**30:.0f} GiB", flush=True)
    record("lora checkpoint size vs a full fine-tuning checkpoint (computed: 14 bytes a parameter)", shape,
           "checkpoint_gib", saved / 2**30, "GiB", baseline="full fine-tuning step (computed, not written)",
           baseline_value=full_bytes / 2**30, same_run=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
