"""Build the configured rollout engine (its own module: the engines import :mod:`.base`, this imports
the engines)."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch
from rljob_api.enums import RolloutCompile
from rljob_api.enums import RolloutEngine as EngineName

# `engine: auto` on one GPU picks the static HF engine up to this many active parameters, vLLM above. Rollout alone,
# one H100, Qwen2.5 shapes, 32 prompts x 8, 128 + 256 tokens, bf16 (bench/rollout_scale.py, bench/NOTES.md,
# 2026-11-26, one call): static / compiled static / vLLM 0.26 tok/s = 41.6k / 74.9k / 24.9k at 0.5B,
# 27.9k / 45.5k / 23.6k at 1.5B, 13.4k / 17.7k / 23.0k at 7B. vLLM's throughput is nearly flat in model size
# (bound by its per-step host work) while the static engine's falls with it; interpolating in log-size the
# curves cross near 2.2B (uncompiled) and 4.6B (compiled). 3B sits between, where either engine is within
# about 15% of the other. Whole GRPO step at 0.5B: static 3.01 s vs vLLM 3.41 s (same call).
AUTO_STATIC_MAX_PARAMS = 3_000_000_000


def resolve_engine_name(name: EngineName, device: torch.device, *, world_size: int = 1, rollout_tp: int = 1,
                        num_params: int | None = None) -> EngineName:
    """`auto` -> the engine the measurements favour; `vllm` / `hf` pass through.

    hf when there is no GPU or vLLM is not importable. Otherwise vllm when the rollout is tensor-parallel or the
    job has more than one process (decided when the HF engines sampled on global rank 0 for everyone; they
    can now sample on every rank, spec.rollout.ranks, not yet measured against vLLM), or the model has more
    than AUTO_STATIC_MAX_PARAMS active parameters (or an unknown count); else hf
    (the static-cache CUDA-graph engine, faster than vLLM 0.26 at 0.5B).
    """
    if name != EngineName.AUTO:
        return name
    if device.type != "cuda" or importlib.util.find_spec("vllm") is None:
        return EngineName.HF
    if rollout_tp > 1 or world_size > 1 or num_params is None or num_params > AUTO_STATIC_MAX_PARAMS:
        return EngineName.VLLM
    return EngineName.HF


def make_engine(name: EngineName, model_dir: str, *, dtype: torch.dtype, device: torch.device, eos_token_id: int,
                pad_token_id: int, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.6,
                max_model_len: int | None = None, enforce_eager: bool = False,
                max_num_batched_tokens: int | None = None, seed: int = 0, world_size: int = 1,
                num_params: int | None = None, compile: RolloutCompile | str = RolloutCompile.AUTO,
                record_routing: bool = False, max_rows: int | None = None):
    """Build the configured engine (see resolve_engine_name for `auto`; ``compile``: spec.rollout.compile, see
    compile_config.compile_enabled; ``record_routing``: each response carries its routed experts, for MoE
    routing replay; ``max_rows``: the most rows one generate call decodes, which bounds vLLM's CUDA graphs)."""
    vllm_available = importlib.util.find_spec("vllm") is not None
    name = resolve_engine_name(name, device, world_size=world_size, rollout_tp=tensor_parallel_size,
                               num_params=num_params)
    if name == EngineName.VLLM:
        if not vllm_available:
            raise RuntimeError("spec.rollout.engine is vllm but vLLM is not installed in the worker image; "
                               "use the rljob GPU worker image or set rollout.engine: hf")
        from rljob_worker.rollout.vllm_engine import VLLMEngine, sleep_level_setting

        return VLLMEngine(model_dir, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                          gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                          enforce_eager=enforce_eager, max_num_batched_tokens=max_num_batched_tokens,
                          eos_token_id=eos_token_id, seed=seed, record_routing=record_routing, max_rows=max_rows,
                          sleep_level=sleep_level_setting())
    from rljob_worker.rollout.hf_engine import HFEngine

    choice = os.environ.get("RLJOB_HF_STATIC", "1")
    if (choice == "force" or (device.type == "cuda" and choice != "0")) and not record_routing:
        # On a GPU the HF engine runs with a static KV cache and a CUDA-graphed decode step
        # (3.3x the dynamic-cache engine per GRPO step on an H200, bench/NOTES.md); RLJOB_HF_STATIC=0
        # falls back to the plain engine, as do models the static engine does not support. On a CPU it runs
        # eagerly and only with RLJOB_HF_STATIC=force (tests of what only it does, e.g. refilling rows).
        from rljob_worker.rollout.compile_config import compile_enabled
        from rljob_worker.rollout.compile_once import refuse_background_compile
        from rljob_worker.rollout.hf_static_engine import HFStaticEngine

        compile_decode = compile_enabled(compile, device)  # before the model loads: a bad env value fails fast
        refuse_background_compile()  # (here, not in the engine: its ValueError would fall back to HFEngine)
        try:
            return HFStaticEngine(model_dir, dtype=dtype, device=device, eos_token_id=eos_token_id,
                                  pad_token_id=pad_token_id, compile_decode=compile_decode)
        except ValueError as exc:
            logging.getLogger(__name__).warning("static-cache engine unavailable (%s); using the HF engine", exc)
    return HFEngine(model_dir, dtype=dtype, device=device, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                    record_routing=record_routing)
