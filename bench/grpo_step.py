"""A whole GRPO step: rljob's real GRPOTrainer vs TRL's GRPOTrainer, same workload, same card.

    python bench/grpo_step.py --variants rljob-static,trl,rljob-hf [--model 0.5b --out DIR]

Workload (BASELINES.md's TRL baseline): Qwen2.5-0.5B shape, random init, bf16; 32 prompts x 8
samples per step, 128-token prompts, exactly 256 new tokens (the EOS id is 151936, one past the
model's vocabulary, so no sample can end early; TRL's completion lengths are printed to prove it),
beta 0 (no reference model), one optimizer step per rollout batch. A word-level tokenizer over
"w<id>" words is built in code (no downloads); prompts come from a parquet file; the reward is the
fraction of even word ids in the completion (cheap, and it varies, so advantages are not zero).

Each variant runs in its own process (megatron's parallel state is process-global):
- ``rljob-hf`` / ``rljob-static``: ``GRPOTrainer.setup()`` from a spec (megatron actor, the HF
  engine, or the static-cache CUDA-graph engine via RLJOB_HF_STATIC=1; weight sync after every
  update; metrics server off; no checkpoints), then ``train_step()`` warm-up + timed steps, each
  timed like ``fit()`` does, with the trainer's telemetry stages (rollout [reward nested in it],
  old_logprob, actor_update, weight_sync; other = the rest);
- ``trl``: TRL ``GRPOTrainer`` with its defaults (gradient checkpointing on, as TRL defaults),
  per-device batch 8 x 32 accumulation = 256 completions per optimizer step; step time between
  consecutive ``on_step_end`` callbacks. ``trl-nockpt``: the same with gradient checkpointing off.
- ``rljob-compiled``: ``rljob-static`` with the decode step compiled (RLJOB_HF_STATIC_COMPILE=1; the
  first rollout, a warm-up step, pays the compile).
- ``rljob-vllm``: the real vLLM engine (0.26, CUDA graphs; sleep level 1 during the update; bucketed
  weight sync each step) with ``gpuMemoryUtilization`` --vllm-gpu-memory-utilization (0.3);
- ``rljob-static:32``: any rljob variant with its micro-batch (update and log-prob) overridden.

tokens/s = (prompt + completion tokens per step) / median step seconds. Output: a table and
``grpo_step.json`` under --out.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for p in (REPO / "operator", REPO / "worker", BENCH):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

VOCAB = 151936
PAD_ID, EOS_ID = 0, VOCAB  # EOS one past the model's vocabulary: never sampled


# ------------------------------------------------------------------------------------ reward (both)


def _even_fraction(completion: str) -> float:
    words = completion.split()
    if not words:
        return 0.0
    return sum(1 for w in words if w[1:].isdigit() and int(w[1:]) % 2 == 0) / len(words)


def word_parity_reward(prompt: str, completion: str, ground_truth: str, extra: dict) -> float:
    """rljob reward signature: (prompt, completion, ground_truth, extra) -> float."""
    return _even_fraction(completion)


def trl_word_parity_reward(prompts, completions, **kwargs) -> list[float]:
    return [_even_fraction(c) for c in completions]


# ------------------------------------------------------------------------------------ preparation


def build_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD_ID, **{f"w{i}": i for i in range(1, vocab)}, "<eos>": vocab}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def prepare(root: Path, model: str, num_prompts: int, prompt_len: int, vocab: int) -> dict:
    """Random-init model folder (config, safetensors, tokenizer) and the prompt parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from actor_update import qwen_config
    from transformers import AutoModelForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    cfg = qwen_config(model, vocab)
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = vocab, PAD_ID, None
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = vocab, PAD_ID
    m.generation_config.bos_token_id = None
    m.save_pretrained(model_dir)
    del m
    if dev == "cuda":
        torch.cuda.empty_cache()  # the driver process keeps no model memory while the variants run
    # its own folder: next to a qwen2 config.json, AutoTokenizer would pick Qwen2Tokenizer instead
    build_tokenizer(vocab).save_pretrained(root / "tokenizer")
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{i}" for i in torch.randint(1, vocab, (prompt_len,), generator=g).tolist())
               for _ in range(num_prompts)]
    pq.write_table(pa.table({"prompt": prompts, "data_source": ["bench"] * num_prompts}), root / "prompts.parquet")
    return {"model_dir": str(model_dir), "tokenizer_dir": str(root / "tokenizer"),
            "parquet": str(root / "prompts.parquet")}


# ------------------------------------------------------------------------------------ rljob


