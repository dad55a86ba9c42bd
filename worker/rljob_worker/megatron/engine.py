"""The megatron engine: what every megatron-core model of the project needs, whatever it computes.

Builds a GPTModel from an HF checkpoint at a parallel layout (TP x PP (x VPP) x CP x DP, EP for
mixture-of-experts), runs micro-batches through it and, when trainable, takes optimizer steps; it
keeps state (offload, distributed checkpoints, RNG) and exports HF weights. What a model *computes*
from its output is the caller's: a **head function** turns each micro-batch's output into whatever
the caller needs (log-probs and entropy for the policy, :mod:`.actor`; a value per token for a
critic), and a **loss function** turns that into a loss. The engine knows nothing of either.

Runs on GPU with megatron's own machinery (``DistributedDataParallel``, ``get_megatron_optimizer``:
bf16 params with fp32 main params, optional distributed optimizer) and on CPU with gloo after
:func:`cpu_compat.apply_cpu_patches` (torch AdamW over the local shards, manual DP all-reduce).

Batches are dicts of tensors with a leading batch dim ``B``: ``input_ids (B, T) long`` and
``attention_mask (B, T)`` (1 = real token, 0 = padding, anywhere); other per-row entries travel with
their micro-batch to the loss function. Every method that takes a batch must be called by all ranks
of a model-parallel (tensor x pipeline x context) group with the same batch; data-parallel ranks take
different batches. Padding never reaches the model (:mod:`.packing`).

Pipeline parallelism (``pp`` > 1, optionally ``vpp`` model chunks per stage, megatron's interleaved
schedule): each rank builds its chunks (embedding on the first stage, final norm and output layer on
the last) and runs megatron's own schedules (``get_forward_backward_func``) over the packed
micro-batches. Every micro-batch of one call runs at one shape, (micro-batch size, the call's longest
packed row), padded at the end (causal attention: trailing padding changes nothing before it), so
stages know each activation's shape without exchanging it; concatenated micro-batches (:mod:`.packing`) run
``(1, the call's largest total)``, their padding a segment of its own. Megatron's alternative,
``variable_seq_lengths``, exchanges shapes through batched p2p in an order that, with interleaving at
PP=2 (previous and next stage are one peer), pairs an activation's shape with a gradient's: it
deadlocks (and costs a shape round trip per transfer). The price is padding work on micro-batches
shorter than the longest; rows sorted by length before the call (as ``sft.packing`` does) keep it
small. With ``vpp``, a call with fewer micro-batches than stages runs filler micro-batches (results
dropped, loss zeroed) because the interleaved schedule needs at least ``pp``. Heads and losses run
on the last stage; :meth:`MegatronEngine.broadcast_from_last_stage` gives their results to every rank
of the pipeline group. Tied embeddings keep a copy on the last stage whose gradient is summed with the
first stage's (megatron's ``finalize_model_grads`` on GPU, the same all-reduce on CPU).

Context parallelism (``ParallelConfig.cp``): every rank of a CP group takes the same batch; the
packed length is padded to a multiple of ``2 * cp`` (padding columns are ignored), each CP rank runs
its load-balanced share of the sequence (:mod:`.context_parallel`), attention all-gathers keys and
values over the CP group; heads see this rank's share of the columns (and gather what they return).
Gradients are averaged over DP x CP. Sequence parallelism works with the local spec too
(:mod:`.sequence_parallel`), on CPU with gloo as well; it needs TP > 1. Mixture-of-experts models
(qwen3_moe, qwen2_moe) run with expert parallelism (:mod:`.moe`): on CPU, expert gradients are
averaged over the expert-data-parallel group and the grad norm counts each expert shard once; on GPU
megatron's DDP and optimizer do the same with their expert buffers.

Not supported yet (``MegatronConfigError`` at construction): context parallelism together with
pipeline parallelism; virtual pipeline stages for MoE models; layer counts that ``pp`` (x ``vpp``)
does not divide.

LoRA (``build_from_hf(lora=...)``, :mod:`.lora`): the chunks' weights are frozen and fp32 adapters ride on
the target linears as forward hooks; the adapters (and a critic's value head) are the only trained
parameters, stepped by torch AdamW with the CPU path's reductions on every device (no megatron DDP or
distributed optimizer: there is nothing big to shard). Checkpoints hold the adapters; weight export merges them.

Memory: activation recompute (:class:`RecomputeConfig`, megatron's full / selective recompute) and
``overrideTransformerConfig`` are applied to the ``TransformerConfig`` before the model is built.
``offload`` / ``onload`` (:mod:`.engine_state`) give the GPU memory of parameters, gradient buffers
and optimizer state to a colocated rollout engine and take it back; on CPU they only check state.
While offloaded, every method that would touch the weights raises.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from rljob_worker.runtime.distributed import dist_env_from_environ, init_distributed

from . import hf_weights, moe
from .context_parallel import sequence_multiple
from .cpu_compat import apply_cpu_patches
from .engine_config import (
    DEFAULT_OPTIM,
    DEFAULT_PARALLEL,
    DEFAULT_RECOMPUTE,
    OptimConfig,
    ParallelConfig,
    RecomputeConfig,
    check_layer_split,
    check_parallel,
    init_model_parallel,
)
from .engine_state import EngineStateMixin
from .errors import MegatronConfigError
from .fused_head import output_layer_returns_hidden
from .lora import LoraConfig, LoraState, attach_lora
from .model_config import MegatronModelConfig, build_model_chunks, megatron_config_from_hf
from .offload import StorageOffloader
from .optim_step import OptimStepMixin, cpu_adamw, gpu_wrap
from .packing import (
    PackedMicroBatch,
    concatenation_wanted,
    interleaving_group,
    pack,
    pack_concatenated,
    split_micro_batches,
    token_budget_split,
)

log = logging.getLogger(__name__)


def _output_layer_fn(chunk: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``chunk``'s output layer as ``(b, s, H) -> (b, s, out / tp)``; None off the last stage."""
    layer = getattr(chunk, "output_layer", None)
    if layer is None:
        return None

    def apply(hidden: torch.Tensor) -> torch.Tensor:
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        return layer(hidden.transpose(0, 1), weight=weight)[0].transpose(0, 1)

    return apply


