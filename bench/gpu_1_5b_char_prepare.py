"""A Qwen2.5-1.5B-shaped model over the built-in character vocabulary (issue 34: LoRA vs full fine-tuning on the
digit-sum task at 1.5B). Random init (no downloads), bf16, written with the char tokenizer into one folder:

    python bench/gpu_1_5b_char_prepare.py [--out /tmp/char1.5b]

28 layers, hidden 1536, 12 heads / 2 KV heads, intermediate 8960, tied embeddings (Qwen2.5-1.5B's shape) and the
16-symbol vocabulary of builtin://tiny-qwen2, so bench/gpu_digit_sum*.yaml run on it unchanged but for
model.path. Unlike the tiny built-ins, its output scale (init std 0.02 x hidden 1536: logits up to ~30) does not
bound what a frozen output layer lets LoRA reach (bench/NOTES.md, issue 34). Idempotent.
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
    a = ap.parse_args()
    out = Path(a.out)
    if (out / "model.safetensors").exists():
        print(f"reusing {out}")
        return 0
    import torch
    from rljob_worker.data.builtin_models import TINY_QWEN2_CONFIG, build_char_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = {**TINY_QWEN2_CONFIG, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
           "num_attention_heads": 12, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
