"""Shared by the real-vLLM GPU tests: a tiny Qwen2 vLLM can serve (head_dim 64) and engine clean-up."""
from __future__ import annotations

from pathlib import Path

import torch
from rljob_worker.rollout import SamplingParams


def tiny_qwen2_config():
    from rljob_worker.data.builtin_models import EOS, PAD, VOCAB
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=len(VOCAB), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=VOCAB.index(EOS), pad_token_id=VOCAB.index(PAD),
                      bos_token_id=VOCAB.index(EOS))
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def save_tiny_qwen2(path: Path, seed: int, scale: float = 0.5) -> Path:
    """A random tiny Qwen2 whose 2-D weights are N(0, scale^2): at 0.5 the next-token distributions are sharp,
    so greedy picks survive kernel differences; smaller scales give flatter distributions. Saved in bf16."""
    from rljob_worker.data.builtin_models import build_char_tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * scale)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def char_prompts(texts: list[str]) -> list[list[int]]:
    from rljob_worker.data.builtin_models import build_char_tokenizer

    tok = build_char_tokenizer()
    return [tok(s, add_special_tokens=False)["input_ids"] for s in texts]


def release(engine) -> None:
    """Stop a VLLMEngine and tear down the world vLLM built for it in this (test) process, so the next engine
    starts clean (vLLM's own tests do the same between engines). Never in a trainer: the world is the job's."""
    engine.shutdown()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


# ---------------------------------------------------------------- shared by the real-vLLM GPU test files
TEXTS = ["12+3=", "9=", "4444 8=", "0", "77+1=2 #", "5+5=", "31=", "8 8 8=", "2+", "999="]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)


def _ids():
    from rljob_worker.data.builtin_models import EOS, PAD, VOCAB

    return VOCAB.index(EOS), VOCAB.index(PAD)


def hf_engine(model_dir, dtype):
    from rljob_worker.rollout.hf_engine import HFEngine

    eos, pad = _ids()
    return HFEngine(str(model_dir), dtype=dtype, device=torch.device("cuda"), eos_token_id=eos, pad_token_id=pad)


def vllm_engine(model_dir, dtype, gpu_memory_utilization):
    from rljob_worker.rollout.vllm_engine import VLLMEngine

    eos, _ = _ids()
    return VLLMEngine(str(model_dir), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, max_model_len=64,
                      eos_token_id=eos, enforce_eager=True, seed=0)


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30