def _half_precision(chunks: list[torch.nn.Module], mcfg: MegatronModelConfig, dtype: torch.dtype,
                    on_gpu: bool) -> list[torch.nn.Module]:
    """What the schedule runs without megatron's DDP: Float16Module around each chunk for bf16 / fp16 on
    GPU (it casts the chunk's parameters and its input and output), the chunks themselves otherwise."""
    if not (on_gpu and dtype in (torch.bfloat16, torch.float16)):
        return list(chunks)
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(mcfg.transformer_config, chunk) for chunk in chunks]


@contextlib.contextmanager
def _capture_decoder_output(chunk: torch.nn.Module | None) -> Iterator[list | None]:
    """Yields a list that a forward hook on ``chunk.decoder`` fills with its output (the hidden state
    after the final norm) while the block runs; yields None (no hook) for ``chunk`` None."""
    if chunk is None:
        yield None
        return
    box: list[torch.Tensor] = []
    handle = chunk.decoder.register_forward_hook(lambda _m, _i, out: box.append(out[0] if isinstance(out, tuple) else out))
    try:
        yield box
    finally:
        handle.remove()


@dataclass
class HeadInput:
    """What a head function sees for one micro-batch, on the last pipeline stage.

    ``output``: the model's post-process output, fp32, ``(b, Tc / cp, out / tp)`` for the packed ids of
    ``packed`` (for a GPTModel: its output layer's vocab-parallel logits, padded vocab included; with
    ``output_hidden``: the final-norm hidden state ``(b, Tc / cp, H)``, under sequence parallelism
    this TP rank's ``1 / tp`` of the columns);
    columns are this CP rank's share (:func:`.context_parallel.split_for_cp`).
    ``hidden``: the decoder's output (after the final norm), ``(b, Tc / cp, H)`` (under sequence
    parallelism: this TP rank's sequence shard, in megatron's ``(s, b, H)`` split), when the head
    asked for it (``needs_hidden``), else None: a value head reads it instead of the logits.
    ``output_layer``: the model's output layer as a function ``(b, s, H) -> (b, s, out / tp)``
    (tied embeddings included), e.g. to apply it to ``hidden`` after changing it.
    """

    output: torch.Tensor
    packed: PackedMicroBatch
    hidden: torch.Tensor | None = None
    output_layer: Callable[[torch.Tensor], torch.Tensor] | None = None


