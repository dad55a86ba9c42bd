"""Rollout engines on the GPU: the static-cache CUDA-graph engine vs the plain HF engine and HF generate.

    python bench/rollout.py [--model 0.5b --out DIR] [--compiled --hf-generate-baseline --compile-probe]

Qwen2.5-0.5B shape, random init, 128-token prompts, 256 sampled tokens (EOS unreachable, so every
row decodes all 256), temperature 1.
1. correctness on the GPU: the static engine in float32, greedy, 16 prompts x 64 tokens, uncompiled
   and (--compiled) compiled, against the HF engine: identical tokens expected, max |log-prob difference|;
2. tokens/s (generated tokens / wall) of HFStaticEngine at batch 64 and 256 (bf16; one warm-up call that
   compiles and captures the graphs, then the best of two timed calls): compiled (the default on GPUs)
   with --compiled, and uncompiled (CUDA graphs only); the plain HFEngine at batch 64 unless --skip-plain-hf;
3. weight sync seconds per GB into the static engine (HF-named bf16 tensors already on the GPU);
4. --hf-generate-baseline: transformers generate() with a static cache and its own compiled decode step, the
   baseline every tokens/s row is divided by (same batch, same process);
5. --compile-probe (after the rest): the compiled engine's first call in a fresh process with an empty
   TORCHINDUCTOR_CACHE_DIR (cold) and in a second process with the same directory (warm), and, in the cold
   process, dynamo compiles and seconds over 8 more prompt widths (a GRPO run's varying prompt lengths);
6. with --vllm, last (after the other engines freed the GPU): the real vLLM engine (bf16, CUDA graphs,
   gpu_memory_utilization --vllm-gpu-memory-utilization) at the same batches and at 32 prompts x 8 samples,
   its sleep (level 1) / wake seconds, and its bucketed weight sync seconds per GB.
Writes ``rollout.json`` under --out, prints a table, and appends every figure to results.jsonl (bench/results.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import grpo_step

HF_GENERATE = "HF generate (static cache + torch.compile)"
COMPILED = "hf-static compiled (default on GPUs)"
UNCOMPILED = "hf-static uncompiled (CUDA graphs)"
WHOLE_CACHE = "hf-static compiled, attention over the whole cache"
SEPARATE = "hf-static compiled, separate q/k/v and gate/up GEMMs"
PROBE_WIDTHS = [128, 96, 112, 80, 144, 64, 120, 100]  # the sweep's longest prompt per call (rows vary below it)


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
    ap.add_argument("--skip-plain-hf", action="store_true", help="leave out the plain HF engine row (saves ~20 s)")
    ap.add_argument("--compile-probe", action="store_true",
                    help="first-call compile seconds, cold and warm cache (two fresh processes), and recompiles over "
                         f"{len(PROBE_WIDTHS)} prompt widths")
    ap.add_argument("--probe-batch", type=int, default=64)
    ap.add_argument("--separate-gemms-row", action="store_true",
                    help="also time the compiled engine with each layer's q/k/v and gate/up as separate GEMMs (the "
                         "default fuses them on a GPU), after the fused one, then the fused one again")
    ap.add_argument("--profile", action="store_true",
                    help="after the compiled engine's timed calls, one more call at the largest batch under "
                         "torch.profiler: GPU time by kernel kind (kernels inside CUDA graphs included) and idle")
    ap.add_argument("--whole-cache-row", action="store_true",
                    help="with --compiled: also the compiled engine with one key bucket (every step reads the whole "
                         "cache), the baseline of reading only the filled slots")
    ap.add_argument("--probe-child", default=None, help=argparse.SUPPRESS)  # internal: model dir of the probe process
    ap.add_argument("--probe-sweep", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe_child:
        return probe_child(a)
    # the compile seconds below are a cold cache's unless the caller points TORCHINDUCTOR_CACHE_DIR elsewhere
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="rollout_bench_inductor_"))
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
        greedy_check("fp32_greedy", "uncompiled graph path", compile_decode=False)
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
            throughput(stc, COMPILED)
            if a.profile and dev.type == "cuda":
                import actor_update

                b = max(batches)
                actor_update.profile_step(f"{a.model} compiled batch {b}",
                                          lambda batch: timed_generate(stc, batch, params),
                                          prompts(b, a.prompt_len, a.vocab, b), Path(a.out), "rollout_profile")
            if a.separate_gemms_row:  # separate GEMMs, then the fused engine again: both sides of any drift
                del stc
                torch.cuda.empty_cache()
                sep = HFStaticEngine(paths["model_dir"], dtype=torch.bfloat16, compile_decode=True,
                                     fuse_projections=False, **kw)
                throughput(sep, SEPARATE)
                del sep
                torch.cuda.empty_cache()
                stc = HFStaticEngine(paths["model_dir"], dtype=torch.bfloat16, compile_decode=True, **kw)
                throughput(stc, COMPILED)
            if a.whole_cache_row:  # the same engine reading the whole cache every step (one key bucket)
                stc.max_graphs = 1
                stc.release_cache()
                throughput(stc, WHOLE_CACHE)
            del stc
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"engine": "hf-static compiled", "error": f"{type(exc).__name__}: {exc}"})
    try:  # 2. throughput + 3. weight sync
        if a.skip_hf:
            raise SkipHF
        st = HFStaticEngine(paths["model_dir"], dtype=torch.bfloat16, compile_decode=False, **kw)
        throughput(st, UNCOMPILED)
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
        if a.skip_hf or a.skip_plain_hf:
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
                rows.append({"engine": HF_GENERATE, "batch": b, "first_call_s": first,
                             "tokens_per_s": b * new / min(times), "decode_ms_per_step": 1e3 * min(times) / new})
                print(rows[-1], flush=True)
            del model
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"engine": "HF generate static+compile", "error": f"{type(exc).__name__}: {exc}"})
    record_results(card, a, rows, res.get("weight_sync"))  # now: a later stage running out of time loses nothing
    recorded = len(rows)
    if a.compile_probe:
        try:
            res["compile_probe"] = compile_probe(a, paths["model_dir"], card)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            res["compile_probe"] = {"error": f"{type(exc).__name__}: {exc}"}
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
    print(f"\n## rollout, {a.model}, {a.prompt_len}-token prompts + {a.new_tokens} sampled, {card}")
    print("| engine | batch | tokens/s | ms per decode step |")
    print("|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | ERROR {r['error'][:100]} | | |")
        else:
            print(f"| {r['engine']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['decode_ms_per_step']:.2f} |")
    print("fp32 greedy check:", res.get("fp32_greedy"), "| weight sync:", res.get("weight_sync"))
    if "fp32_greedy_compiled" in res:
        print("fp32 greedy check (compiled):", res["fp32_greedy_compiled"])
    if "compile_probe" in res:
        print("compile probe:", json.dumps(res["compile_probe"]))
    if "vllm" in res:
        print("vllm:", res["vllm"])
    record_results(card, a, rows, None, start=recorded)
    return 0


def record_results(card: str, a, rows: list[dict], weight_sync: dict | None, start: int = 0) -> None:
    """One results.jsonl line per engine and batch of rows[start:] (tokens/s, against HF generate static+compile
    at the same batch when it ran in this call; the compiled engine also against the uncompiled one), and the
    weight sync's seconds per GB."""
    import results as bench_results

    ok = [r for r in rows if "tokens_per_s" in r]
    base = {r["batch"]: r["tokens_per_s"] for r in ok if r["engine"] == HF_GENERATE}
    uncompiled = {r["batch"]: r["tokens_per_s"] for r in ok if r["engine"] == UNCOMPILED}
    for r in [r for r in rows[start:] if "tokens_per_s" in r]:
        shape = f"{a.model}, batch {r['batch']}, {a.prompt_len}+{a.new_tokens} tokens, bf16, temperature 1"
        kw = {}
        if r["engine"] != HF_GENERATE and r["batch"] in base:
            kw = {"baseline": f"{HF_GENERATE} batch {r['batch']}", "baseline_value": base[r["batch"]], "same_run": True}
        bench_results.record(f"rollout {r['engine']}", shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card, **kw)
        whole = {x["batch"]: x["tokens_per_s"] for x in ok if x["engine"] == WHOLE_CACHE}
        if r["engine"] == COMPILED and r["batch"] in whole:
            bench_results.record(f"rollout {r['engine']}", shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card,
                                 baseline=f"{WHOLE_CACHE} batch {r['batch']}", baseline_value=whole[r["batch"]],
                                 same_run=True)
        separate = [x["tokens_per_s"] for x in ok if x["engine"] == SEPARATE and x["batch"] == r["batch"]]
        if r["engine"] == COMPILED and separate:
            bench_results.record(f"rollout {r['engine']}", shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card,
                                 baseline=f"{SEPARATE} batch {r['batch']}", baseline_value=separate[0], same_run=True)
        if r["engine"] == COMPILED and r["batch"] in uncompiled:
            bench_results.record(f"rollout {r['engine']}", shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card,
                                 baseline=f"{UNCOMPILED} batch {r['batch']}", baseline_value=uncompiled[r["batch"]],
                                 same_run=True)
    if weight_sync:
        bench_results.record("weight_sync hf-static", f"{a.model}, {weight_sync['gb']:.2f} GB bf16 on the GPU",
                             "seconds_per_gb", weight_sync["s_per_gb"], "s/GB", card=card)


