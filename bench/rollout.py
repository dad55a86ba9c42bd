"""Rollout engines on the GPU: the static-cache CUDA-graph engine vs the plain HF engine.

    python bench/rollout.py [--model 0.5b --out DIR]

Qwen2.5-0.5B shape, random init, 128-token prompts, 256 sampled tokens (EOS unreachable, so every
row decodes all 256), temperature 1.
1. correctness on the GPU: both engines in float32, greedy, 16 prompts x 64 tokens: identical
   tokens expected (the graph path is the one under test), max |log-prob difference|;
2. tokens/s (generated tokens / wall) of HFStaticEngine at batch 64 and 256 (bf16; one warm-up
   call that captures the graph, then timed calls) and of HFEngine at batch 64;
3. weight sync seconds per GB into the static engine (HF-named bf16 tensors already on the GPU);
4. with --vllm, last (after the other engines freed the GPU): the real vLLM engine (bf16, CUDA graphs,
   gpu_memory_utilization --vllm-gpu-memory-utilization) at the same batches and at 32 prompts x 8 samples,
   its sleep (level 1) / wake seconds, and its bucketed weight sync seconds per GB.
Writes ``rollout.json`` under --out and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import grpo_step


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(engine, batch, params) -> float:
    sync()
    t0 = time.perf_counter()
    out = engine.generate(batch, params)
    sync()
    assert all(len(r) == params.max_new_tokens for r in out.response_ids), "a row stopped early"
    return time.perf_counter() - t0


class SkipHF(Exception):
    """--skip-hf: leave out the HF engines' rows."""


