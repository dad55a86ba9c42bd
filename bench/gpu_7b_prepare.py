"""Inputs of the 7B-shape GRPO runs (bench/gpu_7b_*.yaml): a random-init model from the shipped
Qwen2.5-7B-shaped config, a word-level tokenizer and a prompt parquet. No downloads.

    python bench/gpu_7b_prepare.py [--out /tmp/q7b] [--prompts 256] [--prompt-len 1024]

- model: ``bench/qwen2.5-7b-shape.json`` (28 layers, hidden 3584, 28 heads / 4 KV heads,
  intermediate 18944, vocabulary 152,064, untied embeddings: 7.62B parameters), random init (seed 0)
  in bf16 on the GPU, written as safetensors (15.2 GB);
- tokenizer: "w<id>" words (grpo_step.build_tokenizer); EOS is id 152064, one past the model's
  vocabulary, so every response runs to maxResponseLength (fixed tokens per step);
- prompts: ``--prompts`` rows of exactly ``--prompt-len`` random words (tokens).
Idempotent: an existing complete folder is reused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/q7b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--config", default=str(BENCH / "qwen2.5-7b-shape.json"))
    a = ap.parse_args()
    out = Path(a.out)
    done = out / "READY"
    if done.exists():
        print(f"reusing {out}: {done.read_text().strip()}")
        return 0
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from grpo_step import build_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    raw = json.loads(Path(a.config).read_text())
    vocab = raw["vocab_size"]
    config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    config.architectures = raw["architectures"]
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = vocab, 0
    model.generation_config.bos_token_id = None
    model.save_pretrained(out / "model")
    del model
    # its own folder: next to a qwen2 config.json, AutoTokenizer would pick Qwen2Tokenizer instead
    build_tokenizer(vocab).save_pretrained(out / "tokenizer")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (a.prompts, a.prompt_len), generator=g).tolist()
    prompts = [" ".join(f"w{i}" for i in row) for row in ids]
    pq.write_table(pa.table({"prompt": prompts, "data_source": ["bench"] * a.prompts}), out / "prompts.parquet")
    note = f"{params / 1e9:.2f}B parameters, {a.prompts} prompts x {a.prompt_len} tokens, built in {time.perf_counter() - t0:.0f} s"
    done.write_text(note + "\n")
    print(f"wrote {out}: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