def rljob_spec(a, paths: dict, workdir: Path) -> dict:
    return {
        "device": "gpu", "nnodes": 1, "gpusPerNode": 1,
        "model": {"path": paths["model_dir"], "tokenizerPath": paths["tokenizer_dir"], "dtype": "bfloat16"},
        "data": {"trainFiles": [paths["parquet"]], "maxPromptLength": a.prompt_len, "maxResponseLength": a.new_tokens,
                 "applyChatTemplate": False, "shuffle": False},
        "algorithm": {"klCoef": a.kl_coef, "lossAggregation": "token-mean"},
        "rollout": {"engine": "hf", "samplesPerPrompt": a.n, "temperature": 1.0, "logProbMicroBatchSizePerGpu": a.mbs,
                    **({"engine": "vllm", "gpuMemoryUtilization": a.vllm_gpu_memory_utilization}
                       if getattr(a, "child", None) == "rljob-vllm" else {})},
        "training": {"trainBatchSizePerNode": a.prompts, "ppoMiniBatchSizePerNode": a.prompts,
                     "microBatchSizePerGpu": a.mbs, "lr": 1e-6, "weightDecay": 0.0,
                     "totalTrainingSteps": a.warmup + a.steps, "testFreq": -1, "valBeforeTrain": False, "seed": 1},
        "megatron": {"useDistributedOptimizer": False},
        "reward": {"function": "grpo_step:word_parity_reward"},
        "checkpoint": {"uri": f"file://{workdir}/ckpt", "saveFreq": -1, "exportHf": False, "resumeMode": "disable"},
        "metrics": {"enabled": False},
    }


def run_rljob(a, paths: dict) -> dict:
    import torch
    from rljob_api.validation import parse_spec
    from rljob_worker.run_loop import RunContext
    from rljob_worker.trainers.grpo import GRPOTrainer

    workdir = Path(tempfile.mkdtemp(prefix="rljob_bench_"))
    os.environ.setdefault("RLJOB_METRICS_PORT", "0")
    spec = parse_spec(rljob_spec(a, paths, workdir))
    t0 = time.perf_counter()
    trainer = GRPOTrainer(spec, RunContext(job_name="bench", namespace="bench", workdir=workdir,
                                           max_steps=a.warmup + a.steps))
    trainer.setup()
    setup_s = time.perf_counter() - t0
    engine = type(trainer.engine).__name__

    stage_times: dict[str, float] = {}
    real_stage = trainer.telemetry.stage

    @contextlib.contextmanager
    def timed_stage(name):
        start = time.perf_counter()
        with real_stage(name):
            yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stage_times[name] = stage_times.get(name, 0.0) + time.perf_counter() - start

    trainer.telemetry.stage = timed_stage
    steps = []
    for i in range(a.warmup + a.steps):
        stage_times.clear()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.step += 1
        metrics = trainer.train_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - start
        top = {k: v for k, v in stage_times.items() if k != "reward"}
        record = {"step_s": dt, **{f"stage/{k}": v for k, v in stage_times.items()},
                  "stage/other": dt - sum(top.values()),
                  "response_length_mean": metrics.get("response_length/mean"),
                  "reward_mean": metrics.get("reward/mean"), "grad_norm": metrics.get("actor/grad_norm"),
                  "logprob_mismatch": metrics.get("rollout/logprob_mismatch_mean"),
                  "rollout_tok_s": metrics.get("throughput/rollout_tokens_per_s"),
                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
        print(f"  step {i}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()})}",
              flush=True)
        steps.append(record)
    extra = {"graph_captures": getattr(trainer.engine, "graph_captures", None)}
    if hasattr(trainer.engine, "metrics"):  # vLLM: start-up seconds and the last weight sync's size and rate
        extra["engine_metrics"] = trainer.engine.metrics()
    trainer.telemetry.close()
    return {"engine": engine, "mbs": a.mbs, "setup_s": setup_s, "steps": steps, **extra}


# ------------------------------------------------------------------------------------ TRL


def run_trl(a, paths: dict, gradient_checkpointing: bool | None) -> dict:
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    on_gpu = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(paths["tokenizer_dir"])
    model = AutoModelForCausalLM.from_pretrained(paths["model_dir"], dtype=torch.bfloat16 if on_gpu else torch.float32,
                                                 attn_implementation="sdpa")
    prompts = pq.read_table(paths["parquet"]).column("prompt").to_pylist()
    ds = Dataset.from_dict({"prompt": prompts})
    completions_per_step = a.prompts * a.n
    kw = {}
    if gradient_checkpointing is not None:
        kw["gradient_checkpointing"] = gradient_checkpointing
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl_bench_"), per_device_train_batch_size=a.trl_mbs,
                     gradient_accumulation_steps=completions_per_step // a.trl_mbs, num_generations=a.n,
                     max_completion_length=a.new_tokens, beta=a.kl_coef, bf16=on_gpu, learning_rate=1e-6,
                     max_steps=a.warmup + a.steps, logging_steps=1, save_strategy="no", report_to="none",
                     temperature=1.0, seed=1, dataloader_num_workers=0, use_cpu=not on_gpu, **kw)
    times, lengths = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **k):
            if not times:
                if on_gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **k):
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter())
            print(f"  trl step {len(times) - 1}: {times[-1] - times[-2]:.3f}s", flush=True)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append((logs["completions/mean_length"], logs.get("completions/min_length")))

    trainer = GRPOTrainer(model=model, reward_funcs=trl_word_parity_reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Timer()])
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    step_s = [t1 - t0 for t0, t1 in itertools.pairwise(times)]
    return {"engine": "trl", "mbs": a.trl_mbs, "gradient_checkpointing": cfg.gradient_checkpointing,
            "steps": [{"step_s": s} for s in step_s], "completion_lengths": lengths,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None}


