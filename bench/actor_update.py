"""Actor-update throughput: rljob's megatron actor vs HF transformers eager, same batches, same run.

    python bench/actor_update.py --model 0.5b --mbs 4,8 [--rows 32 --steps 3 --out DIR]

Random-init Qwen2.5 shapes (0.5B / 1.5B, config built in code, tied embeddings, vocab 151936; ``7b-half``:
Qwen2.5-7B's widths at 14 of its 28 layers, untied), bf16.
Every optimizer step trains on ``--rows`` GRPO-like rows laid out as the trainer lays them out
(prompt left-padded, response right-padded): prompts of 128-512 tokens, responses of 32 tokens up to
the 2048-token budget (a quarter of them at the budget, as truncated responses are in GRPO), so a
row holds at most 2048 real tokens. The same batches go to every system:

- ``megatron``: ``MegatronActor.update`` (megatron DDP + megatron optimizer with torch AdamW,
  Float16Module, SDPA core attention, each row's padding packed out and the micro-batch cut to its
  longest row); ``megatron+fusedadam``: the same actor after switching its torch AdamW to
  ``fused=True`` (bench-only switch, a lever for the actor);
- ``megatron-noelem``: the same actor with the fused elementwise kernels off (eager RMSNorm, RoPE,
  SwiGLU, as RLJOB_FUSED_ELEMENTWISE=0; fused policy head on): session 3's ``megatron``;
- ``megatron-unfused``: the same actor with both off (log-probs and entropy over the full fp32 vocab
  logits, as RLJOB_FUSED_LOGPROBS=0, and eager elementwise ops); ``megatron`` runs the defaults (the
  fused head and, on a GPU, the compiled RMSNorm / RoPE / SwiGLU of megatron/fused_elementwise.py);
- ``megatron-budget``: token-budget micro-batches of ``--max-tokens`` packed tokens
  (``spec.training.maxTokensPerMicroBatch``) instead of ``--mbs`` rows;
- a ``-rows`` suffix: micro-batches in the rows layout (each row's tokens packed to the front, cut to the
  longest row; RLJOB_SEQUENCE_PACKING=off) where the GPU default concatenates them (megatron/packing.py);
- ``hf-padded``: transformers eager (sdpa), pure bf16, fused AdamW, each micro-batch cut to its used
  columns and run with its padding mask (how TRL-style trainers feed it);
- ``hf-packed``: the same model fed exactly what the actor's model sees (rows packed to the front,
  plain causal attention).

Tokens/s counts real (non-padding) tokens. Model FLOPs per row of n real tokens:
6 * N_matmul * n + 6 * layers * (heads * head_dim) * n^2 (causal attention, forward + backward),
N_matmul = linear weights of the layers + the (tied) output projection. MFU against 989 TFLOP/s
(H100/H200 SXM dense bf16 datasheet) and against a bf16 8192^3 matmul measured in this run.
Optimizer step time: the megatron optimizer's step (grad norm, clip, AdamW, copy to bf16) or
clip_grad_norm_ + AdamW for HF, with syncs around it. Results: a table on stdout,
``actor_update_<model>.json`` under --out and one line per figure in results.jsonl (bench/results.py).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for sub in ("operator", "worker", "bench"):
    if str(REPO / sub) not in sys.path:
        sys.path.insert(0, str(REPO / sub))

PEAK_TFLOPS = 989.0
SHAPES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
    # Qwen2.5-7B's widths (untied output layer) at half its 28 layers: fits one GPU with its optimizer state, and
    # per-layer MFU is that of the 7B model (the matmul shapes are the same)
    "7b-half": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 14, "num_attention_heads": 28,
                "num_key_value_heads": 4, "tie_word_embeddings": False},
    # all 28 layers: fits one GPU only with its weights frozen (spec.lora: bench/warm_start.py --model 7b --lora 32)
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},  # CPU smoke test only
}


def qwen_config(name: str, vocab: int = 151936):
    from transformers import Qwen2Config

    return Qwen2Config(**{"tie_word_embeddings": True, **SHAPES[name]}, vocab_size=vocab, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_cache=True, bos_token_id=0, eos_token_id=1,
                       pad_token_id=0)


def matmul_params(cfg) -> int:
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    d = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + cfg.vocab_size * h


def model_flops(cfg, lengths: list[int]) -> float:
    d = cfg.hidden_size // cfg.num_attention_heads
    attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * d
    return float(sum(6 * matmul_params(cfg) * n + attn * n * n for n in lengths))


def grpo_batch(rows: int, vocab: int, seed: int, seq: int = 2048, mix: str = "long") -> dict[str, torch.Tensor]:
    """Trainer layout (rljob_worker.data.batching.pad_batch) of a GRPO-like length mix, + advantages.
    ``long``: prompts of 128-512 tokens, responses up to ``seq`` in all (a quarter at the cap); ``short``: prompts
    of 16-128 tokens, responses LogNormal(median 100, sigma 0.8) capped at ``seq`` - 128 (grpo_step's long tail);
    ``fixed``: 128-token prompts and exactly ``seq`` - 128 response tokens (grpo_step's TRL workload at seq 384)."""
    from rljob_worker.data.batching import pad_batch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(rows):
        if mix == "fixed":
            p, r = 128, seq - 128
        elif mix == "short":
            p = int(torch.randint(16, 129, (), generator=g))
            r = max(1, min(seq - 128, int(100 * math.exp(0.8 * float(torch.randn((), generator=g))))))
        else:
            p = int(torch.randint(128, 513, (), generator=g))
            budget = seq - p
            r = budget if float(torch.rand((), generator=g)) < 0.25 else int(torch.randint(32, budget + 1, (),
                                                                                             generator=g))
        prompts.append(torch.randint(2, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(2, vocab, (r,), generator=g).tolist())
    batch = pad_batch(prompts, responses, pad_id=0)
    adv = torch.randn(rows, 1, generator=g)
    batch["advantages"] = adv * batch["response_mask"]
    return batch


def pg_loss(lp: torch.Tensor, _ent, mb: dict) -> tuple[torch.Tensor, dict]:
    mask = mb["response_mask"].to(lp.device).float()
    return -(lp * mb["advantages"].to(lp.device) * mask).sum() / mask.sum().clamp(min=1), {}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_matmul_tflops(n: int = 8192) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / statistics.median(times) / 1e12


# ------------------------------------------------------------------------------------------ HF eager


def _pack_rows(ids, mask, values):
    from rljob_worker.megatron.packing import pack

    packed, order, lengths = pack(ids, mask)
    return packed, lengths, [torch.gather(v, 1, order) for v in values]


def hf_update(model, opt, batch, mbs: int, packed: bool, dev, timer: dict) -> None:
    from rljob_worker.data.batching import trim_padding

    opt.zero_grad(set_to_none=True)
    b = batch["input_ids"].shape[0]
    n_mb = math.ceil(b / mbs)
    for start in range(0, b, mbs):
        mb = trim_padding({k: v[start:start + mbs] for k, v in batch.items()})
        ids, mask = mb["input_ids"].to(dev), mb["attention_mask"].to(dev)
        resp, adv = mb["response_mask"].to(dev), mb["advantages"].to(dev)
        if packed:
            ids, lengths, (resp, adv) = _pack_rows(ids, mask, [resp, adv])
            pos = torch.arange(ids.shape[1], device=dev).expand_as(ids)
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            keep = torch.arange(ids.shape[1], device=dev)[None, :] < lengths[:, None]
            resp = resp * keep
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        lp = -torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(),
                                                reduction="none").view(ids.shape[0], -1)
        m = resp[:, 1:].float()
        loss = -(lp * adv[:, 1:] * m).sum() / m.sum().clamp(min=1)
        (loss / n_mb).backward()
        del logits, lp, loss
    sync()
    t0 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sync()
    timer["opt_s"].append(time.perf_counter() - t0)


def hf_step(model, opt, mbs, packed, dev, timer, batch) -> None:
    hf_update(model, opt, batch, mbs, packed, dev, timer)


# ------------------------------------------------------------------------------------------ megatron


def megatron_step(actor, mbs, batch, max_tokens=None, attention="flash") -> None:
    from rljob_worker.megatron import sdpa_attention

    os.environ[sdpa_attention.ATTENTION_BACKEND_VAR] = attention  # -auto: torch's kernel order (cuDNN first)
    sdpa_attention.flash_first.cache_clear()
    if max_tokens:
        actor.update(batch, pg_loss, mbs, max_tokens_per_micro_batch=max_tokens)
    else:
        actor.update(batch, pg_loss, mbs)


def time_megatron_optimizer(actor, timer: dict) -> None:
    real = actor._gpu_step if actor.on_gpu else actor._cpu_step

    def timed(lr):
        sync()
        t0 = time.perf_counter()
        out = real(lr)
        sync()
        timer["opt_s"].append(time.perf_counter() - t0)
        return out

    if actor.on_gpu:
        actor._gpu_step = timed
    else:
        actor._cpu_step = timed


def switch_to_fused_adamw(megatron_optimizer) -> None:
    """Bench-only: make the torch AdamW under megatron's optimizer run its fused CUDA kernel."""
    for opt in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        for p, state in inner.state.items():
            if "step" in state and state["step"].device != p.device:
                state["step"] = state["step"].to(p.device)


# ------------------------------------------------------------------------------------------ driver


def run_variant(name, step_fn, batches, warmup, steps, cfg, matmul_tf, timer) -> dict:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    from torch._dynamo.utils import counters

    times, toks, flops = [], [], []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        lengths = batch["attention_mask"].sum(1).tolist()
        graphs = counters["stats"]["unique_graphs"]
        sync()
        t0 = time.perf_counter()
        step_fn(batch)
        sync()
        dt = time.perf_counter() - t0
        graphs = counters["stats"]["unique_graphs"] - graphs
        if i >= warmup:
            times.append(dt)
            toks.append(sum(lengths))
            flops.append(model_flops(cfg, lengths))
        print(f"  {name} step {i}: {dt:.3f}s {sum(lengths) / dt:,.0f} tok/s, {graphs} graph(s) compiled", flush=True)
    total_t = sum(times)
    tflops = sum(flops) / total_t / 1e12
    opt = timer["opt_s"][warmup:] or timer["opt_s"]
    return {
        "system": name, "tokens_per_s": sum(toks) / total_t, "step_s_median": statistics.median(times),
        "tflops": tflops, "mfu_989": tflops / PEAK_TFLOPS, "mfu_matmul": tflops / matmul_tf if matmul_tf else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "opt_ms_median": 1e3 * statistics.median(opt) if opt else None,
        "tokens_per_step": statistics.mean(toks), "steps": steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--mbs", default="4,8")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mix", choices=("long", "short", "fixed"), default="long", help="row lengths (grpo_batch)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--systems", default="hf-padded,hf-packed,megatron,megatron+fusedadam",
                    help="also: megatron-noelem (eager RMSNorm/RoPE/SwiGLU), megatron-unfused (that and the "
                         "policy head over full-vocab logits), megatron-budget (token-budget micro-batches of "
                         "--max-tokens); a -auto suffix: torch's attention kernel order (RLJOB_ATTENTION_BACKEND=auto, "
                         "cuDNN first on Hopper) instead of flash first")
    ap.add_argument("--max-tokens", type=int, default=32768, help="megatron-budget: tokens per micro-batch")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true",
                    help="after each megatron variant, one more step under torch.profiler: GPU time by kernel "
                         "kind (matmul, attention, compiled, optimizer, ...) and idle time, and the top kernels")
    args = ap.parse_args()
    mbs_list = [int(x) for x in args.mbs.split(",")]
    systems = args.systems.split(",")
    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda") if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    card = torch.cuda.get_device_name() if on_gpu else "cpu"
    matmul_tf = measure_matmul_tflops()
    print(f"card {card}; bf16 8192^3 matmul {matmul_tf:.0f} TFLOP/s", flush=True)

    cfg = qwen_config(args.model, args.vocab)
    batches = [grpo_batch(args.rows, cfg.vocab_size, seed=100 + i, seq=args.seq, mix=args.mix)
               for i in range(args.warmup + args.steps)]
    print(f"{args.model}: {matmul_params(cfg) / 1e6:.0f}M matmul params; rows/step {args.rows}; real tokens/step "
          f"{statistics.mean(float(b['attention_mask'].sum()) for b in batches):,.0f}; mean row "
          f"{statistics.mean(float(b['attention_mask'].sum(1).float().mean()) for b in batches):.0f}", flush=True)
    results = []

    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix=f"actor_{args.model}_"))
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.save_pretrained(tmp)

    for system in [s for s in systems if s.startswith("hf")]:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=on_gpu)
        for mbs in mbs_list:
            timer = {"opt_s": []}
            try:
                step = functools.partial(hf_step, model, opt, mbs, system == "hf-packed", dev, timer)
                r = run_variant(system, step, batches, args.warmup, args.steps, cfg, matmul_tf, timer)
                results.append({**r, "mbs": mbs})
            except Exception as exc:  # noqa: BLE001 - report and go on to the next variant
                traceback.print_exc()
                results.append({"system": system, "mbs": mbs, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            opt.zero_grad(set_to_none=True)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
        del opt
    del model
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()

    meg = [s for s in systems if s.startswith("megatron")]
    if meg:
        try:
            from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
            from rljob_worker.megatron.fused_elementwise import set_fused_elementwise

            actor = MegatronActor.from_hf(tmp, ParallelConfig(), OptimConfig(lr=1e-6, weight_decay=0.0),
                                          dtype=dtype, seed=0)
            timer = {"opt_s": []}
            time_megatron_optimizer(actor, timer)
            fused_default = getattr(actor, "fused_head", None)
            elem_default = actor.mcfg.fused_elementwise  # on with a GPU unless RLJOB_FUSED_ELEMENTWISE=0
            concat_default = actor.concatenate_sequences  # on with a GPU in bf16 unless RLJOB_SEQUENCE_PACKING=off
            print(f"megatron defaults: fused head {fused_default}, fused elementwise {elem_default}", flush=True)
            for system in meg:
                if system == "megatron+fusedadam":
                    if not on_gpu:
                        continue
                    switch_to_fused_adamw(actor.optimizer)
                # megatron-unfused: the policy head over full-vocab logits (RLJOB_FUSED_LOGPROBS=0)
                if fused_default is not None:
                    actor.fused_head = fused_default and system != "megatron-unfused"
                # megatron-noelem / -unfused: eager RMSNorm, RoPE, SwiGLU (RLJOB_FUSED_ELEMENTWISE=0)
                set_fused_elementwise(actor.chunks, elem_default and system not in ("megatron-noelem",
                                                                                    "megatron-unfused"))
                actor.concatenate_sequences = concat_default and "-rows" not in system
                budget = args.max_tokens if system.startswith("megatron-budget") else None
                for mbs in mbs_list if not budget else [f"{budget // 1024}k tokens"]:
                    timer["opt_s"] = []
                    try:
                        step = functools.partial(megatron_step, actor, mbs if not budget else 1, max_tokens=budget,
                                                 attention="auto" if system.endswith("-auto") else "flash")
                        r = run_variant(system, step, batches, args.warmup, args.steps, cfg, matmul_tf, timer)
                        results.append({**r, "mbs": mbs})
                        if args.profile:  # on a CPU: no kernels, only the wall time
                            profile_step(f"{args.model} {system} mbs {mbs}", step, batches[-1], Path(args.out))
                    except Exception as exc:  # noqa: BLE001
                        traceback.print_exc()
                        results.append({"system": system, "mbs": mbs,
                                        "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    gc.collect()
                    if on_gpu:
                        torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            results.append({"system": "megatron", "mbs": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})

    print_table(card, args.model, matmul_tf, results)
    record_results(card, args, results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"actor_update_{args.model}.json").write_text(json.dumps(
        {"card": card, "model": args.model, "matmul_tflops": matmul_tf, "rows": args.rows, "seq": args.seq,
         "results": results}, indent=1))
    return 0


KERNEL_KINDS = (  # first match wins: attention kernels are also "sm90" and "cutlass"
    ("attention", ("flash", "fmha", "attention", "efficient_attention")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "wgmma")),
    ("compiled (triton)", ("triton",)),
    ("optimizer", ("adam", "multi_tensor", "l2norm", "foreach")),
    ("copies", ("memcpy", "memset")),
    ("nccl", ("nccl",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other (eager)")


def profile_step(label: str, step_fn, batch, out: Path, file_prefix: str = "actor_profile") -> None:
    """One step under torch.profiler: GPU time by kernel kind against the step's wall time (the rest is
    the GPU idle: launches, host syncs, Python), and the 25 longest kernels; printed and written to
    ``<file_prefix>_<label>.txt`` under ``out``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step_fn(batch)
        sync()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    kinds: dict[str, float] = {}
    for e in kernels:
        kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + e.self_device_time_total / 1e6
    busy = sum(kinds.values())
    head = (f"## profile: {label}: step {wall:.3f} s under the profiler, GPU busy {busy:.3f} s "
            f"({100 * busy / wall:.0f}%), idle {wall - busy:.3f} s")
    lines = [head]
    lines += [f"  {kind:<20} {sec:8.3f} s  {100 * sec / wall:5.1f}% of the step"
              for kind, sec in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines.append("  longest kernels (total s, calls, kind, name):")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
        lines.append(f"  {e.self_device_time_total / 1e6:8.3f} {e.count:6d}  {kernel_kind(e.key):<18} {e.key[:110]}")
    text = "\n".join(lines)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{file_prefix}_{label.replace(' ', '_')}.txt").write_text(text + "\n")


def record_results(card: str, args, results: list[dict]) -> None:
    """One results.jsonl line per measured figure: tokens/s against HF fed the same packed rows, HF
    fed padded batches and (for ``megatron``) the actor with eager elementwise ops and with no fusion
    (same mbs, same run; a token-budget run against the best mbs of each), and MFU of 989 TFLOP/s."""
    import results as bench_results

    ok = [r for r in results if "tokens_per_s" in r]
    base = {(r["system"], r["mbs"]): r["tokens_per_s"] for r in ok}
    best = {}
    for r in ok:
        best[r["system"]] = max(best.get(r["system"], 0.0), r["tokens_per_s"])
    dtype = "bf16" if torch.cuda.is_available() else "fp32"
    for r in ok:
        mix = {"long": "GRPO mix", "short": "short lognormal mix", "fixed": "128 + fixed responses"}[args.mix]
        shape = f"{args.model}, {args.rows} rows/step, seq<={args.seq} {mix}, mbs {r['mbs']}, {dtype}"
        work = f"actor_update {r['system']}"
        kws = []
        if r["system"] == "megatron-budget":
            kws = [{"baseline": f"{b} best of mbs {args.mbs}", "baseline_value": best[b]}
                   for b in ("hf-packed", "megatron", "megatron-noelem", "megatron-unfused") if b in best]
        elif r["system"].startswith("megatron"):
            candidates = ["hf-packed", "hf-padded"]
            if r["system"] == "megatron":
                candidates += ["megatron-noelem", "megatron-unfused"]
            kws = [{"baseline": f"{b} mbs {r['mbs']}", "baseline_value": base[(b, r["mbs"])]}
                   for b in candidates if (b, r["mbs"]) in base]
        if (r["system"] + "-auto", r["mbs"]) in base:  # flash first against torch's kernel order
            kws.append({"baseline": f"{r['system']}-auto (torch's attention kernel order) mbs {r['mbs']}",
                        "baseline_value": base[(r["system"] + "-auto", r["mbs"])]})
        if (r["system"] + "-rows", r["mbs"]) in base:  # concatenated against rows micro-batches
            kws.append({"baseline": f"{r['system']}-rows (rows layout) mbs {r['mbs']}",
                        "baseline_value": base[(r["system"] + "-rows", r["mbs"])]})
        if not kws:
            bench_results.record(work, shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card)
        for kw in kws:
            bench_results.record(work, shape, "tokens_per_s", r["tokens_per_s"], "tok/s", card=card, same_run=True, **kw)
        bench_results.record(work, shape, "mfu_989", 100 * r["mfu_989"], "%", card=card)


def print_table(card, model, matmul_tf, results) -> None:
    print(f"\n## actor update, {model}, seq<=2048 GRPO mix, bf16, {card} (matmul {matmul_tf:.0f} TFLOP/s)")
    print("| system | mbs | tok/s | TFLOP/s | MFU 989 | MFU matmul | peak GiB | opt ms | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    # ratios against HF fed the same packed rows when it ran, else HF with padding
    ref = "hf-packed" if any(r.get("system") == "hf-packed" and "tokens_per_s" in r for r in results) else "hf-padded"
    base = {r["mbs"]: r["tokens_per_s"] for r in results if r.get("system") == ref and "tokens_per_s" in r}
    for r in results:
        if "error" in r:
            print(f"| {r['system']} | {r['mbs']} | ERROR {r['error'][:80]} | | | | | | |")
            continue
        ratio = f" ({r['tokens_per_s'] / base[r['mbs']]:.2f}x {ref})" if r["mbs"] in base else ""
        fmt = (lambda v, f: format(v, f) if v is not None and not (isinstance(v, float) and math.isnan(v)) else "-")
        print(f"| {r['system']} | {r['mbs']} | {r['tokens_per_s']:,.0f}{ratio} | {r['tflops']:.0f} | "
              f"{100 * r['mfu_989']:.1f}% | {fmt(r['mfu_matmul'] and 100 * r['mfu_matmul'], '.1f')}% | "
              f"{fmt(r['peak_gib'], '.1f')} | {fmt(r['opt_ms_median'], '.0f')} | {r['step_s_median']:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
