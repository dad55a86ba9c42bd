"""The policy model of the GRPO trainer: a megatron-core GPTModel plus its optimizer.

Runs on GPU with megatron's own machinery (``DistributedDataParallel``, ``get_megatron_optimizer``:
bf16 params with fp32 main params, optional distributed optimizer) and on CPU with gloo after
:func:`cpu_compat.apply_cpu_patches` (torch AdamW over the local shards, manual DP all-reduce).

Batches are dicts of tensors with a leading batch dim ``B``:
``input_ids (B, T) long`` and ``attention_mask (B, T)`` (1 = real token, 0 = padding, anywhere:
left-padded prompts and right-padded responses alike). Every method that takes a batch must be
called by all ranks of a model-parallel (tensor x pipeline) group with the same batch; data-parallel
ranks take different batches.

Padding never reaches the model: each row's real tokens are packed to the front (order kept), the
batch is cut to the longest row, the model runs plain causal attention with positions 0..n-1
(exactly HF's ``position_ids = cumsum(mask) - 1``), and results are scattered back to the original
columns.

Log-prob convention, aligned with ``input_ids``: ``logprobs[b, t] = log p(input_ids[b, t] | real
tokens of input_ids[b, :t])`` where token ``t`` is real and some earlier token is real; 0 elsewhere
(padding, and the first real token of a row). ``entropy[b, t]`` is the entropy of that same
predictive distribution, with the same zeros. Both are computed vocab-parallel (no full-vocab
gather under TP).

Pipeline parallelism (``pp`` > 1, optionally ``vpp`` model chunks per stage, megatron's interleaved
schedule): each rank builds its chunks (embedding on the first stage, final norm and output layer on
the last) and runs megatron's own schedules (``get_forward_backward_func``) over the packed
micro-batches. Every micro-batch of one call runs at one shape, (micro-batch size, the call's longest
packed row), padded at the end (causal attention: trailing padding changes nothing before it), so
stages know each activation's shape without exchanging it. Megatron's alternative,
``variable_seq_lengths``, exchanges shapes through batched p2p in an order that, with interleaving at
PP=2 (previous and next stage are one peer), pairs an activation's shape with a gradient's: it
deadlocks (and costs a shape round trip per transfer). The price is padding work on micro-batches
shorter than the longest; rows sorted by length before the call (as ``sft.packing`` does) keep it
small. With ``vpp``, a call with fewer micro-batches than stages runs filler micro-batches (results
dropped, loss zeroed) because the interleaved schedule needs at least ``pp``. Log-probs, entropy
and the loss are computed on the last stage and broadcast over the pipeline group, so every method
returns the same result on every rank of a model-parallel group (call them on every rank of it,
with the same batch). Tied embeddings keep a copy on the last stage whose gradient is summed with the
first stage's (megatron's ``finalize_model_grads`` on GPU, the same all-reduce on CPU).

Context parallelism (``ParallelConfig.cp``): every rank of a CP group takes the same batch; the
packed length is padded to a multiple of ``2 * cp`` (padding columns are ignored), each CP rank runs
its load-balanced share of the sequence (:mod:`.context_parallel`), attention all-gathers keys and
values over the CP group, and the per-token log-probs / entropy are all-gathered back, so loss
functions see the full ``(B, T)`` tensors exactly as with ``cp = 1``. Gradients are averaged over
DP x CP. Sequence parallelism works with the local spec too (:mod:`.sequence_parallel`), on CPU
with gloo as well; it needs TP > 1. Mixture-of-experts models (qwen3_moe, qwen2_moe) run with
expert parallelism (:mod:`.moe`): on CPU, expert gradients are averaged over the
expert-data-parallel group and the grad norm counts each expert shard once; on GPU megatron's DDP
and optimizer do the same with their expert buffers.

Not supported yet (``MegatronConfigError`` at construction): context parallelism together with
pipeline parallelism; virtual pipeline stages for MoE models; layer counts that ``pp`` (x ``vpp``)
does not divide.

Memory: activation recompute (:class:`RecomputeConfig`, megatron's full / selective recompute) and
``overrideTransformerConfig`` are applied to the ``TransformerConfig`` before the model is built.
:meth:`MegatronActor.offload` / :meth:`MegatronActor.onload` give the GPU memory of parameters,
gradient buffers and optimizer state (fp32 main params, Adam moments) to a colocated rollout engine
and take it back (see :mod:`.offload`); on CPU they only check state. While offloaded, every method
that would touch the weights raises.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import all_reduce_grads, dist_env_from_environ, init_distributed
from . import hf_weights, moe
from .context_parallel import gather_from_cp, local_positions, sequence_multiple, split_for_cp
from .cpu_compat import apply_cpu_patches
from .model_config import (
    MegatronConfigError,
    MegatronModelConfig,
    build_model_chunks,
    megatron_config_from_hf,
)
from .offload import CATEGORIES, OffloadStateError, StorageOffloader, assert_materialized

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, "torch.Tensor | None", dict], "tuple[torch.Tensor, dict[str, Any]]"]
_PAD_LOGIT = -1e30  # logits of padded vocab entries: exp() is exactly 0 and 0 * _PAD_LOGIT is finite


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel layout (sizes multiply: world = tp * pp * cp * dp; ``vpp``: model chunks per
    pipeline stage, interleaved schedule, needs ``pp`` > 1). Experts: ``ep`` expert parallel x ``etp``
    expert tensor parallel (default ``tp``) ranks share a layer's experts; megatron carves them out of
    the same ranks (``etp * ep * pp`` divides the world)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    @classmethod
    def from_spec(cls, megatron_spec: Any) -> ParallelConfig:
        """From ``spec.megatron`` (the RLJob API's megatron section)."""
        m = megatron_spec
        return cls(
            tp=m.tensor_model_parallel_size,
            pp=m.pipeline_model_parallel_size,
            vpp=m.virtual_pipeline_model_parallel_size,
            cp=m.context_parallel_size,
            ep=m.expert_model_parallel_size,
            etp=m.expert_tensor_parallel_size,
            sequence_parallel=m.sequence_parallel,
            use_distributed_optimizer=m.use_distributed_optimizer,
        )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping and linear warm-up to ``lr``."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # <= 0 disables clipping (the norm is still reported)
    lr_warmup_steps: int = 0


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute: megatron's ``recompute_granularity`` / ``recompute_method`` /
    ``recompute_num_layers``. ``granularity``: ``none``, ``selective`` (core attention, or the
    ``recompute_modules`` of ``overrideTransformerConfig``) or ``full`` (whole layers; ``method``
    ``uniform``: groups of ``num_layers`` layers, ``block``: the first ``num_layers`` layers of each
    pipeline stage). ``method`` and ``num_layers`` only apply to ``full``."""

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    @classmethod
    def from_spec(cls, megatron_spec: Any, gradient_checkpointing: bool = False) -> RecomputeConfig:
        """From ``spec.megatron`` (any object with ``recompute_granularity``, ``recompute_method``,
        ``recompute_num_layers``, enum or str); ``spec.model.gradientCheckpointing`` is shorthand for
        full / uniform / 1 layer when the granularity is ``none``."""

        def value(name: str, default: Any) -> Any:
            v = getattr(megatron_spec, name, default) if megatron_spec is not None else default
            return getattr(v, "value", v)

        granularity = value("recompute_granularity", "none") or "none"
        if granularity == "none" and gradient_checkpointing:
            return cls("full", "uniform", 1)
        return cls(
            str(granularity), str(value("recompute_method", "uniform")), int(value("recompute_num_layers", 1))
        )


def valid_logprob_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T) bool``: positions whose log-prob is defined (a real token after a real token)."""
    m = attention_mask.bool()
    return m & (torch.cumsum(m.long(), dim=1) > 1)


def _pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1):
    """Move each row's real tokens to the front (order kept) and cut to the longest row, rounded up
    to ``multiple``. Returns (ids (B, Tc), order (B, Tc): original column of each packed token,
    lengths (B,))."""
    m = attention_mask.bool()
    t = input_ids.shape[1]
    lengths = m.sum(dim=1)
    tc = max(int(lengths.max().item()) if lengths.numel() else 1, 1)
    tc = -(-tc // multiple) * multiple
    if tc > t:  # only with multiple > 1 (sequence parallel): extra padding columns
        input_ids = torch.nn.functional.pad(input_ids, (0, tc - t))
        m = torch.nn.functional.pad(m, (0, tc - t))
    order = torch.argsort((~m).to(torch.int32), dim=1, stable=True)[:, :tc]
    return torch.gather(input_ids, 1, order), order, lengths


def _unpack(values: torch.Tensor, order: torch.Tensor, lengths: torch.Tensor, t: int) -> torch.Tensor:
    """Inverse of :func:`_pack` for per-token values ``(B, Tc)`` aligned with the packed ids.

    Position 0 and positions past each row's length become 0 (differentiable).
    """
    tc = values.shape[1]
    j = torch.arange(tc, device=values.device)
    keep = (j[None, :] >= 1) & (j[None, :] < lengths[:, None])
    values = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    out = torch.zeros(
        values.shape[0], max(t, int(order.max().item()) + 1), dtype=values.dtype, device=values.device
    )
    return out.scatter(1, order, values)[:, :t]


def _split(batch: Mapping[str, Any], micro_batch_size: int) -> Iterator[dict[str, Any]]:
    b = batch["input_ids"].shape[0]
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    for start in range(0, b, micro_batch_size):
        end = min(start + micro_batch_size, b)
        yield {
            k: (v[start:end] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b else v)
            for k, v in batch.items()
        }


@dataclass
class _Packed:
    """One micro-batch as the model sees it: ids (b, Tc) with real tokens packed to the front, and
    what :func:`_unpack` needs to bring per-token values back to the batch's ``t`` columns."""

    ids: torch.Tensor
    positions: torch.Tensor
    order: torch.Tensor
    lengths: torch.Tensor
    t: int
    micro_batch: dict[str, Any]
    filler: bool = False  # run only to satisfy the interleaved schedule; its results are dropped

    def padded_to(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) padded to ``(rows, cols)`` with token 0 at the end of rows and columns."""
        b, tc = self.ids.shape
        ids = torch.nn.functional.pad(self.ids, (0, cols - tc, 0, rows - b))
        positions = torch.arange(cols, device=ids.device).expand_as(ids)
        return ids, positions

    def padding_mask(self, rows: int, cols: int) -> torch.Tensor:
        """``(rows, cols) bool``, True where :meth:`padded_to` put padding (a filler: everywhere)."""
        real = torch.arange(cols, device=self.ids.device)[None, :] < self.lengths[:, None]
        real = torch.nn.functional.pad(real, (0, 0, 0, rows - real.shape[0]))
        return torch.ones_like(real) if self.filler else ~real


def _interleaving_group(num_micro_batches: int, pp: int) -> int:
    """Micro-batches per virtual-stage group for megatron's interleaved schedule, which needs
    ``pp <= group <= M`` and ``M % group`` either 0 or >= ``pp``: the smallest such group (megatron's
    default is ``pp``; a larger one only when ``pp`` leaves a short remainder)."""
    for group in range(pp, num_micro_batches + 1):
        rest = num_micro_batches % group
        if rest == 0 or rest >= pp:
            return group
    raise ValueError(f"{num_micro_batches} micro-batches cannot be interleaved over {pp} stages")


class MegatronActor:
    """Owns this rank's model shard (its pipeline stage's chunks) and optimizer. Build with
    :meth:`from_hf`.

    ``models``: what the schedule runs, one per model chunk (DDP(Float16Module(GPTModel)) on GPU,
    GPTModel on CPU); ``chunks``: the GPTModels; ``core``: the GPTModel with one chunk, else a
    ``ModuleList`` of the chunks (``core.parameters()`` is every parameter of this rank either way).
    """

    def __init__(
        self,
        models: list[torch.nn.Module],
        chunks: list[torch.nn.Module],
        optimizer: Any,
        hf_config,
        mcfg: MegatronModelConfig,
        parallel: ParallelConfig,
        optim: OptimConfig,
        dtype: torch.dtype,
        with_entropy: bool = False,
    ) -> None:
        from megatron.core import parallel_state as ps

        self.models = models
        self.chunks = chunks
        self.model = models[0] if len(models) == 1 else torch.nn.ModuleList(models)
        self.core = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        self.optimizer = optimizer
        self.hf_config = hf_config
        self.mcfg = mcfg
        self.parallel = parallel
        self.optim = optim
        self.dtype = dtype
        self.loss_fn_needs_entropy = with_entropy
        self.on_gpu = torch.cuda.is_available()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        )
        self.step = 0  # optimizer steps taken
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        self.last_stage_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank
        # context parallel (CP): ranks of a CP group share a batch, each runs a share of the sequence
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_group = ps.get_context_parallel_group()
        # offload: on CPU there is no memory to give back, so offload()/onload() only check state;
        # setting this True (or RLJOB_OFFLOAD_ON_CPU=1) runs the real storage release/restore on CPU
        # too (tests).
        self.offload_enabled = self.on_gpu or os.environ.get("RLJOB_OFFLOAD_ON_CPU") == "1"
        self._offloader = StorageOffloader(host_pin=self.on_gpu)
        self._offloaded: dict[str, bool] | None = None  # the flags of the offload in effect

    # ----------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_hf(
        cls,
        hf_dir: str | os.PathLike,
        parallel: ParallelConfig = ParallelConfig(),
        optim: OptimConfig = OptimConfig(lr=1e-6),
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        with_entropy: bool = False,
        trainable: bool = True,
        recompute: RecomputeConfig = RecomputeConfig(),
        transformer_overrides: Mapping[str, Any] | None = None,
    ) -> MegatronActor:
        """Build the model from an HF checkpoint directory (config.json + safetensors).

        Initialises torch.distributed from the environment if needed, then megatron's model-parallel
        state and RNG. ``dtype``: compute dtype (bf16 on GPU keeps fp32 main params in the optimizer;
        on CPU the parameters themselves have ``dtype``). ``trainable=False`` builds a frozen model
        (a reference policy): no optimizer, no DDP, no gradient buffers; :meth:`update` refuses.
        ``recompute``: activation recompute (only acts in training mode, i.e. in :meth:`update`).
        ``transformer_overrides``: ``spec.megatron.overrideTransformerConfig`` (extra
        ``TransformerConfig`` fields, validated: ``ValueError`` naming the key).
        """
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            apply_cpu_patches()
        if parallel.vpp == 1:
            parallel = replace(parallel, vpp=None)  # one chunk per stage: no interleaving
        _check_parallel(parallel, on_gpu)
        hf_config = hf_weights.load_hf_config(hf_dir)
        _check_layer_split(hf_config.num_hidden_layers, parallel)
        if not dist.is_initialized():
            init_distributed(dist_env_from_environ(os.environ))
        _init_model_parallel(parallel)

        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

        if trainable:
            moe.check_training_layout(hf_config, parallel.tp, parallel.sequence_parallel)
        if moe.is_moe(hf_config):
            if parallel.vpp is not None:
                raise MegatronConfigError(
                    f"spec.megatron.virtualPipelineModelParallelSize={parallel.vpp} is not supported for "
                    "mixture-of-experts models yet (their layer specs are built per pipeline stage); unset it"
                )
            moe.reset_aux_loss_tracker()
        mcfg = megatron_config_from_hf(
            hf_config,
            tp=parallel.tp,
            pp=parallel.pp,
            cp=parallel.cp,
            ep=parallel.ep,
            etp=parallel.etp,
            vpp=parallel.vpp,
            dtype=dtype,
            sequence_parallel=parallel.sequence_parallel,
            on_gpu=on_gpu,
            recompute_granularity=recompute.granularity,
            recompute_method=recompute.method,
            recompute_num_layers=recompute.num_layers,
            overrides=transformer_overrides,
        )
        chunks = build_model_chunks(mcfg)
        if on_gpu:  # megatron builds linears on the GPU but torch norms on the CPU
            for chunk in chunks:
                chunk.cuda(torch.cuda.current_device())
        hf_weights.load_hf_weights(chunks, hf_dir, hf_config)

        if not trainable:
            for chunk in chunks:
                chunk.requires_grad_(False)
            models, optimizer = list(chunks), None
            if on_gpu and dtype in (torch.bfloat16, torch.float16):
                from megatron.core.transformer.module import Float16Module

                models = [Float16Module(mcfg.transformer_config, chunk) for chunk in chunks]
        elif on_gpu:
            models, optimizer = _gpu_wrap(chunks, mcfg, parallel, optim, dtype)
            # the pipeline schedule scales each last-stage loss before its backward
            mcfg.transformer_config.grad_scale_func = optimizer.scale_loss
        else:
            params = torch.nn.ModuleList(chunks) if len(chunks) > 1 else chunks[0]
            models, optimizer = list(chunks), _cpu_adamw(params, optim)
        return cls(models, chunks, optimizer, hf_config, mcfg, parallel, optim, dtype, with_entropy)

    # ----------------------------------------------------------------------------------------------
    # forward

    def _pack_micro_batch(self, mb: dict[str, Any]) -> _Packed:
        input_ids = mb["input_ids"].to(self.device)
        attention_mask = mb["attention_mask"].to(self.device)
        sp_tp = self.tp_size if self.parallel.sequence_parallel else 1
        multiple = sequence_multiple(self.cp_size, sp_tp)  # CP: 2 * cp chunks; SP: TP splits each
        ids, order, lengths = _pack(input_ids, attention_mask, multiple)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        return _Packed(ids, positions, order, lengths, input_ids.shape[1], mb)

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_entropy: bool, logits_only=False
    ):
        """Per-token (logprobs, entropy) of one micro-batch, ``(b, T)`` each; entropy may be None.
        One pipeline stage only (the whole model on this rank)."""
        packed = self._pack_micro_batch({"input_ids": input_ids, "attention_mask": attention_mask})
        # CP: this rank's share of the columns, at their global positions (identity for cp = 1)
        local_ids = split_for_cp(packed.ids, self.cp_size, self.cp_rank)
        positions = local_positions(packed.ids.shape[1], self.cp_size, self.cp_rank, self.device)
        extra = {}
        if moe.is_moe(self.hf_config):  # the router's load-balancing loss counts real tokens only
            pad = torch.arange(packed.ids.shape[1], device=self.device)[None, :] >= packed.lengths[:, None]
            extra["padding_mask"] = split_for_cp(pad, self.cp_size, self.cp_rank)  # (b, Tc/cp) True = pad
        logits = self.model(local_ids, positions.expand_as(local_ids), None, **extra)  # (b, Tc/cp, V/tp), fp32
        logits = self._mask_vocab_padding(logits.float())
        if logits_only:
            return gather_from_cp(logits, self.cp_group), packed.order, packed.lengths
        return self._token_values(logits, packed, with_entropy)

    def _token_values(self, logits: torch.Tensor, packed: _Packed, with_entropy: bool):
        """(logprobs, entropy | None), ``(b, T)`` each, from the vocab-parallel logits of ``packed``
        (under CP: of this rank's columns, ``(b, Tc / cp, V / tp)``)."""
        from megatron.core import tensor_parallel

        order, lengths, t = packed.order, packed.lengths, packed.t
        # next-token targets aligned with the logits that predict them; the last column is a dummy
        targets = torch.nn.functional.pad(packed.ids[:, 1:], (0, 1))
        local_targets = split_for_cp(targets, self.cp_size, self.cp_rank)  # CP
        entropy = None
        if with_entropy:  # before the cross entropy, which overwrites its input in place
            ent_next = gather_from_cp(vocab_parallel_entropy(logits), self.cp_group)  # CP: (b, Tc)
            entropy = _unpack(torch.nn.functional.pad(ent_next[:, :-1], (1, 0)), order, lengths, t)
        lp_next = -tensor_parallel.vocab_parallel_cross_entropy(logits, local_targets)
        lp_next = gather_from_cp(lp_next, self.cp_group)  # CP: (b, Tl) -> (b, Tc)
        logprobs = _unpack(torch.nn.functional.pad(lp_next[:, :-1], (1, 0)), order, lengths, t)
        return logprobs, entropy

    # ----------------------------------------------------------------------------------------------
    # pipeline parallelism: megatron's schedules; results live on the last stage, then broadcast

    def _run_pipeline(self, micro_batches: list[dict[str, Any]], on_logits, forward_only: bool) -> list[Any]:
        """Run megatron's pipeline schedule over ``micro_batches``. On the last stage
        ``on_logits(packed, logits) -> (loss, result)`` handles each micro-batch's fp32
        vocab-parallel logits; ``loss / len(micro_batches)`` is back-propagated unless
        ``forward_only``. Returns the results in micro-batch order on the last stage, [] elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        packed = [self._pack_micro_batch(mb) for mb in micro_batches]
        packed = self._fill_for_interleaving(packed)
        scale = len(packed) / len(micro_batches)  # megatron divides each loss by its micro-batch count
        rows = max(p.ids.shape[0] for p in packed)
        cols = max(p.ids.shape[1] for p in packed)

        def loss_func(item: _Packed, logits: torch.Tensor):
            b, tc = item.ids.shape
            logits = self._mask_vocab_padding(logits[:b, :tc].float().contiguous())
            if item.filler:
                return logits.sum() * 0.0, None
            loss, result = on_logits(item, logits)
            return loss * scale, result

        def forward_step(data_iterator, model):
            item = next(data_iterator)
            # the router's load-balancing loss counts real tokens only (as in _forward)
            extra = {"padding_mask": item.padding_mask(rows, cols)} if moe.is_moe(self.hf_config) else {}
            # stages after the first take their input from the previous stage (set by the schedule)
            return model(*item.padded_to(rows, cols), None, **extra), functools.partial(loss_func, item)

        one = len(self.models) == 1
        iterators = [iter(packed) for _ in self.models]
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators[0] if one else iterators,
            model=self.models[0] if one else self.models,
            num_microbatches=len(packed),
            seq_length=cols,
            micro_batch_size=rows,
            forward_only=forward_only,
        )
        return [r for r in results if r is not None] if self.is_last_stage else []

    def _fill_for_interleaving(self, packed: list[_Packed]) -> list[_Packed]:
        """The interleaved (VPP) schedule needs at least ``pp`` micro-batches: repeat the last one as
        filler (its loss is zeroed and its results dropped), and pick the micro-batch group size."""
        if len(self.models) == 1:
            return packed
        fillers = [replace(packed[-1], filler=True) for _ in range(self.pp_size - len(packed))]
        packed = packed + fillers
        self.mcfg.transformer_config.microbatch_group_size_per_vp_stage = _interleaving_group(
            len(packed), self.pp_size
        )
        return packed

    def _broadcast_from_last_stage(self, tensor: torch.Tensor | None, shape, dtype=torch.float32) -> torch.Tensor:
        """The last stage's ``tensor`` on every rank of the pipeline group (returned on the CPU)."""
        if self.pp_size == 1:
            return tensor
        if self.is_last_stage:
            buf = tensor.to(device=self.device, dtype=dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=self.last_stage_rank, group=self.pp_group)
        return buf.cpu()

    def _broadcast_object_from_last_stage(self, obj: Any) -> Any:
        if self.pp_size == 1:
            return obj
        box = [obj if self.is_last_stage else None]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pp_group, device=self.device)
        return box[0]

    def _set_training(self, mode: bool) -> None:
        for model in self.models:
            model.train(mode)

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        if self.mcfg.padded_vocab_size == self.mcfg.hf_vocab_size:
            return logits
        chunk = logits.shape[-1]
        cols = torch.arange(chunk, device=logits.device) + self.tp_rank * chunk
        return logits.masked_fill(cols >= self.mcfg.hf_vocab_size, _PAD_LOGIT)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int, with_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """``{"logprobs": (B, T) fp32, "entropy": (B, T) fp32 if with_entropy}`` on CPU, no grad."""
        self._require_onloaded("compute_logprobs")
        if self.pp_size > 1:
            return self._pipeline_logprobs(batch, micro_batch_size, with_entropy)
        self.model.eval()
        lps, ents = [], []
        for mb in _split(batch, micro_batch_size):
            lp, ent = self._forward(mb["input_ids"], mb["attention_mask"], with_entropy)
            lps.append(lp.cpu())
            if with_entropy:
                ents.append(ent.cpu())
        self.model.train()
        out = {"logprobs": torch.cat(lps)}
        if with_entropy:
            out["entropy"] = torch.cat(ents)
        return out

    def _pipeline_logprobs(self, batch, micro_batch_size: int, with_entropy: bool) -> dict[str, torch.Tensor]:
        def on_logits(packed: _Packed, logits: torch.Tensor):
            lp, ent = self._token_values(logits, packed, with_entropy)
            return torch.zeros((), device=logits.device), (lp, ent)

        self._set_training(False)
        results = self._run_pipeline(list(_split(batch, micro_batch_size)), on_logits, forward_only=True)
        self._set_training(True)
        shape = tuple(batch["input_ids"].shape)
        keys = ["logprobs", "entropy"] if with_entropy else ["logprobs"]
        return {
            key: self._broadcast_from_last_stage(
                torch.cat([r[i] for r in results]) if self.is_last_stage else None, shape
            )
            for i, key in enumerate(keys)
        }

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits ``(B, T, V)`` (HF vocab, gathered over TP) at the original positions;
        zeros at padding. For tests and debugging: it gathers the vocab."""
        self._require_onloaded("forward_logits")
        if self.pp_size == 1:
            self.model.eval()
            logits, order, lengths = self._forward(input_ids, attention_mask, False, logits_only=True)
            self.model.train()
            return self._full_vocab_logits(logits, order, lengths, input_ids.shape[1])

        def on_logits(packed: _Packed, logits: torch.Tensor):
            full = self._full_vocab_logits(logits, packed.order, packed.lengths, packed.t)
            return torch.zeros((), device=logits.device), full

        self._set_training(False)
        mb = {"input_ids": input_ids, "attention_mask": attention_mask}
        results = self._run_pipeline([mb], on_logits, forward_only=True)
        self._set_training(True)
        shape = (*input_ids.shape, self.mcfg.hf_vocab_size)
        return self._broadcast_from_last_stage(results[0] if self.is_last_stage else None, shape)

    def _full_vocab_logits(self, logits, order, lengths, t: int) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        input_t = t
        logits = gather_from_tensor_model_parallel_region(logits)[..., : self.mcfg.hf_vocab_size]
        b, tc, v = logits.shape
        j = torch.arange(tc, device=logits.device)
        logits = logits * (j[None, :] < lengths[:, None].to(logits.device))[..., None]
        out = torch.zeros(b, max(input_t, int(order.max()) + 1), v, dtype=logits.dtype, device=logits.device)
        out.scatter_(1, order[..., None].expand(b, tc, v).to(logits.device), logits)
        return out[:, :input_t].cpu()

    @torch.no_grad()
    def eval_loss(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, micro_batch_size: int = 8
    ) -> float:
        """Mean next-token NLL over the positions of :func:`valid_logprob_mask`."""
        lp = self.compute_logprobs(
            {"input_ids": input_ids, "attention_mask": attention_mask}, micro_batch_size
        )
        mask = valid_logprob_mask(attention_mask)
        return float(-(lp["logprobs"] * mask).sum() / mask.sum().clamp(min=1))

    # ----------------------------------------------------------------------------------------------
    # update

    def current_lr(self) -> float:
        warm = self.optim.lr_warmup_steps
        return self.optim.lr * min(1.0, (self.step + 1) / warm) if warm > 0 else self.optim.lr

    def update(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        micro_batch_size: int,
        with_entropy: bool | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's share of the mini-batch).

        For each micro-batch: ``loss, metrics = loss_fn(logprobs (b, T), entropy (b, T) | None,
        micro_batch)``; ``loss / num_micro_batches`` is back-propagated. Gradients are averaged over
        data-parallel ranks, clipped to ``grad_clip`` by their global norm (TP shards counted once),
        then AdamW steps. Returns the micro-batch mean of each metric (and of ``loss``), averaged
        over DP ranks, plus ``grad_norm`` and ``lr``. A non-finite grad norm skips the step
        (``skipped`` = 1).
        """
        if self.optimizer is None:
            raise RuntimeError("this actor was built with trainable=False (a frozen reference model)")
        self._require_onloaded("update")
        with_entropy = self.loss_fn_needs_entropy if with_entropy is None else with_entropy
        lr = self.current_lr()
        micro_batches = list(_split(batch, micro_batch_size))
        n = len(micro_batches)
        self._set_training(True)
        self._zero_grad()
        self._moe_aux_begin(n)
        if self.pp_size > 1:
            sums = self._pipeline_backward(micro_batches, loss_fn, with_entropy)
        else:
            sums = self._sequential_backward(micro_batches, loss_fn, with_entropy)
        if self.on_gpu:
            grad_norm, skipped = self._gpu_step(lr)
        else:
            grad_norm, skipped = self._cpu_step(lr)
        if not skipped:
            self.step += 1
        out = self._dp_mean({**{k: v / n for k, v in sums.items()}, **self._moe_aux_end(n)})
        out.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        return out

    def _sequential_backward(self, micro_batches, loss_fn: LossFn, with_entropy: bool) -> dict[str, float]:
        """One stage: forward and backward of each micro-batch in turn. Returns the summed ``loss``
        and metrics."""
        n = len(micro_batches)
        sums: dict[str, float] = {}
        for mb in micro_batches:
            lp, ent = self._forward(mb["input_ids"], mb["attention_mask"], with_entropy)
            mb_dev = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}
            loss, metrics = loss_fn(lp, ent, mb_dev)
            scaled = loss / n
            if self.on_gpu:
                scaled = self.optimizer.scale_loss(scaled)
            scaled.backward()
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach() if isinstance(v, torch.Tensor) else v)
        return sums

    def _pipeline_backward(self, micro_batches, loss_fn: LossFn, with_entropy: bool) -> dict[str, float]:
        """Forward and backward of every micro-batch through the pipeline; ``loss_fn`` runs on the
        last stage. Returns the summed ``loss`` and metrics on every rank of the pipeline group."""

        def on_logits(packed: _Packed, logits: torch.Tensor):
            lp, ent = self._token_values(logits, packed, with_entropy)
            mb_dev = {
                k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in packed.micro_batch.items()
            }
            loss, metrics = loss_fn(lp, ent, mb_dev)
            values = {"loss": loss, **metrics}
            return loss, {k: float(v.detach() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}

        results = self._run_pipeline(micro_batches, on_logits, forward_only=False)
        sums: dict[str, float] = {}
        for metrics in results:
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        return self._broadcast_object_from_last_stage(sums)

    def _moe_aux_begin(self, num_micro_batches: int) -> None:
        if moe.is_moe(self.hf_config):  # aux-loss grads scaled like the main loss (1 / micro-batches)
            moe.pop_aux_loss(1, 0)
            scale = self.optimizer.get_loss_scale() if self.on_gpu else 1.0
            moe.set_aux_loss_scale(float(scale) / num_micro_batches, self.device)

    def _moe_aux_end(self, num_micro_batches: int) -> dict[str, float]:
        """``{"moe_aux_loss": ...}`` (the unscaled load-balancing loss) when megatron computed one."""
        if not moe.is_moe(self.hf_config) or not moe.aux_loss_enabled(self.mcfg.transformer_config):
            return {}
        aux = moe.pop_aux_loss(num_micro_batches, sum(moe.moe_layer_pattern(self.hf_config)))
        if self.pp_size > 1:  # each stage tracked its own layers: sum them (every stage joins)
            t = torch.tensor([aux or 0.0, float(aux is not None)], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=self.pp_group)
            aux = float(t[0]) if t[1] > 0 else None
        return {} if aux is None else {"moe_aux_loss": aux}

    def _zero_grad(self) -> None:
        if self.on_gpu:
            for model in self.models:
                model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _dp_mean(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.dp_size == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return {k: float(v) / self.dp_size for k, v in zip(keys, t.tolist())}

    def _gpu_step(self, lr: float) -> tuple[float, bool]:
        from megatron.core.distributed import finalize_model_grads

        # DP all-reduce (or reduce-scatter) of the grad buffers; with PP, tied embedding grads too
        finalize_model_grads(self.models)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        return grad_norm, not ok

    def _cpu_step(self, lr: float) -> tuple[float, bool]:
        from megatron.core import parallel_state as ps

        from .sequence_parallel import tp_partial_grad_params

        params = [p for p in self.core.parameters() if p.requires_grad]
        self._cpu_sum_tied_embedding_grads(params)
        experts = moe.expert_params(self.core)
        expert_ids = {id(p) for p in experts}
        dense = [p for p in params if id(p) not in expert_ids]
        grads = [p.grad for p in dense if p.grad is not None]
        # SP norms and q/k norms: partial grads on each TP rank, summed as finalize_model_grads does
        partial = tp_partial_grad_params(self.core.named_parameters(), self.mcfg.transformer_config)
        all_reduce_grads(partial, self.tp_group)
        # average over DP x CP (gloo), as megatron's DDP does on GPU (see context_parallel.gather_from_cp)
        dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        all_reduce_grads(dense, dp_cp_group, divisor=dist.get_world_size(dp_cp_group))
        # experts: summed over the expert-DP group (which spans the CP ranks too), scaled by 1 / (DP x CP)
        moe.average_expert_grads(experts, self.dp_size * self.cp_size)
        grad_norm = self._cpu_grad_norm(dense, experts)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            clip = self.optim.grad_clip
            if clip > 0 and grad_norm > clip:
                coef = clip / (grad_norm + 1e-6)
                for g in grads + [p.grad for p in experts if p.grad is not None]:
                    g.mul_(coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _cpu_sum_tied_embedding_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Tied embeddings under PP: the first stage's embedding and the last stage's copy of it
        both get the sum of their gradients (what megatron's finalize_model_grads does on GPU)."""
        if self.pp_size == 1 or not self.mcfg.tie_word_embeddings:
            return
        from megatron.core import parallel_state as ps

        for p in params:
            if getattr(p, "shared_embedding", False):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=ps.get_embedding_group())

    def _cpu_grad_norm(
        self, params: list[torch.nn.Parameter], experts: list[torch.nn.Parameter] = ()
    ) -> float:
        """Global L2 norm over TP and PP; params replicated over TP (norms) are counted on TP rank 0
        only, the last stage's copy of tied embeddings (``shared``) not at all, expert params once per
        expert shard (:func:`moe.expert_grad_sq`, summed over the pipeline stages too)."""
        from megatron.core import parallel_state as ps

        sq = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is None or getattr(p, "shared", False):
                continue
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                sq += p.grad.detach().double().pow(2).sum()
        if self.tp_size * self.pp_size > 1:
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        if moe.is_moe(self.hf_config):  # every stage joins, one without expert layers with 0
            expert_sq = moe.expert_grad_sq(list(experts))
            if self.pp_size > 1:
                dist.all_reduce(expert_sq, group=self.pp_group)
            sq += expert_sq
        return float(sq.sqrt())

    # ----------------------------------------------------------------------------------------------
    # memory: offload between phases

    @property
    def is_offloaded(self) -> bool:
        return self._offloaded is not None

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Give the GPU memory of the parameters, gradient buffers and/or optimizer state (fp32 main
        params and Adam moments; with the distributed optimizer, this rank's shards) back, e.g. to a
        colocated rollout engine, until :meth:`onload`. Returns the bytes released per category.

        Parameters and optimizer state are copied to pinned host memory; gradient buffers are dropped
        (:meth:`update` zeroes them first anyway) and come back zeroed. Every tensor object and view
        stays the same (their storages are released and reallocated), so DDP's buffers, the
        optimizer's references and ``param.main_grad`` stay wired. On CPU this only checks state
        (unless ``offload_enabled`` is set). Not collective; each rank offloads its own shards.
        While offloaded, forward passes, updates, weight export and checkpoints raise.
        """
        import time

        if self._offloaded is not None:
            raise OffloadStateError(f"already offloaded ({self._offloaded}); call onload() first")
        want = {"params": bool(params), "grads": bool(grads), "optimizer": bool(optimizer)}
        groups = self._offload_groups()
        self.check_device_state(groups)
        if not any(want.values()):
            return {}
        self._offloaded = want
        if not self.offload_enabled:
            return {c: 0 for c, on in want.items() if on}
        t0 = time.perf_counter()
        freed = {}
        for c in CATEGORIES:
            if want[c]:  # scalars (torch Adam's step) and tensors elsewhere (the CPU) free nothing here
                items = [(n, t) for n, t in groups[c] if t.dim() > 0 and t.device == self.device]
                freed[c] = self._offloader.offload(c, items, keep_values=c != "grads")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info(
            "offloaded %s in %.2fs (%s)",
            ", ".join(freed),
            time.perf_counter() - t0,
            ", ".join(f"{c} {b / 2**20:.1f} MiB" for c, b in freed.items()),
        )
        return freed

    def onload(self) -> dict[str, int]:
        """Undo :meth:`offload`; then assert that every parameter, gradient buffer and optimizer
        tensor is on this actor's device with its memory (``OffloadStateError`` otherwise). Returns
        the bytes restored per category; a no-op (apart from the check) when nothing is offloaded."""
        import time

        t0 = time.perf_counter()
        restored = {c: self._offloader.onload(c) for c in CATEGORIES if c in self._offloader.offloaded}
        self._offloaded = None
        self.check_device_state()
        if restored:
            log.info("onloaded %s in %.2fs", ", ".join(restored), time.perf_counter() - t0)
        return restored

    def check_device_state(self, groups: dict[str, list[tuple[str, torch.Tensor]]] | None = None) -> int:
        """Assert every tracked tensor (parameters, buffers, gradient buffers, optimizer main params
        and state) is on this actor's device with its memory; 0-dim optimizer state (torch Adam's
        ``step``) may live on the CPU. Returns how many tensors were checked."""
        groups = self._offload_groups() if groups is None else groups
        named = [item for c in CATEGORIES for item in groups[c]]
        expected = {
            name: (t.device if name.startswith("optimizer state") and t.dim() == 0 else self.device)
            for name, t in named
        }
        return assert_materialized(named, expected, what="actor tensor")

    def _offload_groups(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """``{category: [(name, tensor)]}``; each storage belongs to the first category listing it
        (params, grads, optimizer): an fp32 optimizer's main params *are* the model params."""
        names = {id(p): n for n, p in self.core.named_parameters()}
        params = [(f"param {n}", p) for n, p in self.core.named_parameters()]
        params += [(f"buffer {n}", b) for n, b in self.core.named_buffers() if isinstance(b, torch.Tensor)]
        grads: list[tuple[str, torch.Tensor]] = []
        for c, model in enumerate(self.models):
            ddp_buffers = getattr(model, "buffers", None)  # megatron DDP: a list (nn.Module: a method)
            if not isinstance(ddp_buffers, list):
                continue
            chunk = f" (chunk {c})" if len(self.models) > 1 else ""
            for i, buf in enumerate(ddp_buffers + list(getattr(model, "expert_parallel_buffers", []))):
                if buf.param_data is not None:
                    params.append((f"ddp buffer {i}{chunk} param_data", buf.param_data))
                if buf.grad_data is not None:
                    grads.append((f"ddp buffer {i}{chunk} grad_data", buf.grad_data))
        for n, p in self.core.named_parameters():
            if getattr(p, "main_grad", None) is not None:
                grads.append((f"main_grad {n}", p.main_grad))
            if p.grad is not None:
                grads.append((f"grad {n}", p.grad))
        optim: list[tuple[str, torch.Tensor]] = []
        for k, inner in enumerate(_inner_optimizers(self.optimizer)):
            for g, group in enumerate(inner.param_groups):
                for j, mp in enumerate(group["params"]):
                    label = names.get(id(mp), f"[{k}][{g}][{j}]")
                    optim.append((f"optimizer main param {label}", mp))
                    if mp.grad is not None:
                        grads.append((f"optimizer main grad {label}", mp.grad))
                    for key, v in inner.state.get(mp, {}).items():
                        if isinstance(v, torch.Tensor):
                            optim.append((f"optimizer state {label}.{key}", v))
        out: dict[str, list[tuple[str, torch.Tensor]]] = {}
        owned: set[int] = set()
        for c, items in (("params", params), ("grads", grads), ("optimizer", optim)):
            keys = {t.untyped_storage()._cdata for _, t in items}
            out[c] = [(n, t) for n, t in items if t.untyped_storage()._cdata not in owned]
            owned |= keys
        return out

    def _require_onloaded(self, what: str) -> None:
        if self._offloaded is not None:
            raise OffloadStateError(
                f"{what}: the actor is offloaded ({self._offloaded}); call onload() first"
            )

    # ----------------------------------------------------------------------------------------------
    # weights out

    def export_hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time, on every rank (collective over the TP and PP groups:
        every rank must consume the iterator)."""
        self._require_onloaded("export_hf_weights")
        return hf_weights.export_hf_weights(self.chunks, self.hf_config, dtype=dtype)

    def save_hf_checkpoint(
        self, out_dir: str | os.PathLike, tokenizer=None, dtype: torch.dtype | None = None
    ) -> None:
        self._require_onloaded("save_hf_checkpoint")
        hf_weights.save_hf_checkpoint(self.chunks, self.hf_config, out_dir, tokenizer=tokenizer, dtype=dtype)

    # ----------------------------------------------------------------------------------------------
    # distributed checkpoints (megatron.core.dist_checkpointing: any TP layout can load them)

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """``{"model", "optimizer", "rng", "meta"}`` for ``dist_checkpointing.save/load``.

        CPU: AdamW's ``exp_avg``/``exp_avg_sq`` are sharded like their parameters (so they reshard
        across TP too); AdamW's step count is in ``meta``. GPU: megatron optimizer's own sharded
        state dict (the distributed optimizer in its ``fully_reshardable`` format).
        ``is_loading``: build it as the target of ``dist_checkpointing.load``.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        self._require_onloaded("sharded_state_dict")
        # one dict per model chunk; the tensors inside carry global layer names, so any TP / PP /
        # VPP layout can load them
        if len(self.chunks) == 1:
            model_sd = self.chunks[0].sharded_state_dict()
        else:
            model_sd = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(self.chunks)}
        if self.optimizer is not None and self.on_gpu and is_loading:
            _init_distributed_optimizer_state(self.optimizer)
        if self.optimizer is None:
            optim_sd = None
        elif self.on_gpu:
            # fully_reshardable: any TP/DP layout can load it (megatron 0.16's default format for
            # the distributed optimizer, fully_sharded_model_space, is deprecated and fails to save)
            optim_sd = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
            )
        else:
            optim_sd = self._cpu_optimizer_sharded_state_dict(model_sd)
        # one generator state per model-parallel rank (TP x PP), replicated over DP; without PP the
        # shape stays (tp,) as in checkpoints written before pipeline parallelism
        pp = (self.pp_size,) if self.pp_size > 1 else ()
        rng = ShardedObject(
            "rng_state",
            _rng_state(self.on_gpu),
            global_shape=(*pp, self.tp_size),
            global_offset=(*((self.pp_rank,) if pp else ()), self.tp_rank),
            replica_id=self.dp_rank * self.cp_size + self.cp_rank,  # CP ranks are replicas too
        )
        meta = {
            "step": self.step,
            "tp": self.tp_size,
            "ep": self.parallel.ep,
            "pp": self.pp_size,
            "vpp": self.parallel.vpp,
            "model_type": self.mcfg.model_type,
            "padded_vocab_size": self.mcfg.padded_vocab_size,
        }
        out = {"model": model_sd, "optimizer": optim_sd, "rng": rng, "meta": meta}
        if optim_sd is None:
            del out["optimizer"]
        return out

    def _cpu_optimizer_sharded_state_dict(self, model_sd) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        _init_adam_state(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        state = self.optimizer.state_dict()
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return state

    def save_checkpoint(self, ckpt_dir: str | os.PathLike) -> None:
        """Collective: every rank calls it with the same directory (created if missing).

        Every rank writes its own shard files into ``ckpt_dir`` (rank 0 also the common state and
        metadata): with node-local disks, each node's files are part of the checkpoint.
        """
        from megatron.core import dist_checkpointing

        ckpt_dir = os.fspath(ckpt_dir)
        os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self.sharded_state_dict(), ckpt_dir)
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: str | os.PathLike) -> dict[str, Any]:
        """Load model, optimizer state (not for a frozen actor) and (same TP and PP only) RNG from
        ``ckpt_dir``, written at any TP / PP / VPP / EP layout; returns its meta (``step``, ``tp``,
        ``pp``, ``vpp``, ``ep``, ``model_type``, ``padded_vocab_size``)."""
        from megatron.core import dist_checkpointing

        ckpt_dir = os.fspath(ckpt_dir)
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
        meta = dict(common.get("meta", {}))
        if meta.get("padded_vocab_size", self.mcfg.padded_vocab_size) != self.mcfg.padded_vocab_size:
            raise ValueError(
                f"checkpoint {ckpt_dir} has a padded vocab of {meta['padded_vocab_size']} (TP={meta.get('tp')}), "
                f"this model {self.mcfg.padded_vocab_size} (TP={self.tp_size}); load it with a TP that pads alike"
            )
        sd = self.sharded_state_dict(is_loading=True)
        same_layout = meta.get("tp") == self.tp_size and meta.get("pp", 1) == self.pp_size
        if not same_layout:
            del sd["rng"]  # per-rank generator states do not map onto another TP / PP layout
        loaded = dist_checkpointing.load(sd, ckpt_dir)
        if len(self.chunks) == 1:
            self.chunks[0].load_state_dict(loaded["model"], strict=True)
        else:
            for i, chunk in enumerate(self.chunks):
                chunk.load_state_dict(loaded["model"][f"model{i}"], strict=True)
        step = int(meta.get("step", 0))
        if self.optimizer is None:
            pass  # frozen model: weights only
        elif self.on_gpu:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            state = loaded["optimizer"]
            for param_state in state["state"].values():
                param_state["step"] = torch.tensor(float(step))
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": state["state"], "param_groups": groups})
        if same_layout:
            _set_rng_state(loaded["rng"], self.on_gpu)
        self.step = step
        return meta


