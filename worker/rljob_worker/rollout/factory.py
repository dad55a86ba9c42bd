"""Build the configured rollout engine (its own module: the engines import :mod:`.base`, this imports
the engines)."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch
from rljob_api.enums import RolloutEngine as EngineName


def resolve_engine_name(name: EngineName, device: torch.device) -> EngineName:
    """`auto` -> vllm when importable on a GPU, else hf."""
    if name == EngineName.AUTO:
        vllm_available = importlib.util.find_spec("vllm") is not None
        return EngineName.VLLM if (vllm_available and device.type == "cuda") else EngineName.HF
    return name


def make_engine(name: EngineName, model_dir: str, *, dtype: torch.dtype, device: torch.device, eos_token_id: int,
                pad_token_id: int, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.6,
                max_model_len: int | None = None, enforce_eager: bool = False,
                max_num_batched_tokens: int | None = None, seed: int = 0):
    """Build the configured engine (see resolve_engine_name for `auto`)."""
    vllm_available = importlib.util.find_spec("vllm") is not None
    name = resolve_engine_name(name, device)
    if name == EngineName.VLLM:
        if not vllm_available:
            raise RuntimeError("spec.rollout.engine is vllm but vLLM is not installed in the worker image; "
                               "use the rljob GPU worker image or set rollout.engine: hf")
        from rljob_worker.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                          gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                          enforce_eager=enforce_eager, max_num_batched_tokens=max_num_batched_tokens,
                          eos_token_id=eos_token_id, seed=seed)
    from rljob_worker.rollout.hf_engine import HFEngine

    if device.type == "cuda" and os.environ.get("RLJOB_HF_STATIC", "1") != "0":
        # On a GPU the HF engine runs with a static KV cache and a CUDA-graphed decode step
        # (3.3x the dynamic-cache engine per GRPO step on an H200, bench/NOTES.md); RLJOB_HF_STATIC=0
        # falls back to the plain engine, as do models the static engine does not support.
        from rljob_worker.rollout.hf_static_engine import HFStaticEngine

        try:
            return HFStaticEngine(model_dir, dtype=dtype, device=device, eos_token_id=eos_token_id,
                                  pad_token_id=pad_token_id)
        except ValueError as exc:
            logging.getLogger(__name__).warning("static-cache engine unavailable (%s); using the HF engine", exc)
    return HFEngine(model_dir, dtype=dtype, device=device, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
