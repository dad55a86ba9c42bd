"""The vLLM rollout engine, colocated in the training process ("hybrid" mode), for vLLM 0.26.

Tested with vLLM 0.26.0 (the release pinned in the ``gpu`` extra and the worker image; it pins torch
2.11). `check_vllm_version` refuses any other minor release at start-up (``RLJOB_VLLM_ANY_VERSION=1``
skips the check).

Life cycle of one GRPO step on a GPU shared with the megatron actor::

    out = engine.generate(prompts, params)      # weights + KV cache on the GPU
    engine.sleep()                               # level 1: weights -> CPU, KV cache freed
    ... actor update (the GPU is the trainer's) ...
    engine.wake_up(tags=["weights"])             # weights back, still no KV cache
    engine.update_weights(actor.export_hf_weights())   # bucketed, straight into vLLM's load_weights
    engine.wake_up(tags=["kv_cache"])            # KV cache re-allocated; ready to generate

`wake_up()` without tags does both phases (weights, then KV cache). The order is enforced:
`update_weights` while the weights are asleep, `wake_up(["kv_cache"])` before the weights,
`generate` before the KV cache is back, or after a level-2 sleep with no weight sync since, raise
`RuntimeError`. Every call is appended to `calls`.

How vLLM is driven (everything imported lazily: vLLM is optional and CUDA-only):

- ``LLM(model=..., enable_sleep_mode=True, tensor_parallel_size, gpu_memory_utilization, ...)``
  in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in-process so
  weight loading is a direct call (no pickling of tensors to a child process) and the engine
  shares this process's CUDA context. Inside a torch.distributed world (torchrun) of more than
  one rank, or with rollout TP > 1, ``distributed_executor_backend="external_launcher"``: every
  rank builds its own engine holding one worker, vLLM forms TP groups of consecutive ranks over
  the existing world (see `weight_sync.RolloutLayout`), and all ranks of a group must make the
  same calls with the same prompts and seeds. **Every rank must construct the engine** (vLLM's
  group creation is collective), not global rank 0 alone.
- Sampling: one request per prompt with ``SamplingParams.n`` (vLLM fans it out into n children
  seeded ``seed + j``); prompt i gets seed ``params.seed + i * n`` so no two samples of a batch
  share a random stream. Greedy (temperature below vLLM's 1e-5) with n > 1, which vLLM 0.26
  refuses ("n must be 1 when using greedy sampling"), is decoded once per prompt (n=1, same seed
  ``params.seed + i * n``) and the result repeated n times: greedy samples of one prompt are
  identical by definition, so the n-1 copies cost nothing. ``logprobs=0`` returns the sampled token's log-prob only, and
  ``logprobs_mode="processed_logprobs"`` makes it the log-prob under the temperature/top-k/top-p
  processed distribution that was actually sampled — what the `hf` engine returns.
- Rollout TP > 1 needs attention heads at least 64 wide (`check_tensor_parallel_shape`, a start-up error):
  vLLM 0.26 hangs in its warm-up at TP2 on head_dim 16 (seen on 2 H100s) and runs head_dim 64.
- Weight sync: `weight_sync.bucket_named_tensors` groups the stream; each bucket goes into the
  model's own ``load_weights`` (HF names in; vLLM fuses q/k/v and gate/up and takes this rank's
  TP shard). The one version-specific access is `_load_weights_into` below.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rljob_worker.rollout.base import RolloutOutput, SamplingParams
from rljob_worker.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    NamedTensor,
    SyncStats,
    bucket_named_tensors,
    incomplete_fused,
    to_vllm_names,
)

log = logging.getLogger(__name__)

# Messages vLLM raises at start-up when gpu_memory_utilization leaves no (or too little) KV cache,
# or asks for more than is free: vllm/v1/core/kv_cache_utils.py, vllm/v1/worker/gpu_worker.py.
_MEMORY_ERROR_MARKERS = (
    "No available memory for the cache blocks",
    "KV cache is needed, which is larger than the available KV cache memory",
    "larger than the maximum number of tokens that can be stored in KV cache",
    "is less than desired GPU memory utilization",
    "gpu_memory_utilization",
)

AWAKE, WEIGHTS_ONLY, ASLEEP = "awake", "weights_only", "asleep"

# vLLM releases this engine is tested with: [min, max). Only 0.26.x has run on a GPU (bench/NOTES.md).
TESTED_VLLM = ("0.26.0", "0.27.0")
ANY_VERSION_ENV = "RLJOB_VLLM_ANY_VERSION"
# vLLM treats temperatures below this as greedy (vllm/sampling_params.py, _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# Narrowest attention head measured to run at rollout tensor-parallel > 1 (see check_tensor_parallel_shape).
MIN_TP_HEAD_DIM = 64


# The CUDA graphs vLLM captures at start-up: by default one per batch size in [1, 2, 4, 8, 16, ..., 248, 256, 272,
# ..., 512] (51 sizes on a GPU of >= 70 GB, each captured twice in the default FULL_AND_PIECEWISE mode), a server's
# range. A rollout engine never decodes more rows at once than a training step hands it, so sizes above that are
# start-up time spent on graphs that never run. RLJOB_VLLM_CAPTURE=all keeps vLLM's own list (benchmarks).
CAPTURE_ENV = "RLJOB_VLLM_CAPTURE"
VLLM_MAX_CAPTURE = 512  # vLLM 0.26's own ceiling (min(2 x max_num_seqs, 512))


def capture_size_bound(rows: int | None, environ: dict[str, str] | None = None) -> int | None:
    """The largest batch vLLM should capture a CUDA graph for, given the most rows one generate call decodes at
    once; None keeps vLLM's default. Rounded up to vLLM's own grid (multiples of 8 below 256, of 16 from 256) so
    the full batch itself has a graph; a call with more rows than this only decodes its first steps without one."""
    setting = (os.environ if environ is None else environ).get(CAPTURE_ENV, "rollout").strip() or "rollout"
    if setting not in ("rollout", "all"):
        raise ValueError(f"{CAPTURE_ENV}={setting!r}: set rollout (graphs up to the rows a step decodes, the default) "
                         "or all (vLLM's own sizes, up to 512)")
    if setting == "all" or not rows or rows <= 0:
        return None
    if rows <= 4:
        return 4
    grid = 8 if rows < 256 else 16
    bound = -(-rows // grid) * grid
    return None if bound >= VLLM_MAX_CAPTURE else bound


# A colocated engine sleeps while the actor trains. Level 1 copies its weights to pinned host memory at every sleep
# and back at every wake, and its first sleep pins a host buffer the size of the model (3.5 s of a 7B pod's first
# step on an H200, bench/NOTES.md session 21); level 2 drops them, and the trainer's weight sync refills every
# parameter before the engine samples again anyway. RLJOB_VLLM_SLEEP_LEVEL=1 keeps the host copy.
SLEEP_LEVEL_ENV = "RLJOB_VLLM_SLEEP_LEVEL"


def sleep_level_setting(environ: dict[str, str] | None = None) -> int:
    """The sleep level a colocated engine uses: 2 unless RLJOB_VLLM_SLEEP_LEVEL says 1."""
    setting = (os.environ if environ is None else environ).get(SLEEP_LEVEL_ENV, "2").strip() or "2"
    if setting not in ("1", "2"):
        raise ValueError(f"{SLEEP_LEVEL_ENV}={setting!r}: set 2 (drop the weights while asleep; the weight sync "
                         "refills them, the default) or 1 (keep a copy in host memory)")
    return int(setting)


def check_vllm_version(version: str, tested: tuple[str, str] = TESTED_VLLM) -> None:
    """Refuse a vLLM outside the tested range [tested[0], tested[1]) with an error naming both.

    The engine reaches into vLLM's Python API (LLM kwargs, sleep tags, apply_model, logprobs_mode),
    which changes between minor releases; an untested one fails late and obscurely, or samples wrongly.
    """
    from packaging.version import InvalidVersion, Version

    low, high = tested
    try:
        ok = Version(low) <= Version(version) < Version(high)
    except InvalidVersion:
        ok = False
    if ok:
        return
    if os.environ.get(ANY_VERSION_ENV, "0") == "1":
        log.warning("vLLM %s is outside the tested range [%s, %s); %s=1 lets it run", version, low, high,
                    ANY_VERSION_ENV)
        return
    raise RuntimeError(
        f"spec.rollout.engine is vllm but the installed vLLM is {version}; rljob is tested with vLLM >= {low}, "
        f"< {high} (pip install vllm=={low}, or the rljob worker image, which ships it). To try this version "
        f"anyway set {ANY_VERSION_ENV}=1 in podTemplate env, or use rollout.engine: hf.")


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError("spec.rollout.engine is vllm but vLLM cannot be imported in this worker "
                           f"({exc}); use the rljob GPU worker image or set rollout.engine: hf") from exc
    return vllm


def _executor_backend(tensor_parallel_size: int) -> str | None:
    """``external_launcher`` inside a torchrun world of > 1 rank or for TP > 1, else vLLM's default.

    vLLM's default single-GPU executor would put every rank's worker on cuda:0 and build its
    groups as if it were alone; the external launcher uses RANK/LOCAL_RANK from torchrun.
    """
    import torch.distributed as dist

    multi_rank = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return "external_launcher" if (tensor_parallel_size > 1 or multi_rank) else None


def _load_weights_into(llm, weights: list[NamedTensor]) -> list[Any]:
    """Hand one bucket of HF-named full tensors to the model's ``load_weights``; return its results.

    The only place that reaches into vLLM for weights. vLLM >= 0.9 (V1): ``LLM.apply_model(fn)``
    runs ``fn(model)`` on the model of every worker of this engine (with the in-process engine core
    and the uni-process / external-launcher executors that is exactly this process's worker, and
    ``fn`` is called directly, not pickled). Older releases: the driver worker's model runner.
    """
    def load(model):
        with torch.no_grad():
            return model.load_weights(weights)

    if hasattr(llm, "apply_model"):
        return list(llm.apply_model(load))
    worker = llm.llm_engine.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return [load(model)]


def _model_param_names(llm) -> set[str] | None:
    """Names of the vLLM model's parameters (vLLM naming), for the sync completeness check."""
    try:
        if hasattr(llm, "apply_model"):
            sets = llm.apply_model(lambda model: {n for n, _ in model.named_parameters()})
            return set().union(*sets) if sets else None
    except Exception as exc:  # noqa: BLE001 - diagnostics only; never block start-up on it
        log.debug("could not list vLLM parameters: %s", exc)
    return None


