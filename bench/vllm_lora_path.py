"""vLLM with LoRA (issue 34): merged weights pushed into the engine after every update (what rljob does) against
vLLM's own adapter path (the PEFT adapter written to disk, generation with a new ``LoRARequest``), one mode per
process (vLLM serves one engine per process); bench/gpu_all.sh section ``vllmlora`` runs both in one call.

    python bench/vllm_lora_path.py --mode merged|adapter|base (base: no push, the loaded weights) [--model /tmp/char1.5b] [--rank 32] [--steps 4]

Each step perturbs the adapters (a stand-in for an optimizer step), makes the engine see them (merged: the
changed tensors merged shard by shard and loaded, ``update_weights(partial=True)``; adapter: ``save_peft_adapter``
into a new folder), then generates 256 prompts x 224 tokens (EOS ignored; the char model holds 256 positions) with the same sampling settings;
with the adapter path the new adapter is loaded by that generate call. Reported: median over steps 2.. of the
push seconds, the generate seconds and their sum, as ``RESULT vllmlora <mode> ...`` lines and a JSON file
``$OUT/vllm_lora_<mode>.json``; ``--compare`` merges the two into results.jsonl (adapter path against merged).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "/tmp/bench_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(mode: str, model: str, rank: int, steps: int, prompts: int, tokens: int) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
    from rljob_worker.megatron.lora import LoraConfig
    from rljob_worker.rollout.vllm_engine import VLLMEngine

    actor = MegatronActor.from_hf(model, ParallelConfig(), OptimConfig(lr=1e-5), dtype=torch.bfloat16, seed=1,
                                  lora=LoraConfig(rank=rank, alpha=2.0 * rank, seed=1))
    extra = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1} if mode == "adapter" else {}
    engine = VLLMEngine(model, dtype="bfloat16", gpu_memory_utilization=0.35, max_model_len=256, **extra)
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    vocab = actor.hf_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batch = [{"prompt_token_ids": torch.randint(1, vocab, (16,), generator=generator).tolist()} for _ in range(prompts)]
    rows = []
    for step in range(steps):
        with torch.no_grad():
            for p in actor.lora.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lora_request = None
        if mode == "base":  # no push: the engine's generation speed with the weights it loaded
            pass
        elif mode == "merged":
            engine.update_weights(actor.export_hf_weights(only_changed=True), partial=True)
        else:
            from vllm.lora.request import LoRARequest

            folder = Path(f"/tmp/vllm-lora-path/step_{step}")
            actor.save_peft_adapter(folder)
            lora_request = LoRARequest(f"step-{step}", step + 1, str(folder))
        torch.cuda.synchronize()
        push = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = engine.llm.generate(batch, sampling, use_tqdm=False, lora_request=lora_request)
        generate = time.perf_counter() - t0
        generated = sum(len(o.token_ids) for r in results for o in r.outputs)
        rows.append({"push_s": push, "generate_s": generate, "tokens": generated})
        print(f"vllmlora {mode} step {step + 1}: push {push:.3f} s, generate {generate:.3f} s "
              f"({generated / generate:.0f} tok/s)", flush=True)
    steady = rows[1:] or rows
    summary = {k: statistics.median(r[k] for r in steady) for k in ("push_s", "generate_s", "tokens")}
    summary["total_s"] = summary["push_s"] + summary["generate_s"]
    summary.update(mode=mode, model=model, rank=rank, prompts=prompts, tokens=tokens,
                   card=torch.cuda.get_device_name(), adapter_params=sum(p.numel() for p in actor.lora.parameters()))
    print(f"RESULT vllmlora {mode}: push {summary['push_s']:.3f} s + generate {summary['generate_s']:.3f} s = "
          f"{summary['total_s']:.3f} s a step ({prompts} x {tokens} tokens, rank {rank})", flush=True)
    (out_dir() / f"vllm_lora_{mode}.json").write_text(json.dumps(summary))
    return summary


def compare() -> int:
    from results import record

    merged = json.loads((out_dir() / "vllm_lora_merged.json").read_text())
    adapter = json.loads((out_dir() / "vllm_lora_adapter.json").read_text())
    shape = (f"{merged['model']} (random init), bf16, 1 GPU, LoRA rank {merged['rank']} "
             f"({merged['adapter_params'] / 1e6:.1f}M adapter parameters), {merged['prompts']} prompts x "
             f"{merged['tokens']} tokens; merged: push {merged['push_s']:.3f} s + generate {merged['generate_s']:.3f} s; "
             f"adapter: save {adapter['push_s']:.3f} s + generate (loading it) {adapter['generate_s']:.3f} s")
    for metric, key in (("weight_push_s", "push_s"), ("generate_s", "generate_s"), ("push_plus_generate_s", "total_s")):
        record("vLLM's LoRA adapter path vs merged weights pushed into vLLM", shape, metric, adapter[key], "s",
               baseline="merged weights (update_weights partial), same call", baseline_value=merged[key],
               same_run=True, card=merged["card"], command="bash bench/gpu_all.sh vllmlora")
    faster = "adapter" if adapter["total_s"] < merged["total_s"] else "merged"
    print(f"RESULT vllmlora: {faster} is faster per step ({adapter['total_s']:.3f} s adapter vs "
          f"{merged['total_s']:.3f} s merged)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("merged", "adapter", "base"))
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--model", default="/tmp/char1.5b")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=224)
    a = ap.parse_args()
    if a.compare:
        return compare()
    run(a.mode, a.model, a.rank, a.steps, a.prompts, a.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