# --------------------------------------------------------------------------------------------------
# vocab-parallel entropy


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocab from TP-sharded ``logits (..., V/tp)`` (fp32).

    H = log S - T / S with S = sum exp(z), T = sum exp(z) z, z = logits - max; S and T are
    all-reduced over the TP group (forward all-reduce, identity backward), so no rank gathers the
    vocab. Differentiable.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    m = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - m
    e = torch.exp(z)
    s = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    t = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1))
    return torch.log(s) - t / s


# --------------------------------------------------------------------------------------------------
# helpers


def _check_parallel(p: ParallelConfig, on_gpu: bool) -> None:
    if p.pp < 1:
        raise MegatronConfigError(f"spec.megatron.pipelineModelParallelSize must be >= 1, got {p.pp}")
    if p.vpp is not None and p.vpp < 1:
        raise MegatronConfigError(f"spec.megatron.virtualPipelineModelParallelSize must be >= 1, got {p.vpp}")
    if p.vpp not in (None, 1) and p.pp < 2:
        raise MegatronConfigError(
            f"spec.megatron.virtualPipelineModelParallelSize={p.vpp} needs pipeline parallelism: set "
            "spec.megatron.pipelineModelParallelSize >= 2 or unset virtualPipelineModelParallelSize"
        )
    if p.tp < 1:
        raise MegatronConfigError(f"spec.megatron.tensorModelParallelSize must be >= 1, got {p.tp}")
    if p.cp < 1:
        raise MegatronConfigError(f"spec.megatron.contextParallelSize must be >= 1, got {p.cp}")
    if p.cp > 1 and p.pp > 1:
        raise MegatronConfigError(
            f"spec.megatron.contextParallelSize={p.cp} together with pipelineModelParallelSize={p.pp} is not "
            "supported yet; use one of them (e.g. more pipeline stages, or context parallelism with PP=1)"
        )
    if p.sequence_parallel and p.tp == 1:
        raise MegatronConfigError(
            "spec.megatron.sequenceParallel=true needs spec.megatron.tensorModelParallelSize > 1 "
            "(sequence parallelism splits activations over the TP ranks); set it to false or raise TP"
        )
    if p.ep < 1 or (p.etp is not None and p.etp < 1):
        raise MegatronConfigError(
            f"spec.megatron.expertModelParallelSize={p.ep} / expertTensorParallelSize={p.etp} must be >= 1"
        )
    if p.use_distributed_optimizer and not on_gpu:
        log.warning("use_distributed_optimizer is ignored on CPU (torch AdamW over local shards)")


