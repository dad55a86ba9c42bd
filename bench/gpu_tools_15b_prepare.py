"""A Qwen2.5-1.5B-shaped model over the built-in tool vocabulary (issue 31: the agent loop's overhead where a decode
step costs compute, not launches). Random init, bf16, written with the tools tokenizer into one folder:

    python bench/gpu_tools_15b_prepare.py [--out /tmp/tools1.5b]

28 layers, hidden 1536, 12 heads / 2 KV heads, intermediate 8960, over builtin://tiny-qwen2-tools' 20 symbols. The
output layer is untied and scaled to 2% so the random model samples nearly uniformly: the call-end tag comes ~5% of
tokens, so about half the trajectories end a turn at a tool call (a random init with full-scale logits repeats one
token and never calls). Idempotent.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/tools1.5b")
    a = ap.parse_args()
    out = Path(a.out)
    if (out / "model.safetensors").exists():
        print(f"reusing {out}")
        return 0
    import torch
    from rljob_worker.data.builtin_models import TINY_QWEN2_TOOLS_CONFIG, build_char_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = {**TINY_QWEN2_TOOLS_CONFIG, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
           "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.02)
    model.save_pretrained(out)
    build_char_tokenizer(tools=True).save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
