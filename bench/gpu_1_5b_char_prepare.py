"""A Qwen2.5-1.5B-shaped model over a built-in character vocabulary. Random init (no downloads), bf16, written with
the char tokenizer into one folder:

    python bench/gpu_1_5b_char_prepare.py [--out /tmp/char1.5b]                          # issue 34: LoRA vs full
    python bench/gpu_1_5b_char_prepare.py --tools --output-scale 0.02 --out /tmp/tools1.5b  # issue 31: agent loop

28 layers, hidden 1536, 12 heads / 2 KV heads, intermediate 8960, tied embeddings (Qwen2.5-1.5B's shape) and the
16-symbol vocabulary of builtin://tiny-qwen2, so bench/gpu_digit_sum*.yaml run on it unchanged but for
model.path. Unlike the tiny built-ins, its output scale (init std 0.02 x hidden 1536: logits up to ~30) does not
bound what a frozen output layer lets LoRA reach (bench/NOTES.md, issue 34).

``--tools``: builtin://tiny-qwen2-tools' 20 symbols and tokenizer instead. ``--output-scale F``: the output layer
untied and scaled by F; at 0.02 the random model samples nearly uniformly, so the call-end tag comes ~5% of tokens
and about half the trajectories end a turn at a tool call (with full-scale logits it repeats one token and never
calls). ``--vocab-size 151936``: Qwen2.5's vocabulary size with the char tokenizer kept (the tokenizer decodes the
ids it does not know as nothing): a random model's logits are ~N(0, 0.8), so over 16 symbols it samples EOS every
~16 tokens, over 151,936 about once in 150k (the long-tail benches then cut responses by RLJOB_SYNTHETIC_LENGTHS).
Idempotent.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/char1.5b")
    ap.add_argument("--tools", action="store_true", help="the tool vocabulary and tokenizer")
    ap.add_argument("--output-scale", type=float, default=None, help="untie the output layer and scale it")
    ap.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (the tokenizer's stays): "
                    "151936 makes sampling EOS ~1 in 150k a token, so responses run to their budget")
    a = ap.parse_args()
    out = Path(a.out)
    if (out / "model.safetensors").exists():
        print(f"reusing {out}")
        return 0
    import torch
    from rljob_worker.data.builtin_models import (
        TINY_QWEN2_CONFIG,
        TINY_QWEN2_TOOLS_CONFIG,
        build_char_tokenizer,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    base = TINY_QWEN2_TOOLS_CONFIG if a.tools else TINY_QWEN2_CONFIG
    cfg = {**base, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
           "num_key_value_heads": 2, "torch_dtype": "bfloat16", "tie_word_embeddings": a.output_scale is None,
           **({"vocab_size": a.vocab_size} if a.vocab_size else {})}
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if a.output_scale is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(a.output_scale)
    model.save_pretrained(out)
    build_char_tokenizer(tools=a.tools).save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