def _check_layer_split(num_layers: int, p: ParallelConfig) -> None:
    """Every pipeline stage (and each of its virtual chunks) gets the same number of layers."""
    chunks = p.pp * (p.vpp or 1)
    if num_layers % chunks == 0:
        return
    if p.vpp is None:
        raise MegatronConfigError(
            f"spec.megatron.pipelineModelParallelSize={p.pp} does not divide the model's {num_layers} layers; "
            "choose a pipeline size that divides the layer count"
        )
    raise MegatronConfigError(
        f"spec.megatron.pipelineModelParallelSize={p.pp} x spec.megatron.virtualPipelineModelParallelSize="
        f"{p.vpp} = {chunks} model chunks does not divide the model's {num_layers} layers; choose sizes whose "
        "product divides the layer count (or unset virtualPipelineModelParallelSize)"
    )


def _init_model_parallel(p: ParallelConfig) -> None:
    from megatron.core import parallel_state as ps

    from rljob_worker.megatron.model_config import MegatronConfigError

    world = dist.get_world_size()
    if world % (p.tp * p.pp * p.cp) != 0:
        raise MegatronConfigError(
            f"world size {world} is not divisible by spec.megatron.tensorModelParallelSize={p.tp} x "
            f"spec.megatron.pipelineModelParallelSize={p.pp} x spec.megatron.contextParallelSize={p.cp}"
        )
    moe.check_expert_layout(world, p.tp, p.pp, p.cp, p.ep, p.etp)
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() == p.tp
            and ps.get_pipeline_model_parallel_world_size() == p.pp
            and ps.get_virtual_pipeline_model_parallel_world_size() == p.vpp
            and ps.get_context_parallel_world_size() == p.cp
            and ps.get_expert_model_parallel_world_size() == p.ep
            and ps.get_expert_tensor_parallel_world_size() == (p.etp or p.tp)
        ):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
    )


