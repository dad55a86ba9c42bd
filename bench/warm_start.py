"""First step of a new pod against a warm step (issue 35): cold compile vs the compile cache restored from the
job's storage (spec.checkpoint.compileCache).

Each "pod" is a real `rljob run` of the same job (GRPO at the grpo_step workload: random-init model, 32 prompts
x 8, 128 + 256 tokens, the static engine with its decode step compiled) with its own, initially empty, cache
folders (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, VLLM_CACHE_ROOT) and one shared checkpoint store:

- ``cold``: nothing stored yet: the first rollout compiles the decode step (by layer, the default); its caches
  are uploaded after it.
- ``restored``: a new pod: start-up restores the archive and the first step traces every region again, loading its
  kernels from inductor's cache.
- ``restoredpre`` / ``coldpre``: restored / cold with ``RLJOB_PRECOMPILE=1`` and a store of their own (the decode
  regions precompiled ahead of time and loaded without a dynamo trace: rollout/precompiled).
- ``restarted``: the same pod's folders again (a container restart: the emptyDir kept them).
- ``nocompile``: compile off, cold (what a first step costs without any compile: CUDA graph capture,
  allocator and library warm-up).
- ``coldstep``: cold, the whole decode step compiled as one graph (``RLJOB_COMPILE_SCOPE=step``, the default
  before session 11): the baseline of the by-layer compile, first step and warm step.
- ``coldvllm`` / ``restoredvllm``: the same job on the vLLM engine (``gpuMemoryUtilization`` 0.3), with a store
  of its own: vLLM compiles the model and captures its CUDA graphs while it is built (start-up), so for these
  pods ``ready_s`` (start-up + first step) is the number to compare, and the start-up lines show the model
  build's share. The restored pod unpacks the cold pod's archive (vLLM's compile cache under VLLM_CACHE_ROOT).
  ``restoredvllmkeep``: restored, the engine keeping a host copy of its weights while asleep
  (``RLJOB_VLLM_SLEEP_LEVEL=1``; the default, level 2, drops them and the weight sync refills them).
  ``coldvllmall`` / ``restoredvllmall``: the same with vLLM's own CUDA-graph sizes (``RLJOB_VLLM_CAPTURE=all``:
  up to 512 rows, not up to the 256 a step decodes) and a store of their own (the sizes are in vLLM's cache key).
- ``restoredprof`` / ``restoredpreprof`` / ``restoredvllmprof``: another new pod restored from storage, 2 steps,
  every process under cProfile (bench/profile_site): the worker's profile and its top functions by cumulative
  time go to $OUT/cprofile/.

Each pod also reports ``ready_s``: its start-up phases (the lines ``start-up: <phase> <s>``) and its first step
together, so that work moved from the first step into start-up is still counted.

First-step / warm-step ratios go to results.jsonl; warm = the median of the later steps that ran the compiled
decode step (``rollout/decode_compiled``), so a pod still compiling is compared with what it will run at.

    python bench/warm_start.py [--model 0.5b] [--steps 12] [--pods cold,restored,nocompile,coldstep] [--lora RANK]

``--model 7b --lora 32``: all 28 layers of Qwen2.5-7B's shape on one GPU, its weights frozen (full fine-tuning's
optimizer state does not fit one GPU; ``7b-half`` is the full fine-tuning stand-in at half the layers).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pods", default="cold,restored,nocompile,coldstep")
    ap.add_argument("--timeout-each", type=float, default=420)
    ap.add_argument("--lora", type=int, default=0, help="spec.lora rank (alpha the same); 0: full fine-tuning")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: 2 prompts x 2, 8 tokens")
    a = ap.parse_args()

    import grpo_step
    import torch

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="warm_start_"))
    gargs = argparse.Namespace(prompts=32, n=8, prompt_len=128, new_tokens=256, mbs=16, kl_coef=0.0, warmup=0,
                               steps=a.steps, child="rljob-compiled")
    vocab = grpo_step.VOCAB
    if a.smoke:
        gargs.prompts, gargs.n, gargs.prompt_len, gargs.new_tokens, gargs.mbs, vocab = 2, 2, 8, 8, 2, 64
        grpo_step.EOS_ID = vocab
    paths = grpo_step.prepare(root / "data", a.model, gargs.prompts * a.steps, gargs.prompt_len,
                              vocab)
    spec = grpo_step.rljob_spec(gargs, paths, root)
    if a.smoke:
        spec["device"] = "cpu"
    spec["checkpoint"] = {"uri": f"file://{root}/store", "saveFreq": 0, "exportHf": False}
    spec["rollout"]["compile"] = "enabled"
    if a.lora:  # the base frozen: a whole 7B model trains on one GPU
        spec["lora"] = {"rank": a.lora, "alpha": a.lora}
        spec["training"]["lr"] = 1e-5  # LoRA's range (validation warns below it)
    doc = {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "warmstart"}, "spec": spec}
    job = root / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "VLLM_CACHE", "RLJOB_HF_STATIC"))}

    import results as bench_results

    shape = (f"{a.model}{f' LoRA rank {a.lora}' if a.lora else ''} random init, GRPO 32 prompts x 8, 128 + 256 tokens, bf16, static engine with the decode "
             f"step compiled, one `rljob run` per pod, {a.steps} steps; warm = median of the "
             "later steps with the compiled decode step")
    rows = {}
    for pod in a.pods.split(","):
        cache = root / ("pod-restored" if pod in ("restored", "restarted") else f"pod-{pod}")
        # the pre pods keep a store of their own: an archive with precompiled regions is not the others' path
        profiled, pre, vllm = pod.endswith("prof"), "pre" in pod, "vllm" in pod
        profile_dir = Path(os.environ.get("OUT", root)) / "cprofile" / pod
        pod_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
                   "VLLM_CACHE_ROOT": str(cache / "vllm"), "RLJOB_HF_STATIC_COMPILE": "0" if pod == "nocompile" else "1",
                   "RLJOB_COMPILE_SCOPE": "step" if pod == "coldstep" else "layer",
                   "RLJOB_PRECOMPILE": "1" if pre else "0", "RLJOB_VLLM_CAPTURE": "all" if "vllmall" in pod else "rollout",
                   "RLJOB_VLLM_SLEEP_LEVEL": "1" if pod.endswith("keep") else "2"}
        if profiled:
            profile_dir.mkdir(parents=True, exist_ok=True)
            pod_env["RLJOB_BENCH_CPROFILE_DIR"] = str(profile_dir)
            pod_env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "profile_site"), env.get("PYTHONPATH", "")])
        pod_job = job
        if pod == "coldstep" or pre or vllm:  # a store of its own: the default pods' archive is not its cache
            store = "step" if pod == "coldstep" else "pre" if pre else "vllmall" if "vllmall" in pod else "vllm"
            job_doc = yaml.safe_load(job.read_text())
            job_doc["spec"]["checkpoint"]["uri"] = f"file://{root}/store-{store}"
            if vllm:
                job_doc["spec"]["rollout"].update(engine="vllm", gpuMemoryUtilization=0.3)
                job_doc["spec"]["rollout"].pop("compile", None)
            pod_job = root / f"job-{store}.yaml"
            pod_job.write_text(yaml.safe_dump(job_doc))
        steps = 2 if profiled else a.steps
        workdir = root / f"run-{pod}"
        shutil.rmtree(workdir, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(pod_job), "--workdir",
                                   str(workdir), "--steps", str(steps)], env=pod_env, capture_output=True,
                                  text=True, timeout=a.timeout_each, check=False)
        except subprocess.TimeoutExpired as exc:
            print(f"== {pod}: no result within {a.timeout_each:.0f}s\n{(exc.stdout or b'')[-3000:]!r}", flush=True)
            continue
        wall = time.perf_counter() - t0
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("compile cache:", "first step", "start-up:"))]
        lines += [ln for ln in proc.stderr.splitlines() if "compil" in ln and ("decode step" in ln or "precompiled" in ln)]
        lines += [ln for ln in (proc.stdout + proc.stderr).splitlines() if any(w in ln for w in VLLM_TIMING_LINES)]
        logs = Path(os.environ.get("OUT", root)) / "warm_start_logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{pod}.txt").write_text(f"{proc.stdout}\n--- stderr ---\n{proc.stderr}")
        print(f"== {pod}: rc {proc.returncode}, {wall:.1f}s\n  " + "\n  ".join(lines), flush=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
            continue
        if profiled:
            summarize_profiles(profile_dir)
        steps = [json.loads(ln) for ln in (workdir / "work" / "metrics.jsonl").read_text().splitlines()]
        compiled = [s.get("rollout/decode_compiled", 1.0) for s in steps]  # absent: compile off
        times = [s["timing/step_s"] for s in steps]
        rollout = [s.get("timing/rollout_s") for s in steps]
        # engine vs trainer log-probs after each weight sync: a sync that left a weight wrong shows here
        mismatch = [round(s["rollout/logprob_mismatch_mean"], 4) for s in steps if "rollout/logprob_mismatch_mean" in s]
        later = [i for i in range(1, len(steps)) if compiled[i]]
        if profiled:  # profiled: its times are not the pod's
            print(json.dumps({"first_s": times[0], "first_rollout_s": rollout[0]}), flush=True)
            continue
        if pod != "nocompile" and not later:
            print(f"== {pod}: the compile did not finish within {len(steps)} steps", flush=True)
            continue
        later = later or list(range(1, len(steps)))
        warm = statistics.median(times[i] for i in later)
        startup = startup_seconds(proc.stdout)
        rows[pod] = {"first_s": times[0], "warm_s": warm, "ratio": times[0] / warm, "wall_s": wall,
                     "startup_s": startup, "ready_s": startup + times[0],
                     "first_rollout_s": rollout[0], "warm_rollout_s": statistics.median(rollout[i] for i in later),
                     "uncompiled_steps": compiled.count(0.0), "step2_s": times[1] if len(times) > 1 else None, "logprob_mismatch": mismatch,
                     "sync_s": [s.get("timing/weight_sync_s") for s in steps],
                     "uncompiled_median_s": statistics.median(t for t, c in zip(times, compiled) if not c)
                     if compiled.count(0.0) > 1 else None, "lines": lines}
        print(json.dumps({k: v for k, v in rows[pod].items() if k != "lines"}), flush=True)
        bench_results.record(f"first step of a new pod ({pod})", vllm_shape(shape) if vllm else shape, "first_step_s",
                             rows[pod]["first_s"], "s",
                             card=card, baseline=f"warm step of the same run ({pod})",
                             baseline_value=rows[pod]["warm_s"], same_run=True)
        if vllm:  # vLLM compiles while it is built: start-up counts
            bench_results.record(f"start-up + first step of a new pod ({pod})", vllm_shape(shape), "ready_s",
                                 rows[pod]["ready_s"], "s", card=card, baseline=f"warm step of the same run ({pod})",
                                 baseline_value=rows[pod]["warm_s"], same_run=True)
        record_pairs(rows, pod, shape, card)  # as soon as both pods ran: a later pod cut by a limit loses nothing
    archives = [a for store in ("store", "store-vllm", "store-vllmall")
                for a in (root / store).rglob("compile-cache/*.tar")]
    sizes = [p.stat().st_size / 2**20 for p in archives]
    print(f"archives: {[p.name for p in archives]} {[round(s, 1) for s in sizes]} MiB", flush=True)
    (Path(os.environ.get("OUT", ".")) / "warm_start.json").write_text(json.dumps(
        {"card": card, "model": a.model, "lora": a.lora, "rows": rows, "archive_mib": sizes}, indent=1))
    return 0


# (pod, baseline pod, metric, what, baseline's words): each recorded once both pods of the pair have run
PAIRS = [
    ("restored", "cold", "first_s", "first step, compile cache restored from storage", "first step, cold pod"),
    ("restoredvllm", "coldvllm", "ready_s", "start-up + first step, vLLM compile cache restored from storage",
     "start-up + first step, cold vLLM pod"),
    ("restoredvllm", "restoredvllmall", "ready_s",
     ("start-up + first step, restored vLLM pod, CUDA graphs up to a step's rows"),
     "the same, vLLM's own CUDA-graph sizes (RLJOB_VLLM_CAPTURE=all)"),
    ("restoredvllm", "restoredvllmkeep", "first_s", "first step, restored vLLM pod, weights dropped while asleep",
     "the same, a host copy of the weights kept while asleep (RLJOB_VLLM_SLEEP_LEVEL=1)"),
    ("restoredpre", "restored", "first_s", "first step, restored pod, decode regions precompiled",
     "first step, restored pod, plain torch.compile (RLJOB_PRECOMPILE=0)"),
    ("coldpre", "cold", "first_s", "first step, cold pod, decode regions precompiled and saved",
     "first step, cold pod, plain torch.compile (RLJOB_PRECOMPILE=0)"),
]


def record_pairs(rows: dict, pod: str, shape: str, card: str) -> None:
    """The comparisons that ``pod`` completes (its pair's other pod ran before it)."""
    import results as bench_results

    for measured, baseline, key, what, words in PAIRS:
        if pod in (measured, baseline) and measured in rows and baseline in rows:
            bench_results.record(what, vllm_shape(shape) if "vllm" in measured else shape,
                                 "first_step_s" if key == "first_s" else key, rows[measured][key], "s", card=card,
                                 baseline=words, baseline_value=rows[baseline][key], same_run=True)


def vllm_shape(shape: str) -> str:
    return shape.replace("static engine with the decode step compiled", "vLLM engine (gpuMemoryUtilization 0.3)")


# vLLM's own start-up timings (0.26: the model runner, the engine core and the compile monitor log them)
VLLM_TIMING_LINES = ("Model loading took", "torch.compile took", "Graph capturing finished", "init engine (",
                     "Loading weights took", "Dynamo bytecode transform", "Directly load the compiled graph",
                     "Compiling a graph for")


def startup_seconds(stdout: str) -> float:
    """A worker's start-up: the sum of its ``start-up: <phase> <s>s`` lines."""
    phases = (re.fullmatch(r"start-up: .+ ([0-9.]+)s", line.strip()) for line in stdout.splitlines())
    return sum(float(m.group(1)) for m in phases if m)


def summarize_profiles(profile_dir: Path) -> None:
    """The largest profile is the worker's (the CLI and torchrun only wait): its top functions by cumulative
    time into <dir>/worker_top.txt; the others are deleted."""
    import io
    import pstats

    profiles = sorted(profile_dir.glob("*.prof"), key=lambda p: p.stat().st_size)
    if not profiles:
        print(f"== {profile_dir.name}: no profile written", flush=True)
        return
    for p in profiles[:-1]:
        p.unlink()
    text = io.StringIO()
    stats = pstats.Stats(str(profiles[-1]), stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    # the first rollout's parts: the engine's compile, load, capture and prefill, and what torch does under them
    stats.sort_stats("cumulative").print_stats(
        r"hf_static_engine|precompiled|aot_compile|package|convert_frame|codecache|async_compile|graphs\.py", 60)
    # a vLLM pod's start-up: its engine core's phases (model load, compile, memory profile, KV cache, graphs)
    stats.sort_stats("cumulative").print_stats(
        r"vllm_engine|gpu_model_runner|gpu_worker|engine/core|compilation/|cuda_graph|cudagraph", 60)
    (profile_dir / "worker_top.txt").write_text(text.getvalue())
    print(text.getvalue()[:3000], flush=True)


if __name__ == "__main__":
    sys.exit(main())
