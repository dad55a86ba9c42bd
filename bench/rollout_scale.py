"""Rollout alone at 0.5B, 1.5B and 7B (Qwen2.5 shapes): the static engine vs vLLM 0.26 on one GPU.

    python bench/rollout_scale.py [--models 0.5b,1.5b,7b --engines static,static-compiled,vllm]

What `spec.rollout.engine: auto` picks on one GPU is decided by these numbers (rollout/factory.py).
Random weights, never written to disk: the static engine builds the model from its config straight on
the GPU, vLLM starts with ``load_format="dummy"``. EOS is out of the vocabulary, so every row decodes
all ``--new-tokens`` and both engines do the same work: a GRPO batch of ``--prompts`` prompts x ``--n``
samples (default 32 x 8 = 256 sequences), ``--prompt-len`` + ``--new-tokens`` tokens, temperature 1.

Each (model, engine) runs in its own process (vLLM serves one engine per process; memory starts
clean): one untimed call (graph capture, compile), then the best of two timed calls. vLLM gets
``--vllm-gpu-memory-utilization`` of the GPU for weights + KV cache, as a colocated job would give it.
Prints a table, writes ``rollout_scale.json`` under --out, and one results.jsonl line per row with the
static engine of the same model and call as the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

SHAPES = {  # Qwen2.5 shapes (HF config.json fields); vocab 151,936 for <= 1.5B (tied), 152,064 for 7B
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True},  # CPU smoke test
}
ENGINES = ("static", "static-compiled", "vllm")


def write_config(root: Path, model: str) -> Path:
    """An HF folder with config.json and generation_config.json only (no weights): EOS = vocab size."""
    shape = SHAPES[model]
    vocab = shape["vocab_size"]
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **shape, "max_position_embeddings": 32768,
           "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "use_sliding_window": False,
           "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16",
           "bos_token_id": None, "eos_token_id": vocab, "pad_token_id": 0}
    folder = root / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab, "pad_token_id": 0}))
    return folder


def num_params(model: str) -> int:
    s = SHAPES[model]
    h, f, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    d = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * d
    per_layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    return n * per_layer + v * h * (1 if s["tie_word_embeddings"] else 2) + h


def _random_weights_from_config(model_dir: str, dtype=None, **_):
    """Stands in for from_pretrained in the child: the model built from its config directly on the GPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def child(a) -> dict:
    """One engine on one model in this process; returns its row."""
    import torch
    from rljob_worker.rollout import SamplingParams

    model_dir = str(write_config(Path(a.workdir), a.child_model))
    vocab = SHAPES[a.child_model]["vocab_size"]
    on_cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if on_cuda else "cpu")
    g = torch.Generator().manual_seed(a.prompts)
    batch = torch.randint(1, vocab, (a.prompts, a.prompt_len), generator=g).tolist()
    params = SamplingParams(n=a.n, temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
    t0 = time.perf_counter()
    if a.child_engine == "vllm":
        from rljob_worker.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, dtype=torch.bfloat16, gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                            max_model_len=a.prompt_len + a.new_tokens, eos_token_id=vocab, seed=0,
                            load_format="dummy", check_complete_sync=False)
        label = f"vllm {engine.vllm_version}"
    else:
        import transformers

        transformers.AutoModelForCausalLM.from_pretrained = _random_weights_from_config
        from rljob_worker.rollout.hf_static_engine import HFStaticEngine

        engine = HFStaticEngine(model_dir, dtype=torch.bfloat16 if on_cuda else torch.float32, device=dev,
                                eos_token_id=vocab, pad_token_id=0,
                                compile_decode=a.child_engine == "static-compiled")
        label = "static (CUDA graph)" + (" + compiled decode" if engine.compile_decode else "")
    startup = time.perf_counter() - t0

    def timed() -> float:
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(batch, params)
        if on_cuda:
            torch.cuda.synchronize()
        assert all(len(r) == a.new_tokens for r in out.response_ids), "a row stopped early"
        return time.perf_counter() - start

    first = timed()
    best = min(timed() for _ in range(2))
    tokens = a.prompts * a.n * a.new_tokens
    return {"model": a.child_model, "engine": a.child_engine, "label": label, "startup_s": startup,
            "first_call_s": first, "seconds": best, "tokens_per_s": tokens / best,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.5b,1.5b,7b")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--timeout-each", type=int, default=240)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--child-model", help=argparse.SUPPRESS)
    ap.add_argument("--child-engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_model:
        print("ROW " + json.dumps(child(a)), flush=True)
        return 0

    a.workdir = a.workdir or tempfile.mkdtemp(prefix="rollout_scale_")
    rows = []
    for model in a.models.split(","):
        for engine in a.engines.split(","):
            cmd = [sys.executable, __file__, "--child-model", model, "--child-engine", engine,
                   "--workdir", a.workdir, "--prompts", str(a.prompts), "--n", str(a.n),
                   "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens),
                   "--vllm-gpu-memory-utilization", str(a.vllm_gpu_memory_utilization)]
            print(f"--- {model} {engine}", flush=True)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_each, check=False)
                found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
                if found:
                    rows.append(json.loads(found[-1]))
                    print(rows[-1], flush=True)
                else:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
                    rows.append({"model": model, "engine": engine, "error": " | ".join(tail)[-400:]})
                    print("FAILED:", rows[-1]["error"], flush=True)
            except subprocess.TimeoutExpired:
                rows.append({"model": model, "engine": engine, "error": f"timeout after {a.timeout_each}s"})
                print("FAILED:", rows[-1]["error"], flush=True)
    report(a, rows)
    return 0


def report(a, rows: list[dict]) -> None:
    import results as bench_results

    card = bench_results.card_name()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout_scale.json").write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    workload = f"{a.prompts} prompts x {a.n}, {a.prompt_len}+{a.new_tokens} tokens, bf16, temperature 1"
    print(f"\n## rollout alone, {workload}, {card}")
    print("| model | engine | tokens/s | vs static | first call s | start-up s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['engine']} | ERROR {r['error'][:120]} | | | | |")
            continue
        base = next((b for b in rows if b["model"] == r["model"] and b["engine"] == "static" and "error" not in b),
                    None)
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        print(f"| {r['model']} | {r['label']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['first_call_s']:.1f} | "
              f"{r['startup_s']:.1f} | {r['peak_gib']:.1f} |")
        kw = {}
        if base and r is not base:
            kw = {"baseline": f"rollout {base['label']}", "baseline_value": base["tokens_per_s"], "same_run": True}
        bench_results.record(f"rollout {r['label']}", f"{r['model']} ({num_params(r['model']) / 1e9:.2f}B), {workload}",
                             "tokens_per_s", r["tokens_per_s"], "tok/s", card=card, **kw)


if __name__ == "__main__":
    sys.exit(main())