def _cpu_adamw(core: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    # As megatron: no weight decay on biases and norm weights (1-D parameters).
    decay = [p for p in core.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in core.parameters() if p.requires_grad and p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
    )


def _inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers holding the state: torch AdamW itself (CPU), or the ``.optimizer`` of each
    megatron optimizer (a ChainedOptimizer chains several)."""
    if optimizer is None:
        return []
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
        elif inner is not None:
            raise TypeError(f"cannot offload the state of optimizer {type(inner).__name__}")
    return out


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Materialise AdamW's lazily created state so it has a structure to save or load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _gpu_wrap(
    chunks: list, mcfg: MegatronModelConfig, parallel: ParallelConfig, optim: OptimConfig, dtype: torch.dtype
):
    """GPU: Float16Module (bf16/fp16) -> megatron DDP per model chunk -> one megatron optimizer over
    all chunks (fp32 main params)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = mcfg.transformer_config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    models = []
    for i, core in enumerate(chunks):
        model = Float16Module(config, core) if dtype in (torch.bfloat16, torch.float16) else core
        # as megatron's training loop: chunks after the first keep their grads in one bucket
        models.append(
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, disable_bucketing=i > 0)
        )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip if optim.grad_clip > 0 else 0.0,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, models)
    _fix_torch_adam_step_on_load(optimizer)
    return models, optimizer


def _init_distributed_optimizer_state(optimizer) -> None:
    """megatron's DistributedOptimizer (without apex/TE) cannot build a state dict to load into
    before its first step; take a zero-gradient step at lr 0 (which changes nothing) to create the
    Adam state, as megatron does for its FSDP format."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            lrs = [g["lr"] for g in opt.optimizer.param_groups]
            for g in opt.optimizer.param_groups:
                g["lr"] = 0.0
            opt._init_optimizer_states_with_dummy_values()
            for g, lr in zip(opt.optimizer.param_groups, lrs):
                g["lr"] = lr


def _fix_torch_adam_step_on_load(optimizer) -> None:
    """megatron 0.16.1's DistributedOptimizer, when it falls back to torch Adam (no apex/TE), copies
    every key of the Adam state, "step" included, from a loaded checkpoint that never holds "step"
    (it restores step separately): KeyError. Instance-level fix: fill the missing "step" with the
    value load_state_dict already set."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            state = _opt.optimizer.state.get(main_param, {})
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states


def _rng_state(on_gpu: bool) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any], on_gpu: bool) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if on_gpu and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