def vllm_rows(a, paths: dict, params, rows: list, throughput) -> dict:
    """4. The real vLLM engine: throughput at the same batches (and 32 prompts x 8 samples), sleep / wake and
    bucketed weight sync timings. Runs last: vLLM sizes its KV cache from the memory free at start-up."""
    from rljob_worker.rollout import SamplingParams
    from rljob_worker.rollout.vllm_engine import VLLMEngine
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    engine = VLLMEngine(paths["model_dir"], dtype=torch.bfloat16, gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                        max_model_len=a.prompt_len + a.new_tokens, eos_token_id=a.vocab, seed=0)
    info = {"version": engine.vllm_version, "startup_s": time.perf_counter() - t0,
            "gpu_memory_utilization": a.vllm_gpu_memory_utilization}
    print("vllm started:", info, flush=True)
    throughput(engine, "vllm 0.26 (CUDA graphs)")
    grouped = prompts(32, a.prompt_len, a.vocab, 32)
    group_params = SamplingParams(n=8, temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
    timed_generate(engine, grouped, group_params)
    t = min(timed_generate(engine, grouped, group_params) for _ in range(2))
    rows.append({"engine": "vllm 0.26 (CUDA graphs), 32 prompts x 8", "batch": 256, "tokens_per_s": 256 * a.new_tokens / t,
                 "decode_ms_per_step": 1e3 * t / a.new_tokens})
    print(rows[-1], flush=True)
    model = AutoModelForCausalLM.from_pretrained(paths["model_dir"], dtype=torch.bfloat16).cuda()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    for _ in range(2):  # the second cycle is the one reported (the first maps the pools for the first time)
        sync()
        t0 = time.perf_counter()
        engine.sleep()
        sync()
        info["sleep_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.wake_up(tags=["weights"])
        sync()
        info["wake_weights_s"] = time.perf_counter() - t0
        engine.update_weights(iter(named))
        t0 = time.perf_counter()
        engine.wake_up(tags=["kv_cache"])
        sync()
        info["wake_kv_cache_s"] = time.perf_counter() - t0
        s = engine.last_sync_stats
        info["weight_sync"] = {"gb": s.gb, "s": s.seconds, "s_per_gb": s.seconds / s.gb, "buckets": s.buckets}
    timed_generate(engine, grouped, group_params)  # still generates after the cycle
    print("vllm sleep / sync / wake:", info, flush=True)
    del model, named
    engine.shutdown()
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compiled", action="store_true", help="also time the static engine with a compiled decode step")
    ap.add_argument("--hf-generate-baseline", action="store_true",
                    help="also time transformers generate() with a static cache and a compiled forward")
    ap.add_argument("--vllm", action="store_true", help="also time the real vLLM engine (needs vLLM installed)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--skip-hf", action="store_true", help="only the vLLM rows (with --vllm)")
    a = ap.parse_args()
    from rljob_worker.rollout import SamplingParams
    from rljob_worker.rollout.hf_engine import HFEngine
    from rljob_worker.rollout.hf_static_engine import HFStaticEngine

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: smoke test only
    card = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    paths = grpo_step.prepare(Path(tempfile.mkdtemp(prefix="rollout_bench_")), a.model, 8, 16, a.vocab)
    kw = {"device": dev, "eos_token_id": a.vocab, "pad_token_id": 0}
    res: dict = {"card": card, "model": a.model}

    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=64)
    greedy_batch = prompts(16, a.prompt_len, a.vocab, 0)
    reference = []  # the HF engine's greedy output, computed once

    def greedy_check(key: str, label: str, **engine_kw) -> None:
        """1. correctness: a static engine in float32, greedy, against the HF engine (same tokens)."""
        try:
            if not reference:
                reference.append(HFEngine(paths["model_dir"], dtype=torch.float32, **kw).generate(greedy_batch, greedy))
            x = reference[0]
            st = HFStaticEngine(paths["model_dir"], dtype=torch.float32, **kw, **engine_kw)
            y = st.generate(greedy_batch, greedy)
            pairs = list(zip(x.response_ids, y.response_ids))
            prefix = [next((i for i, (u, v) in enumerate(zip(r1, r2)) if u != v), len(r1)) for r1, r2 in pairs]
            diff = max(abs(u - v) for r1, r2 in zip(x.response_logprobs, y.response_logprobs) for u, v in zip(r1, r2))
            res[key] = {"rows_identical": sum(r1 == r2 for r1, r2 in pairs), "rows": len(greedy_batch),
                        "min_common_prefix": min(prefix), "max_abs_logprob_diff": diff,
                        "graph_captures": st.graph_captures}
            print(f"fp32 greedy check ({label}):", res[key], flush=True)
            del st
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            res[key] = {"error": f"{type(exc).__name__}: {exc}"}

    if not a.skip_hf:
        greedy_check("fp32_greedy", "graph path")
    if a.compiled and dev.type == "cuda":  # the compiled decode step must decode as the eager one
        greedy_check("fp32_greedy_compiled", "compiled decode step", compile_decode=True)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
    rows = []
    batches = [int(x) for x in a.batches.split(",")]

    def throughput(engine, label: str) -> None:
        """One untimed call per batch size (captures the graph, compiles), then the best of two timed."""
        for b in batches:
            batch = prompts(b, a.prompt_len, a.vocab, b)
            t0 = time.perf_counter()
            timed_generate(engine, batch, params)
            first = time.perf_counter() - t0
            times = [timed_generate(engine, batch, params) for _ in range(2)]
            rows.append({"engine": label, "batch": b, "first_call_s": first, "tokens_per_s": b * a.new_tokens / min(times),
                         "decode_ms_per_step": 1e3 * min(times) / a.new_tokens})
            print(rows[-1], flush=True)

    if a.compiled:
        try:
            stc = HFStaticEngine(paths["model_dir"], dtype=torch.bfloat16, compile_decode=True, **kw)
            throughput(stc, "hf-static compiled (torch.compile + CUDA graph)")
            del stc
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"engine": "hf-static compiled", "error": f"{type(exc).__name__}: {exc}"})
    try:  # 2. throughput + 3. weight sync
        if a.skip_hf:
            raise SkipHF
        st = HFStaticEngine(paths["model_dir"], dtype=torch.bfloat16, **kw)
        throughput(st, "hf-static (CUDA graph)")
        named = [(n, p.detach().clone()) for n, p in st.model.named_parameters()]
        gb = sum(t.numel() * t.element_size() for _, t in named) / 1e9
        sync()
        t0 = time.perf_counter()
        st.update_weights(iter(named))
        sync()
        res["weight_sync"] = {"gb": gb, "s": time.perf_counter() - t0,
                              "s_per_gb": (time.perf_counter() - t0) / gb}
        print("weight sync:", res["weight_sync"], flush=True)
        del st, named
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    except SkipHF:
        pass
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        rows.append({"engine": "hf-static", "error": f"{type(exc).__name__}: {exc}"})
    try:
        if a.skip_hf:
            raise SkipHF
        hf = HFEngine(paths["model_dir"], dtype=torch.bfloat16, **kw)
        batch = prompts(64, a.prompt_len, a.vocab, 64)
        hf.generate(batch[:8], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=0))
        t = timed_generate(hf, batch, params)
        rows.append({"engine": "hf (dynamic cache, eager)", "batch": 64, "tokens_per_s": 64 * a.new_tokens / t,
                     "decode_ms_per_step": 1e3 * t / a.new_tokens})
        print(rows[-1], flush=True)
        del hf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    except SkipHF:
        pass
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        rows.append({"engine": "hf", "error": f"{type(exc).__name__}: {exc}"})
    if a.hf_generate_baseline:
        try:  # 4. the baseline: transformers generate() with a static cache and a compiled forward
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(paths["model_dir"], dtype=torch.bfloat16).to(dev).eval()
            # generate() compiles its own decode step when the cache is static (prefill stays eager) and
            # marks each CUDA-graph step itself; compiling model.forward by hand instead makes the
            # graph overwrite outputs generate still holds (seen on the H200 with transformers 5.17)
            from transformers import CompileConfig

            model.generation_config.cache_implementation = "static"
            model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
            gen_kw = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "use_cache": True,
                      "max_new_tokens": a.new_tokens, "min_new_tokens": a.new_tokens, "pad_token_id": 0,
                      "eos_token_id": None}
            for b in [int(x) for x in a.batches.split(",")]:
                ids = torch.tensor(prompts(b, a.prompt_len, a.vocab, b), device=dev)
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)  # compiles
                sync()
                first = time.perf_counter() - t0
                times = []
                for _ in range(2):
                    sync()
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out_ids = model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)
                    sync()
                    times.append(time.perf_counter() - t0)
                new = out_ids.shape[1] - ids.shape[1]
                rows.append({"engine": "HF generate (static cache + torch.compile)", "batch": b, "first_call_s": first,
                             "tokens_per_s": b * new / min(times), "decode_ms_per_step": 1e3 * min(times) / new})
                print(rows[-1], flush=True)
            del model
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"engine": "HF generate static+compile", "error": f"{type(exc).__name__}: {exc}"})
    if a.vllm:
        try:
            res["vllm"] = vllm_rows(a, paths, params, rows, throughput)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"engine": "vllm", "error": f"{type(exc).__name__}: {exc}"})
    res["rows"] = rows
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(res, indent=1))
    print(f"\n## rollout, {a.model}, 128-token prompts + {a.new_tokens} sampled, {card}")
    print("| engine | batch | tokens/s | ms per decode step |")
    print("|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | ERROR {r['error'][:100]} | | |")
        else:
            print(f"| {r['engine']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['decode_ms_per_step']:.2f} |")
    print("fp32 greedy check:", res.get("fp32_greedy"), "| weight sync:", res.get("weight_sync"))
    if "vllm" in res:
        print("vllm:", res["vllm"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
