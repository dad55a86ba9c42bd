"""Patches that let megatron-core 0.16.1 run on a machine without a GPU (tests, quickstart).

``apply_cpu_patches()`` is idempotent and does nothing when CUDA is available: the GPU path runs
megatron unpatched. Each patch says which megatron code needs it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch

log = logging.getLogger(__name__)
_APPLIED = False


class _CpuRNGStatesTracker:
    """Mixin body for megatron's CudaRNGStatesTracker that keeps named *CPU* generator states."""

    def add(self, name, seed):
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    from .context_parallel import split_for_cp

    return split_for_cp(pos_emb, cp_group.size(), cp_group.rank(), dim=seq_dim)


def _cpu_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    """CPU stand-in for ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: the routing
    metadata already lives on the CPU, so there is no side stream to copy on or wait for; only the
    split sizes become numpy arrays as upstream makes them (``all_to_all_single`` takes them as-is)."""
    if self.drop_and_pad or point != self.cuda_dtoh_point:
        return tokens_per_expert
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name, None)
        if torch.is_tensor(value):
            setattr(self, name, value.numpy())
    return tokens_per_expert


def _gloo_gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """``mappings._gather_along_first_dim`` for gloo, whose all_gather needs equal sizes: with
    ``output_split_sizes`` (the alltoall dispatcher's expert-TP gather under EP, uneven token counts)
    each rank's rows are padded to the largest share, gathered, and cut back."""
    import torch.distributed as dist

    if output_split_sizes is None or group.size() == 1:
        return _MEGATRON_GATHER(input_, group, output_split_sizes, use_global_buffer)
    sizes = [int(s) for s in output_split_sizes]
    rows = max(sizes)
    padded = torch.nn.functional.pad(input_.contiguous(), (0, 0) * (input_.dim() - 1) + (0, rows - input_.shape[0]))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)


def _gloo_reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """``mappings._reduce_scatter_along_first_dim`` for gloo with uneven ``input_split_sizes`` (the
    backward of the gather above): all-reduce the whole tensor, keep this rank's rows."""
    import torch.distributed as dist

    if input_split_sizes is None or group.size() == 1:
        return _MEGATRON_REDUCE_SCATTER(input_, group, input_split_sizes, use_global_buffer)
    sizes = [int(s) for s in input_split_sizes]
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    rank = group.rank()
    return total[sum(sizes[:rank]) : sum(sizes[: rank + 1])].clone()


_MEGATRON_GATHER = _MEGATRON_REDUCE_SCATTER = None


def _patch_uneven_gather() -> None:
    global _MEGATRON_GATHER, _MEGATRON_REDUCE_SCATTER
    from megatron.core.tensor_parallel import mappings

    _MEGATRON_GATHER = mappings._gather_along_first_dim
    _MEGATRON_REDUCE_SCATTER = mappings._reduce_scatter_along_first_dim
    mappings._gather_along_first_dim = _gloo_gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _gloo_reduce_scatter_along_first_dim


def _patch_moe_dispatcher() -> None:
    # MoEAlltoAllTokenDispatcher creates a class-wide torch.cuda.Stream in __init__ (a non-None value
    # skips that) and moves split sizes device-to-host on it.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


class _CpuTorchForSchedules(types.ModuleType):
    """``torch`` as megatron's pipeline schedules see it: their token counter is created with
    ``torch.zeros(..., device="cuda")``; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _without_tensor_cuda(fn):
    """Run ``fn`` with ``Tensor.cuda`` as the identity (the tensors stay on the CPU)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapper


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU + gloo. Returns True when patches are (already) in place."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    # Buffers in tensor_parallel/layers.py, mappings.py (all-gather outputs), rotary embeddings and
    # dist-checkpointing's async/save helpers are placed on torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"
    # dist_checkpointing (filesystem_async, fully_parallel, tensor_aware_state_dict) and
    # parallel_state synchronise the CUDA stream around saves and barriers.
    torch.cuda.synchronize = lambda device=None: None

    # The model-parallel RNG tracker forks the CUDA generator (dropout, weight init in TP regions);
    # keep the same named-state semantics on the CPU generator instead.
    base = mrandom.CudaRNGStatesTracker
    cpu_tracker_cls = type("CpuRNGStatesTracker", (base,), dict(_CpuRNGStatesTracker.__dict__))
    tracker = cpu_tracker_cls()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # model_parallel_cuda_manual_seed calls torch.cuda.manual_seed for the default state; seed CPU.
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    # _get_all_rng_states/_set_all_rng_states (activation recompute) read the CUDA generator.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    assert tensor_parallel.get_cuda_rng_tracker() is tracker

    # The default causal mask of the local DotProductAttention is built with device="cuda".
    tutils.get_default_causal_mask = functools.lru_cache(maxsize=8)(_cpu_causal_mask)
    fused_softmax.get_default_causal_mask = tutils.get_default_causal_mask
    _patch_moe_dispatcher()
    # gloo's all_gather / reduce_scatter take equal sizes only; the alltoall dispatcher gathers
    # uneven token counts over expert TP when expert TP > 1 and EP > 1
    _patch_uneven_gather()

    # Context parallelism: RoPE picks this CP rank's chunks of the position table with an index
    # tensor built in pinned memory and moved with .cuda(); the same selection on the CPU.
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rope_utils.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank

    # Pipeline parallelism. forward_backward_no_pipelining / _pipelining_without_interleaving /
    # _pipelining_with_interleaving count tokens in torch.zeros([], device="cuda"); the p2p
    # communicator's buffers use torch.cuda.current_device() and its batched sends
    # torch.cuda.synchronize() (both patched above).
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuTorchForSchedules("torch")
    # LanguageModule.setup_embeddings_and_output_layer moves the last stage's copy of tied
    # embeddings with weight.data.cuda() before all-reducing it with the first stage's.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _without_tensor_cuda(
        LanguageModule.setup_embeddings_and_output_layer
    )

    _APPLIED = True
    log.info("megatron-core CPU patches applied")
    return True