def _torch_dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _model_config(model_dir: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _head_dim(config: dict[str, Any]) -> int | None:
    """The attention head width: ``head_dim`` if the config names it, else hidden_size / num_attention_heads."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if hidden and heads else None


def check_tensor_parallel_shape(config: dict[str, Any], tensor_parallel_size: int) -> None:
    """Refuse, before vLLM starts, a tensor-parallel engine on a model shape vLLM 0.26 hangs on.

    Seen on 2 H100s (bench/NOTES.md, session 5): at TP2 the built-in tiny-qwen2 (head_dim 16) never leaves vLLM's
    start-up warm-up (the first prefill's all-reduce waits forever), while the same model at head_dim 64
    (builtin://tiny-qwen2-hd64) starts, samples identical tokens on both ranks and learns. Head widths between
    16 and 64 are untested, so the bound is the one measured to work. Models this small fit one GPU: TP 1 serves them.
    """
    head_dim = _head_dim(config)
    if tensor_parallel_size <= 1 or head_dim is None or head_dim >= MIN_TP_HEAD_DIM:
        return
    from rljob_worker.startup_errors import StartupError

    raise StartupError(
        f"spec.rollout.tensorModelParallelSize={tensor_parallel_size} with rollout.engine vllm needs attention heads "
        f"at least {MIN_TP_HEAD_DIM} wide, and this model's are {head_dim} (hidden_size {config.get('hidden_size')} / "
        f"{config.get('num_attention_heads')} heads): vLLM 0.26 hangs in its start-up warm-up at tensor-parallel > 1 on "
        f"such a model. A model this small fits one GPU: set rollout.tensorModelParallelSize: 1 (or rollout.engine: hf)")


# vLLM 0.26's sleep-mode (CuMem) allocator serves one engine per process for the life of the process: after a
# first engine, even shut down, the next one fails in load_model with "CuMem allocator can only be used for one
# instance per process" (seen on an H100, 2026-11-26). Counted here so the second start fails with a clear message.
_engines_started_in_process = 0


class VLLMEngine:
    def __init__(self, model_dir: str, *, dtype: torch.dtype | str = "bfloat16", tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.6, enforce_eager: bool = False, seed: int = 0,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 eos_token_id: int | None = None, sleep_level: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 distributed_executor_backend: str | None = None, check_complete_sync: bool = True,
                 record_routing: bool = False, max_rows: int | None = None, **engine_kwargs: Any):
        """Start vLLM on ``model_dir`` (an HF folder). Extra keyword arguments go to ``vllm.LLM``.

        ``eos_token_id``: when given, generation also stops at it (``stop_token_ids``) whatever the
        model's generation config says, so ``finished`` means the same as in the other engines.
        ``sleep_level``: 1 keeps a CPU copy of the weights (wake without a sync is valid); 2 drops
        them (no CPU copy, no host->device copy on wake; every wake must be followed by a full sync).
        ``max_rows``: the most rows one generate call decodes at once (a training step's); bounds the CUDA
        graphs captured at start-up (capture_size_bound).
        """
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.model_dir, self.tp = model_dir, tensor_parallel_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.eos, self.sleep_level, self.bucket_bytes = eos_token_id, sleep_level, bucket_bytes
        self.check_complete_sync = check_complete_sync
        config = _model_config(model_dir)
        self.routing = None  # (layers, MoE layers, top-k, dtype) when recording routed experts
        if record_routing:
            from transformers import AutoConfig

            from rljob_worker.rollout.routed_experts import expert_dtype, moe_layer_indices

            hf = AutoConfig.from_pretrained(model_dir)  # config.json may leave the defaults out
            self.routing = (hf.num_hidden_layers, moe_layer_indices(hf), hf.num_experts_per_tok,
                            expert_dtype(hf.num_experts))
        self.tied = bool(config.get("tie_word_embeddings", False))
        check_tensor_parallel_shape(config, tensor_parallel_size)
        self.calls: list[str] = []
        self.last_sync_stats: SyncStats | None = None
        self.state = AWAKE
        self._weights_stale = False  # weights discarded by a level-2 sleep, not yet re-synced

        # In-process engine core: weights are loaded by a direct call. Must be set before vLLM reads its env.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING overridden to 0: the colocated engine runs in-process")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm = _import_vllm()
        self.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        check_vllm_version(self.vllm_version)
        self._vllm = vllm
        backend = distributed_executor_backend or _executor_backend(tensor_parallel_size)
        kwargs: dict[str, Any] = {
            "model": model_dir, "dtype": _torch_dtype_name(dtype), "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True,
            "enforce_eager": enforce_eager, "seed": seed, "logprobs_mode": "processed_logprobs",
            # sampling defaults come from our SamplingParams, not the checkpoint's generation_config.json
            "generation_config": "vllm"}
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
            # vLLM's custom all-reduce shares CUDA IPC buffers between the TP ranks, allocated outside the
            # sleep-mode pool; colocated hybrid engines (verl's among them) run NCCL's all-reduce instead. The
            # rollout-TP2 runs and tests on 2 H100s ran this way (the TP2 hang first blamed on it was the head width).
            kwargs["disable_custom_all_reduce"] = True
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        if record_routing:
            kwargs["enable_return_routed_experts"] = True
        capture_bound = None if enforce_eager else capture_size_bound(max_rows)
        if capture_bound is not None:
            kwargs["compilation_config"] = {"max_cudagraph_capture_size": capture_bound}
        kwargs.update(engine_kwargs)
        self.engine_kwargs = kwargs

        global _engines_started_in_process
        if _engines_started_in_process:
            raise RuntimeError(
                "a vLLM engine was already started in this process: vLLM's sleep-mode allocator serves one engine per "
                "process, even after shutdown(); start the next engine in a new process")
        start = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as exc:
            message = str(exc)
            if any(marker in message for marker in _MEMORY_ERROR_MARKERS):
                raise RuntimeError(
                    f"spec.rollout.gpuMemoryUtilization={gpu_memory_utilization} cannot hold the rollout engine's "
                    f"weights and a KV cache for one full-length sequence on this GPU (or exceeds the memory free "
                    f"next to the trainer); raise it, or lower data.maxPromptLength + data.maxResponseLength. "
                    f"vLLM said: {message}") from exc
            raise
        _engines_started_in_process += 1
        self.startup_seconds = time.perf_counter() - start
        self._param_names = _model_param_names(self.llm) if check_complete_sync else None
        log.info("vLLM %s engine up in %.1f s (tp=%d, gpu_memory_utilization=%.2f, backend=%s, CUDA graphs for "
                 "batches up to %s)", self.vllm_version, self.startup_seconds, tensor_parallel_size,
                 gpu_memory_utilization, backend or "default",
                 "none (enforce_eager)" if enforce_eager else capture_bound or f"vLLM's default ({VLLM_MAX_CAPTURE})")

    def shutdown(self) -> None:
        """Stop the engine and drop its memory (benchmarks and tests that start another engine in this process).

        vLLM's sleep-mode allocator is process-wide and serves one engine per process even after this (see
        _engines_started_in_process): a later engine belongs in a new process. The torch.distributed world is
        left alone.
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del self.llm
        import gc

        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        self.state = ASLEEP
        self.calls.append("shutdown")

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int | None = None) -> None:
        """Free the GPU for training: level 1 offloads weights to CPU, level 2 discards them; KV cache discarded."""
        level = self.sleep_level if level is None else level
        if self.state == ASLEEP:
            self.calls.append(f"sleep(level={level}) [already asleep]")
            return
        if self.state == WEIGHTS_ONLY:  # vLLM sleeps what it allocated: bring the KV pool back first
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.sleep(level=level)
        self.state = ASLEEP
        if level == 2:
            self._weights_stale = True
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-acquire GPU memory: ``["weights"]`` first (then `update_weights`), then ``["kv_cache"]``;
        no tags does both in that order."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        if self.state == ASLEEP and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its pool again
        if "weights" in tags and self.state == ASLEEP:
            self.llm.wake_up(tags=["weights"])
            self.state = WEIGHTS_ONLY
            self.calls.append("wake_up(weights)")
        if "kv_cache" in tags:
            if self.state == ASLEEP:
                raise RuntimeError("wake_up(tags=['kv_cache']) before the weights: call wake_up(tags=['weights']) "
                                   "(and update_weights) first")
            if self.state == WEIGHTS_ONLY:
                if self._weights_stale:
                    log.warning("KV cache woken after a level-2 sleep with no weight sync: weights are "
                                "uninitialised until update_weights()")
                self.llm.wake_up(tags=["kv_cache"])
                self.state = AWAKE
                self.calls.append("wake_up(kv_cache)")

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[NamedTensor], partial: bool = False) -> None:
        """Stream HF-named full tensors into vLLM in buckets of at most ``bucket_bytes``; stats in `last_sync_stats`.
        ``partial``: a subset of the parameters (LoRA's merged weights), each fused parameter still whole.

        The whole stream is consumed (it is collective over the training TP group) even if loading fails.
        """
        if self.state == ASLEEP:
            raise RuntimeError("update_weights while the vLLM engine is asleep: call wake_up(tags=['weights']) "
                               "first (the weights must be on the GPU to be overwritten)")
        stats = SyncStats()
        start = time.perf_counter()
        loaded: set[str] = set()  # vLLM parameter names, as its load_weights reports them
        sent: list[str] = []  # HF names handed over
        last: torch.Tensor | None = None
        stream = iter(named_tensors)
        try:
            for bucket in bucket_named_tensors(to_vllm_names(stream, tie_word_embeddings=self.tied), self.bucket_bytes):
                t0 = time.perf_counter()
                for result in _load_weights_into(self.llm, bucket):
                    if result:
                        loaded.update(result)
                sent.extend(name for name, _ in bucket)
                last = bucket[-1][1]
                stats.add_bucket(bucket, time.perf_counter() - t0)
        except Exception:
            for _ in stream:  # keep the other TP ranks' all-gathers matched
                pass
            raise
        if last is not None and last.is_cuda:
            torch.cuda.synchronize(last.device)  # copies are asynchronous: time them to completion
        stats.seconds = time.perf_counter() - start
        self.last_sync_stats = stats
        self._weights_stale = False
        if self.state == AWAKE:  # weights changed under a live KV/prefix cache: cached prefixes are stale
            self.llm.reset_prefix_cache()
        self.calls.append(f"update_weights({stats.tensors} tensors, {stats.buckets} buckets)")
        if self.check_complete_sync:
            missing = sorted(self._param_names - loaded) if (self._param_names and loaded and not partial) else []
            partial = incomplete_fused(sent)
            if missing or partial:
                raise KeyError(f"weight sync: no tensor for vLLM parameters {missing[:5]} ({len(missing)} missing), "
                               f"fused parameters missing parts: {dict(list(partial.items())[:5])} "
                               "(VLLMEngine(check_complete_sync=False) skips this check)")
        log.debug("weight sync: %.3f GB in %.3f s (%.2f GB/s, load %.3f s)", stats.gb, stats.seconds, stats.gb_per_s,
                  stats.load_seconds)

    def metrics(self) -> dict[str, float]:
        """Start-up seconds and the last weight sync's stats, as trainer metrics."""
        out = {"rollout/engine_startup_s": self.startup_seconds}
        if self.last_sync_stats is not None:
            out.update(self.last_sync_stats.metrics())
        return out

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, params: SamplingParams, prompt_index: int, n: int):
        kw: dict[str, Any] = {"n": n, "temperature": params.temperature, "top_p": params.top_p,
                              "max_tokens": params.max_new_tokens, "logprobs": 0, "detokenize": False}
        if params.top_k > 0:  # vLLM's "disabled" value moved from -1 to 0 across releases: leave its default
            kw["top_k"] = params.top_k
        if params.seed is not None:
            kw["seed"] = params.seed + prompt_index * params.n
        # vLLM keeps a stop token id as the sample's last token id (finish_reason "stop"), as the hf engines do;
        # the agent loop's tool-call end arrives here with the EOS
        stops = ([self.eos] if self.eos is not None else []) + [t for t in params.stop_token_ids if t != self.eos]
        if stops:
            kw["stop_token_ids"] = stops
        return self._vllm.SamplingParams(**kw)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        if self.state != AWAKE:
            raise RuntimeError(f"generate while the vLLM engine is {self.state.replace('_', ' ')}: call wake_up() first")
        if self._weights_stale:
            raise RuntimeError("generate after a level-2 sleep without update_weights: the engine's weights were discarded")
        out = RolloutOutput([], [], [], [] if self.routing else None)
        if not prompt_ids:
            return out
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        # greedy: one decode per prompt, repeated n times (vLLM refuses greedy with n > 1)
        repeat = params.n if params.temperature < GREEDY_TEMPERATURE else 1
        per_request = params.n // repeat
        sampling = [self._sampling_params(params, i, per_request) for i in range(len(prompt_ids))]
        results = self.llm.generate(prompts, sampling, use_tqdm=False)
        if len(results) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(results)} results for {len(prompt_ids)} prompts")
        for i, result in enumerate(results):
            samples = sorted(result.outputs, key=lambda o: o.index)
            if len(samples) != per_request:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, expected n={per_request}")
            for sample in samples * repeat:
                ids = list(sample.token_ids)
                out.response_ids.append(ids)
                out.response_logprobs.append(_sampled_logprobs(ids, sample.logprobs))
                out.finished.append(sample.finish_reason == "stop")
                if self.routing:
                    from rljob_worker.rollout.routed_experts import from_vllm

                    if getattr(sample, "routed_experts", None) is None:
                        raise RuntimeError("vLLM returned no routed experts (enable_return_routed_experts is on)")
                    out.routed_experts.append(from_vllm(sample.routed_experts, *self.routing))
        self.calls.append(f"generate({len(prompt_ids)} prompts x {params.n})")
        return out


def _sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """vLLM's per-position ``{token_id: Logprob}`` (``logprobs=0``: the sampled token only) -> floats."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned log-probs for {0 if logprobs is None else len(logprobs)} of "
                           f"{len(token_ids)} tokens (SamplingParams.logprobs=0 should give one per token)")
    out = []
    for tok, entry in zip(token_ids, logprobs):
        value = entry[tok]
        out.append(float(getattr(value, "logprob", value)))
    return out