# ------------------------------------------------------------------------------------ driver


def summarize(name: str, res: dict, a) -> dict:
    tokens = a.prompts * a.n * (a.prompt_len + a.new_tokens)
    timed = res["steps"][a.warmup:] or res["steps"]
    med = statistics.median(s["step_s"] for s in timed)
    out = {"variant": name, "engine": res.get("engine"), "mbs": res.get("mbs"), "step_s_median": med, "first_step_s": res["steps"][0]["step_s"],
           "tokens_per_step": tokens, "tokens_per_s": tokens / med, "timed_steps": len(timed)}
    stages = sorted({k for s in timed for k in s if k.startswith("stage/")})
    for k in stages:
        out[k] = statistics.median(s.get(k, 0.0) for s in timed)
    for k in ("rollout_tok_s", "response_length_mean", "peak_gib", "logprob_mismatch"):
        vals = [s[k] for s in timed if s.get(k) is not None]
        if vals:
            out[k] = statistics.median(vals)
    if res.get("peak_gib") is not None:
        out["peak_gib"] = res["peak_gib"]
    for k in ("setup_s", "gradient_checkpointing", "completion_lengths", "graph_captures", "engine_metrics"):
        if k in res:
            out[k] = res[k]
    return out


def print_table(card: str, a, rows: list[dict]) -> None:
    print(f"\n## GRPO step, {a.model}, {a.prompts} prompts x {a.n}, {a.prompt_len}+{a.new_tokens} tokens, "
          f"beta {a.kl_coef}, bf16, {card}")
    print("| variant | step s (median) | tokens/s | vs TRL | rollout | (reward) | old_logprob | ref_logprob | "
          "actor_update | weight_sync | other | rollout tok/s | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    trl = next((r["tokens_per_s"] for r in rows if str(r.get("variant", "")).startswith("trl") and "tokens_per_s" in r), None)

    def f(r, k, spec=".2f"):
        return format(r[k], spec) if r.get(k) is not None else "-"

    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | ERROR {r['error'][:100]} |" + " |" * 11)
            continue
        ratio = f"{r['tokens_per_s'] / trl:.2f}x" if trl else "-"
        print(f"| {r['variant']} ({r.get('engine')}, mbs {r.get('mbs')}) | {r['step_s_median']:.2f} | {r['tokens_per_s']:,.0f} | {ratio} | "
              f"{f(r, 'stage/rollout')} | {f(r, 'stage/reward')} | {f(r, 'stage/old_logprob')} | "
              f"{f(r, 'stage/ref_logprob')} | {f(r, 'stage/actor_update')} | {f(r, 'stage/weight_sync')} | "
              f"{f(r, 'stage/other')} | {f(r, 'rollout_tok_s', ',.0f')} | {f(r, 'peak_gib', '.1f')} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="rljob-static,trl,rljob-hf")
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=16, help="rljob micro-batch (update and log-prob)")
    ap.add_argument("--trl-mbs", type=int, default=8)
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variant list this many times in turn (rljob, TRL, rljob, TRL, ...); each "
                         "round's ratios are against that round's baseline, so drift of the card or host "
                         "between variants shows as spread across rounds instead of as one ratio")
    ap.add_argument("--timeout-each", type=float, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    a = ap.parse_args()
    global EOS_ID
    EOS_ID = a.vocab

    if a.child:  # one variant, in its own process; "rljob-static:32" overrides the micro-batch
        paths = json.loads(a.paths)
        # "rljob-compiled:16@auto": the actor's attention kernel order (flash | auto); "@rows": micro-batches
        # in the rows layout (RLJOB_SEQUENCE_PACKING=off) instead of concatenated; "@release": the static engine's
        # cache freed after every rollout; "@separate": its q/k/v and gate/up unfused
        a.child, *options = a.child.split("@")
        for option in options:
            if option == "rows":
                os.environ["RLJOB_SEQUENCE_PACKING"] = "off"
            elif option == "release":  # the static engine frees its cache and graphs after every rollout
                os.environ["RLJOB_ROLLOUT_CACHE"] = "release"
            elif option == "separate":  # q/k/v and gate/up as separate GEMMs in the static engine
                os.environ["RLJOB_FUSE_PROJECTIONS"] = "0"
            else:
                os.environ["RLJOB_ATTENTION_BACKEND"] = option
        if ":" in a.child:
            a.child, mbs = a.child.split(":", 1)
            a.mbs = int(mbs)
        if a.child.startswith("rljob"):
            os.environ["RLJOB_HF_STATIC"] = "1" if a.child in ("rljob-static", "rljob-compiled") else "0"
            os.environ["RLJOB_HF_STATIC_COMPILE"] = "1" if a.child == "rljob-compiled" else "0"
            res = run_rljob(a, paths)
        else:
            res = run_trl(a, paths, gradient_checkpointing=False if a.child == "trl-nockpt" else None)
        Path(paths["result"]).write_text(json.dumps(res))
        return 0

    import torch

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    t0 = time.perf_counter()
    paths = prepare(root, a.model, a.prompts * (a.warmup + a.steps), a.prompt_len, a.vocab)
    print(f"prepared {a.model} model + prompts in {time.perf_counter() - t0:.1f}s on {card}", flush=True)
    rows = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                   if k not in ("variants", "child", "paths", "out", "timeout_each", "tag", "rounds")]
    for round_index, variant in ((r, v) for r in range(a.rounds) for v in a.variants.split(",")):
        result_file = root / f"{variant.replace(':', '_mbs')}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), f"--child={variant}",
               f"--paths={json.dumps({**paths, 'result': str(result_file)})}", *passthrough]
        print(f"== {variant}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=a.timeout_each, check=False)
            if proc.returncode != 0 or not result_file.exists():
                raise RuntimeError(f"exit code {proc.returncode}")
            res = json.loads(result_file.read_text())
            row = summarize(variant, res, a)
        except Exception as exc:  # noqa: BLE001 - report and continue with the next variant
            traceback.print_exc()
            row = {"variant": variant, "error": f"{type(exc).__name__}: {exc}"}
        row["wall_s"] = time.perf_counter() - t0
        row["round"] = round_index
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / f"grpo_step{a.tag}.json").write_text(json.dumps({"card": card, "args": vars(a), "rows": rows},
                                                               indent=1))
    for round_index in range(a.rounds):
        round_rows = [r for r in rows if r["round"] == round_index]
        if a.rounds > 1:
            print(f"\n### round {round_index + 1} of {a.rounds}")
        print_table(card, a, round_rows)
        record_results(card, a, round_rows, round_index if a.rounds > 1 else None)
    return 0