def probe_child(a) -> int:
    """One fresh process of --compile-probe: the compiled engine's first call (compile + capture + decode) and a
    second call, and with --probe-sweep the dynamo compiles and seconds of calls at other prompt widths. Prints
    one ``PROBE {json}`` line."""
    import torch
    from rljob_worker.rollout import SamplingParams
    from rljob_worker.rollout.hf_static_engine import HFStaticEngine, dynamo_compiles

    t0 = time.perf_counter()
    on_gpu = torch.cuda.is_available()  # CPU: smoke test only
    engine = HFStaticEngine(a.probe_child, dtype=torch.bfloat16 if on_gpu else torch.float32,
                            device=torch.device("cuda" if on_gpu else "cpu"), eos_token_id=a.vocab, pad_token_id=0,
                            compile_decode=True)
    out = {"load_s": time.perf_counter() - t0, "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
    batch = prompts(a.probe_batch, a.prompt_len, a.vocab, 7)
    out["first_call_s"] = timed_generate(engine, batch, params)
    out["compiles_first_call"] = dynamo_compiles()
    out["steady_call_s"] = min(timed_generate(engine, batch, params) for _ in range(2))
    if a.probe_sweep:
        sweep, before = [], dynamo_compiles()
        for i, width in enumerate(PROBE_WIDTHS):  # rows of one call vary in length below the call's widest
            rows_ = [p[: width - (j % 16)] for j, p in enumerate(prompts(a.probe_batch, width, a.vocab, 100 + i))]
            t = timed_generate(engine, rows_, params)
            sweep.append({"width": width, "s": t, "compiles": dynamo_compiles() - before,
                          "again_s": timed_generate(engine, rows_, params)})  # the same call once more: steady
            print("probe sweep:", sweep[-1], flush=True)
        out["sweep"] = sweep
        out["sweep_recompiles"] = dynamo_compiles() - before
        out["sweep_extra_s"] = sum(max(0.0, r["s"] - r["again_s"]) for r in sweep)
        out["graph_captures"] = engine.graph_captures
    print("PROBE " + json.dumps(out), flush=True)
    return 0


def compile_probe(a, model_dir: str, card: str) -> dict:
    """--compile-probe: two fresh processes sharing one new TORCHINDUCTOR_CACHE_DIR (cold, then warm)."""
    import results as bench_results

    cache = tempfile.mkdtemp(prefix="rollout_probe_inductor_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    found = {}
    for name, extra in (("cold", ["--probe-sweep"]), ("warm", [])):
        cmd = [sys.executable, __file__, "--probe-child", model_dir, "--vocab", str(a.vocab), "--new-tokens",
               str(a.new_tokens), "--prompt-len", str(a.prompt_len), "--probe-batch", str(a.probe_batch),
               "--model", a.model, *extra]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
        lines = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{name} probe failed (rc {done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        found[name] = {**json.loads(lines[-1][len("PROBE "):]), "process_s": time.perf_counter() - t0}
        print(f"compile probe ({name} cache):", found[name], flush=True)
    shape = f"{a.model}, batch {a.probe_batch}, {a.prompt_len}+{a.new_tokens} tokens, bf16, compiled static engine"
    cold, warm = found["cold"], found["warm"]
    bench_results.record("rollout first call, compile cache cold", shape, "first_call_s", cold["first_call_s"], "s",
                         card=card)
    bench_results.record("rollout first call, compile cache warm (second process)", shape, "first_call_s",
                         warm["first_call_s"], "s", card=card, baseline="first call, cold cache",
                         baseline_value=cold["first_call_s"], same_run=True)
    bench_results.record("rollout steady call", shape, "call_s", cold["steady_call_s"], "s", card=card)
    widths = f"{shape}, {len(PROBE_WIDTHS)} prompt widths {min(PROBE_WIDTHS)}-{max(PROBE_WIDTHS)}"
    bench_results.record("rollout recompiles over prompt widths", widths, "dynamo_compiles", cold["sweep_recompiles"],
                         "count", card=card)
    bench_results.record("rollout first-call seconds over a repeated call, all widths together", widths, "extra_s",
                         cold["sweep_extra_s"], "s", card=card)
    return found


if __name__ == "__main__":
    sys.exit(main())