# head(HeadInput) -> whatever the caller needs per micro-batch (tensors that keep their graph in training)
HeadFn = Callable[[HeadInput], Any]
# loss(head result, micro-batch on the device) -> (scalar loss, metrics)
EngineLossFn = Callable[[Any, dict], "tuple[torch.Tensor, dict[str, Any]]"]


class MegatronEngine(OptimStepMixin, EngineStateMixin):
    """Owns this rank's model shard (its pipeline stage's chunks) and optimizer. Build with
    :meth:`from_hf`; subclasses add a head (:class:`~.actor.MegatronActor`: the policy).

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
        lora: LoraState | None = None,
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
        self.lora = lora  # LoRA adapters (:mod:`.lora`): the only trained weights, with torch AdamW
        self.routing_replays: list | None = None  # MoE routing replay (enable_routing_replay)
        self.on_gpu = torch.cuda.is_available()
        # megatron's DDP + optimizer (GPU, full weights) or torch AdamW with the reductions by hand (CPU; LoRA)
        self.megatron_optimizer = self.on_gpu and optimizer is not None and lora is None
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
        # micro-batches as one concatenated sequence of their rows (packing.pack_concatenated): no padding
        self.concatenate_sequences = concatenation_wanted(self.on_gpu, dtype) and self.cp_size == 1 and not mcfg.uses_te

    # ----------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def build_from_hf(
        cls,
        hf_dir: str | os.PathLike,
        parallel: ParallelConfig = DEFAULT_PARALLEL,
        optim: OptimConfig = DEFAULT_OPTIM,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        trainable: bool = True,
        recompute: RecomputeConfig = DEFAULT_RECOMPUTE,
        transformer_overrides: Mapping[str, Any] | None = None,
        hf_config_fn: Callable[[Any], Any] | None = None,
        prepare_chunks: Callable[[list[torch.nn.Module], MegatronModelConfig], None] | None = None,
        skip_hf_weights: Sequence[str] = (),
        fused_elementwise: bool | None = None,
        lora: LoraConfig | None = None,
    ) -> dict[str, Any]:
        """The constructor arguments of an engine built from an HF checkpoint directory (config.json +
        safetensors): ``cls(**build_from_hf(...))``; see :meth:`from_hf`.

        For models that are not the checkpoint's LM (a critic): ``hf_config_fn`` changes the HF config
        the model is built from (e.g. fewer layers); ``prepare_chunks(chunks, mcfg)`` changes the built
        chunks before weights are loaded and the optimizer is made (e.g. a new output layer);
        ``skip_hf_weights``: megatron parameter names not loaded from the checkpoint.
        ``fused_elementwise``: compiled RMSNorm / RoPE / SwiGLU (:mod:`.fused_elementwise`; None:
        ``RLJOB_FUSED_ELEMENTWISE``, else on with a GPU). ``lora``: train adapters on frozen weights
        (:mod:`.lora`; ignored for a frozen model)."""
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            apply_cpu_patches()
        if parallel.vpp == 1:
            parallel = replace(parallel, vpp=None)  # one chunk per stage: no interleaving
        check_parallel(parallel, on_gpu)
        hf_config = hf_weights.load_hf_config(hf_dir)
        if hf_config_fn is not None:
            hf_config = hf_config_fn(hf_config)
        check_layer_split(hf_config.num_hidden_layers, parallel)
        if not dist.is_initialized():
            init_distributed(dist_env_from_environ(os.environ))
        init_model_parallel(parallel)

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
            fused_elementwise=fused_elementwise,
        )
        if mcfg.fused_elementwise:
            log.info("fused elementwise kernels on (compiled RMSNorm, RoPE, SwiGLU; %s=0 turns them off)",
                     "RLJOB_FUSED_ELEMENTWISE")
        chunks = build_model_chunks(mcfg)
        if prepare_chunks is not None:
            prepare_chunks(chunks, mcfg)
        if on_gpu:  # megatron builds linears on the GPU but torch norms on the CPU
            for chunk in chunks:
                chunk.cuda(torch.cuda.current_device())
        hf_weights.load_hf_weights(chunks, hf_dir, hf_config, skip=skip_hf_weights)

        lora_state = None
        if not trainable:
            for chunk in chunks:
                chunk.requires_grad_(False)
            models, optimizer = _half_precision(chunks, mcfg, dtype, on_gpu), None
        elif lora is not None:
            # adapters join after the half-precision wrap, so they stay fp32
            models = _half_precision(chunks, mcfg, dtype, on_gpu)
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            lora_state = attach_lora(chunks, lora, hf_dir, device)
            optimizer = cpu_adamw(torch.nn.ModuleList(chunks) if len(chunks) > 1 else chunks[0], optim)
        elif on_gpu:
            models, optimizer = gpu_wrap(chunks, mcfg, parallel, optim, dtype)
            # the pipeline schedule scales each last-stage loss before its backward
            mcfg.transformer_config.grad_scale_func = optimizer.scale_loss
        else:
            params = torch.nn.ModuleList(chunks) if len(chunks) > 1 else chunks[0]
            models, optimizer = list(chunks), cpu_adamw(params, optim)
        return {"models": models, "chunks": chunks, "optimizer": optimizer, "hf_config": hf_config, "mcfg": mcfg,
                "parallel": parallel, "optim": optim, "dtype": dtype, "lora": lora_state}

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, **kwargs: Any) -> MegatronEngine:
        """Build the model from an HF checkpoint directory (config.json + safetensors).

        Initialises torch.distributed from the environment if needed, then megatron's model-parallel
        state and RNG. ``dtype``: compute dtype (bf16 on GPU keeps fp32 main params in the optimizer;
        on CPU the parameters themselves have ``dtype``). ``trainable=False`` builds a frozen model
        (a reference policy): no optimizer, no DDP, no gradient buffers; :meth:`train_step` refuses.
        ``recompute``: activation recompute (only acts in training mode). ``transformer_overrides``:
        ``spec.megatron.overrideTransformerConfig`` (extra ``TransformerConfig`` fields, validated:
        ``ValueError`` naming the key).
        """
        return cls(**cls.build_from_hf(hf_dir, **kwargs))

    # ----------------------------------------------------------------------------------------------
    # running micro-batches with a head

    def forward(self, batch: Mapping[str, Any], micro_batch_size: int, head: HeadFn,
                needs_hidden: bool = False, output_hidden: bool = False) -> list[Any]:
        """Forward only (eval mode, no grad): ``head(HeadInput)`` of each micro-batch of
        ``micro_batch_size`` rows, in order, on the last pipeline stage ([] on the others).
        ``output_hidden``: the model stops before its output layer (``HeadInput.output`` is the
        final-norm hidden state, for a head that applies the output weight itself)."""
        return self.forward_micro_batches(list(split_micro_batches(batch, micro_batch_size)), head, needs_hidden,
                                          output_hidden)

    @torch.no_grad()
    def forward_micro_batches(self, micro_batches: Sequence[dict[str, Any]], head: HeadFn,
                              needs_hidden: bool = False, output_hidden: bool = False) -> list[Any]:
        """:meth:`forward` over given micro-batches (each a batch dict)."""
        self._require_onloaded("forward")
        self._set_training(False)
        self._clear_routing()
        with output_layer_returns_hidden(self.chunks[-1], output_hidden):
            if self.pp_size > 1:
                results = self._run_pipeline(micro_batches, lambda x: (None, head(x)), True, needs_hidden)
            else:
                results = [head(self._forward_one(mb, needs_hidden)) for mb in micro_batches]
        self._set_training(True)
        return results

    def train_step(self, batch: Mapping[str, Any], micro_batch_size: int, head: HeadFn, loss_fn: EngineLossFn,
                   needs_hidden: bool = False, loss_reduction: str = "mean", output_hidden: bool = False,
                   max_tokens_per_micro_batch: int | None = None) -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's share of the mini-batch).

        For each micro-batch: ``loss, metrics = loss_fn(head(HeadInput), micro_batch)`` (the
        micro-batch's tensors on the engine's device). ``loss_reduction`` says how the micro-batch
        losses of all data-parallel ranks make the loss of the optimizer step:

        - ``"mean"``: their mean. ``loss / num_micro_batches`` is back-propagated and gradients are
          averaged over DP ranks. (A per-micro-batch mean loss then weighs micro-batches, not
          tokens, equally.)
        - ``"sum"``: their sum. Each loss is its micro-batch's share of the mini-batch loss, already
          divided by the whole mini-batch's token or sequence count (``algorithms.aggregate_loss``
          with ``num_tokens`` / ``num_sequences``), so the result does not depend on the micro-batch
          size or the layout. The engine back-propagates ``loss x dp_size``: megatron's DDP (and the
          CPU path) average gradients over DP x CP, and the factor turns the DP average into the sum.
          CP needs no factor: every CP rank computes the same loss over all rows, and the backward
          of the log-prob all-gather already sums the CP ranks' gradients, which the CP part of the
          average divides back. Under a pipeline schedule megatron divides each loss by its
          micro-batch count, which the engine multiplies back.

        Gradients are then clipped to ``grad_clip`` by their global norm (TP shards counted once),
        and AdamW steps. Returns the micro-batch mean of each metric, averaged over DP ranks, and
        ``loss`` (the mean, or with ``"sum"`` the sum over micro-batches and DP ranks: the
        mini-batch loss), plus ``grad_norm`` and ``lr``. A non-finite grad norm skips the step
        (``skipped`` = 1). The MoE load-balancing loss keeps megatron's convention in both modes:
        each micro-batch's aux loss weighs ``1 / num_micro_batches`` and is averaged over DP ranks
        (megatron's ``MoEAuxLossAutoScaler`` scale ``loss_scale / num_micro_batches``).
        ``output_hidden``: as in :meth:`forward`. ``max_tokens_per_micro_batch``: micro-batches by token
        budget (:func:`.packing.token_budget_split`) instead of ``micro_batch_size`` rows.
        """
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if self.optimizer is None:
            raise RuntimeError("this model was built with trainable=False (a frozen model)")
        self._require_onloaded("train_step")
        lr = self.current_lr()
        if max_tokens_per_micro_batch:
            micro_batches = token_budget_split(batch, max_tokens_per_micro_batch, self.concatenate_sequences)
        else:
            micro_batches = list(split_micro_batches(batch, micro_batch_size))
        n = len(micro_batches)
        self._set_training(True)
        self._zero_grad()
        self._moe_aux_begin(n)
        self._clear_routing()
        # what each micro-batch's loss is multiplied by before its backward (see the docstring)
        loss_scale = float(self.dp_size) if loss_reduction == "sum" else 1.0 / n
        with output_layer_returns_hidden(self.chunks[-1], output_hidden):
            if self.pp_size > 1:
                sums = self._pipeline_backward(micro_batches, head, loss_fn, needs_hidden, loss_scale)
            else:
                sums = self._sequential_backward(micro_batches, head, loss_fn, needs_hidden, loss_scale)
        if self.megatron_optimizer:
            grad_norm, skipped = self._gpu_step(lr)
        else:
            grad_norm, skipped = self._cpu_step(lr)
        if not skipped:
            self.step += 1
        total = sums.pop("loss") if loss_reduction == "sum" else None
        out = self._dp_mean({**{k: v / n for k, v in sums.items()}, **self._moe_aux_end(n)})
        if total is not None:
            out["loss"] = self._dp_sum(total)
        out.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        return out

    def mini_batch_counts(self, mask: torch.Tensor) -> dict[str, int]:
        """``{"num_tokens", "num_sequences"}`` of the whole mini-batch: this rank's ``mask (B, T)``
        (tokens; rows with at least one token) summed over the data-parallel group (the normalisers of ``train_step(loss_reduction="sum")``)."""
        m = mask.bool()
        t = torch.tensor([int(m.sum()), int(m.any(dim=-1).sum())], dtype=torch.int64, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        return {"num_tokens": int(t[0]), "num_sequences": int(t[1])}

    def broadcast_from_last_stage(self, tensor: torch.Tensor | None, shape, dtype=torch.float32) -> torch.Tensor:
        """The last stage's ``tensor`` on every rank of the pipeline group (returned on the CPU; with
        one stage, ``tensor`` itself)."""
        if self.pp_size == 1:
            return tensor
        if self.is_last_stage:
            buf = tensor.to(device=self.device, dtype=dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=self.last_stage_rank, group=self.pp_group)
        return buf.cpu()

    def broadcast_object_from_last_stage(self, obj: Any) -> Any:
        if self.pp_size == 1:
            return obj
        box = [obj if self.is_last_stage else None]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pp_group, device=self.device)
        return box[0]

    # ----------------------------------------------------------------------------------------------
    # one stage: the whole model on this rank

    def _pack_micro_batch(self, mb: dict[str, Any]) -> PackedMicroBatch:
        sp_tp = self.tp_size if self.parallel.sequence_parallel else 1
        multiple = sequence_multiple(self.cp_size, sp_tp)  # CP: 2 * cp chunks; SP: TP splits each
        t = mb["input_ids"].shape[1]
        if self.concatenate_sequences:  # bookkeeping where the batch is (the host), then one copy each
            ids, positions, dest, lengths, segments = pack_concatenated(mb["input_ids"], mb["attention_mask"], multiple)
            return PackedMicroBatch(ids.to(self.device), positions.to(self.device), None, lengths.to(self.device), t,
                                    mb, segments=segments.to(self.device), dest=dest.to(self.device))
        ids, order, lengths = pack(mb["input_ids"].to(self.device), mb["attention_mask"].to(self.device), multiple)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        return PackedMicroBatch(ids, positions, order, lengths, t, mb)

    def _forward_one(self, mb: dict[str, Any], needs_hidden: bool) -> HeadInput:
        """The head's input for one micro-batch through the whole model (one pipeline stage)."""
        from .context_parallel import local_positions, split_for_cp

        packed = self._pack_micro_batch(mb)
        if packed.segments is not None:  # one concatenated row: attention and RoPE per segment (cp = 1)
            ids, positions, extra = packed.padded_to(*packed.ids.shape)
            if moe.is_moe(self.hf_config):  # the router's load-balancing loss counts real tokens only
                extra["padding_mask"] = packed.padding_mask(*packed.ids.shape)
            self._replay_routing(packed, *packed.ids.shape, cp=False)
            with self._capture_hidden(needs_hidden) as hidden:
                output = self.model(ids, positions, None, **extra)
            return self._head_input(output.float(), packed, hidden, *packed.ids.shape)
        # CP: this rank's share of the columns, at their global positions (identity for cp = 1)
        local_ids = split_for_cp(packed.ids, self.cp_size, self.cp_rank)
        positions = local_positions(packed.ids.shape[1], self.cp_size, self.cp_rank, self.device)
        extra = {}
        if moe.is_moe(self.hf_config):  # the router's load-balancing loss counts real tokens only
            pad = torch.arange(packed.ids.shape[1], device=self.device)[None, :] >= packed.lengths[:, None]
            extra["padding_mask"] = split_for_cp(pad, self.cp_size, self.cp_rank)  # (b, Tc/cp) True = pad
        self._replay_routing(packed, *packed.ids.shape, cp=True)
        with self._capture_hidden(needs_hidden) as hidden:
            output = self.model(local_ids, positions.expand_as(local_ids), None, **extra)  # (b, Tc/cp, V/tp)
        b, t = local_ids.shape
        return self._head_input(output.float(), packed, hidden, b, t)

    def _sequential_backward(self, micro_batches, head: HeadFn, loss_fn: EngineLossFn,
                             needs_hidden: bool, loss_scale: float) -> dict[str, float]:
        """One stage: forward and backward (of ``loss x loss_scale``) of each micro-batch in turn.
        Returns the summed ``loss`` and metrics."""
        sums: dict[str, float] = {}
        for mb in micro_batches:
            result = head(self._forward_one(mb, needs_hidden))
            mb_dev = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}
            loss, metrics = loss_fn(result, mb_dev)
            scaled = loss * loss_scale
            if self.megatron_optimizer:
                scaled = self.optimizer.scale_loss(scaled)
            scaled.backward()
            for k, v in {**metrics, "loss": loss}.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach() if isinstance(v, torch.Tensor) else v)
        return sums

    # ----------------------------------------------------------------------------------------------
    # pipeline parallelism: megatron's schedules; results live on the last stage

    def _run_pipeline(self, micro_batches, on_head_input, forward_only: bool, needs_hidden: bool,
                      loss_scale: float = 1.0) -> list[Any]:
        """Run megatron's pipeline schedule over ``micro_batches``. On the last stage
        ``on_head_input(HeadInput) -> (loss | None, result)`` handles each micro-batch;
        ``loss x loss_scale`` is back-propagated unless ``forward_only``. Returns the results in
        micro-batch order on the last stage, [] elsewhere."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        packed = [self._pack_micro_batch(mb) for mb in micro_batches]
        packed = self._fill_for_interleaving(packed)
        # megatron's schedule divides each loss by its micro-batch count (fillers included): undo that
        scale = len(packed) * loss_scale
        rows = max(p.ids.shape[0] for p in packed)
        cols = max(p.ids.shape[1] for p in packed)
        captured: list[torch.Tensor | None] = [None]

        def loss_func(item: PackedMicroBatch, output: torch.Tensor):
            b, tc = item.ids.shape
            hidden, captured[0] = captured[0], None
            if item.filler:
                return output.sum() * 0.0, None
            loss, result = on_head_input(self._head_input(output[:b, :tc].float().contiguous(), item, hidden, b, tc))
            if loss is None:
                return torch.zeros((), device=output.device), result
            return loss * scale, result

        def forward_step(data_iterator, model):
            item = next(data_iterator)
            # the router's load-balancing loss counts real tokens only (as in _forward_one)
            extra = {"padding_mask": item.padding_mask(rows, cols)} if moe.is_moe(self.hf_config) else {}
            self._replay_routing(item, rows, cols, cp=False)  # CP does not run with PP
            # stages after the first take their input from the previous stage (set by the schedule)
            with self._capture_hidden(needs_hidden and self.is_last_stage) as hidden:
                ids, positions, segments = item.padded_to(rows, cols)
                output = model(ids, positions, None, **extra, **segments)
            captured[0] = hidden[0] if hidden else None
            return output, functools.partial(loss_func, item)

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

    def _pipeline_backward(self, micro_batches, head: HeadFn, loss_fn: EngineLossFn,
                           needs_hidden: bool, loss_scale: float) -> dict[str, float]:
        """Forward and backward (of ``loss x loss_scale``) of every micro-batch through the pipeline;
        ``head`` and ``loss_fn`` run on the last stage. Returns the summed ``loss`` and metrics on
        every rank of the pipeline group."""

        def on_head_input(x: HeadInput):
            result = head(x)
            mb_dev = {
                k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in x.packed.micro_batch.items()
            }
            loss, metrics = loss_fn(result, mb_dev)
            values = {**metrics, "loss": loss}
            return loss, {k: float(v.detach() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}

        results = self._run_pipeline(micro_batches, on_head_input, False, needs_hidden, loss_scale)
        sums: dict[str, float] = {}
        for metrics in results:
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        return self.broadcast_object_from_last_stage(sums)

    def _fill_for_interleaving(self, packed: list[PackedMicroBatch]) -> list[PackedMicroBatch]:
        """The interleaved (VPP) schedule needs at least ``pp`` micro-batches: repeat the last one as
        filler (its loss is zeroed and its results dropped), and pick the micro-batch group size."""
        if len(self.models) == 1:
            return packed
        fillers = [replace(packed[-1], filler=True) for _ in range(self.pp_size - len(packed))]
        packed = packed + fillers
        self.mcfg.transformer_config.microbatch_group_size_per_vp_stage = interleaving_group(
            len(packed), self.pp_size
        )
        return packed

    # ----------------------------------------------------------------------------------------------
    # the head's input

    def _head_input(self, output: torch.Tensor, packed: PackedMicroBatch, hidden: list | None,
                    b: int, t: int) -> HeadInput:
        h = None
        if hidden:  # megatron's (s, b, H) -> (b, s, H), cut like the output
            h = hidden[0].transpose(0, 1)[:b, :t]
        return HeadInput(output, packed, h, _output_layer_fn(self.chunks[-1]))

    def _capture_hidden(self, wanted: bool):
        return _capture_decoder_output(self.chunks[-1] if wanted else None)

    # ----------------------------------------------------------------------------------------------
    # MoE routing replay (:mod:`.routing_replay`)

    def enable_routing_replay(self) -> None:
        """From now on a micro-batch with ``routed_experts`` (N, T, L, k) routes its tokens to those experts."""
        from . import routing_replay

        if not moe.is_moe(self.hf_config):
            raise MegatronConfigError(f"spec.algorithm.routingReplay: the model ({self.hf_config.model_type}) has no "
                                      "experts to replay; remove routingReplay or train a qwen3_moe / qwen2_moe model")
        self.routing_replays = routing_replay.install(self.chunks)

    def _clear_routing(self) -> None:
        for replay in self.routing_replays or ():
            replay.clear()

    def _replay_routing(self, packed: PackedMicroBatch, rows: int, cols: int, cp: bool) -> None:
        replays = self.routing_replays
        if not replays:
            return
        from . import routing_replay

        routed = packed.micro_batch.get("routed_experts")
        tokens = None
        if routed is not None:
            sp = self.tp_size if self.parallel.sequence_parallel else 1
            tokens = routing_replay.router_tokens(
                routed, packed, rows=rows, cols=cols, cp_size=self.cp_size if cp else 1,
                cp_rank=self.cp_rank if cp else 0, sp_size=sp, sp_rank=self.tp_rank if sp > 1 else 0)
        routing_replay.set_micro_batch(replays, tokens)

    # ----------------------------------------------------------------------------------------------
    # bookkeeping

    def _set_training(self, mode: bool) -> None:
        for model in self.models:
            model.train(mode)

    def _moe_aux_begin(self, num_micro_batches: int) -> None:
        if moe.is_moe(self.hf_config):  # aux-loss grads scaled like the main loss (1 / micro-batches)
            moe.pop_aux_loss(1, 0)
            scale = self.optimizer.get_loss_scale() if self.megatron_optimizer else 1.0
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

    def _dp_sum(self, value: float) -> float:
        if self.dp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return float(t[0])

    def _dp_mean(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.dp_size == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return {k: float(v) / self.dp_size for k, v in zip(keys, t.tolist())}