def record_results(card: str, a, rows: list[dict], round_index: int | None = None) -> None:
    """One results.jsonl line per rljob variant and TRL baseline measured in this run (tokens/s); with
    rounds, one set per round, each against its own round's baseline."""
    import results as bench_results

    ok = [r for r in rows if "tokens_per_s" in r]
    shape = (f"{a.model}, {a.prompts} prompts x {a.n}, {a.prompt_len}+{a.new_tokens} tokens, beta {a.kl_coef}, "
             f"bf16" + (f", response lengths {os.environ['RLJOB_SYNTHETIC_LENGTHS']} capped at {a.new_tokens}"
                        if os.environ.get("RLJOB_SYNTHETIC_LENGTHS") else "")
             + (f", round {round_index + 1} of {a.rounds}" if round_index is not None else ""))
    trls = [r for r in ok if r["variant"].startswith("trl")]
    by_variant = {r["variant"]: r for r in ok}
    for r in ok:
        # flash first against torch's attention kernel order; concatenated against rows micro-batches
        for other in (by_variant.get(r["variant"].split("@")[0] + "@auto"),
                      *(by_variant.get(r["variant"] + suffix) for suffix in ("@rows", "@release", "@separate"))):
            if other is not None and other is not r:
                bench_results.record(f"grpo_step {r['variant']}", shape, "tokens_per_s", r["tokens_per_s"], "tok/s",
                                     card=card, baseline=other["variant"], baseline_value=other["tokens_per_s"],
                                     same_run=True)
        name = f"grpo_step {r['variant']}" + (f" ({r['engine']}, mbs {r['mbs']})" if r.get("engine") else "")
        if r["variant"].startswith("trl") or not trls:
            bench_results.record(name, shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card)
        for t in trls if not r["variant"].startswith("trl") else []:
            bench_results.record(name, shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card,
                                 baseline=t["variant"], baseline_value=t["tokens_per_s"], same_run=True)


if __name__ == "__main__":
    sys.exit(main())
