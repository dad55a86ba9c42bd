"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE) and expert parallelism for the megatron actor.

HF config -> megatron MoE fields (:func:`moe_transformer_kwargs`), the local (non-TE) MoE block spec
(:func:`moe_block_spec`), the expert weight mapping (:func:`load_expert_weights`,
:func:`export_expert_weights`) and the CPU-path gradient rules for expert parameters.

Routing, exactly as transformers' ``Qwen3MoeTopKRouter`` / ``Qwen2MoeTopKRouter``: softmax over all
experts in fp32, top-k, and with ``norm_topk_prob`` the k weights renormalised to sum to 1. In
megatron's terms: score function ``softmax``; ``norm_topk_prob=True`` is top-k on the logits and then a
softmax over the k (``moe_router_pre_softmax=False``, the same numbers), ``False`` is softmax first
(``moe_router_pre_softmax=True``). Every token keeps its k experts (no capacity, no dropping).

Load balancing: megatron's ``aux_loss`` with ``moe_aux_loss_coeff = router_aux_loss_coef``. It only adds
gradient (the forward values, hence the log-probs, are unchanged) and only in training. Turn it off
with ``overrideTransformerConfig: {moe_aux_loss_coeff: 0}`` (or ``moe_router_load_balancing_type:
none``). The unscaled loss is reported by the actor's update as ``moe_aux_loss``. It counts real
tokens only (the actor passes megatron a padding mask, as HF's ``load_balancing_loss_func`` uses the
attention mask), so the padding that packing, sequence and context parallelism add changes nothing.
Under sequence / context parallelism each rank adds its tokens' share (the expert load counts are
all-reduced over TP x CP by megatron); the router weight's gradient is then a per-rank partial sum,
summed over TP like the other SP-tagged weights.

Experts: megatron's ``SequentialMLP`` (a loop over local experts; grouped GEMM needs a CUDA
extension). Tokens move between expert-parallel ranks with the ``alltoall`` dispatcher
(``all_to_all_single``, which gloo in torch 2.13 and NCCL both have). Expert ``e`` of a layer lives on
expert-parallel rank ``e // (num_experts / EP)`` as local expert ``e % (num_experts / EP)``, split
over the expert-tensor-parallel group like a dense MLP.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rljob_worker.runtime.distributed import all_reduce_grads

from .errors import MegatronConfigError

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
EXPERT_PREFIX = "mlp.experts."  # megatron names of expert parameters contain ".mlp.experts."

# TransformerConfig MoE fields derived from the HF model: overriding them breaks the mapping.
FROM_HF_FIELDS = (
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_grouped_gemm",
)


def is_moe(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES


def moe_layer_pattern(hf_config) -> list[int]:
    """1 for a layer with experts, 0 for a dense-MLP layer, as the HF decoder layers decide."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    n = hf_config.num_experts
    return [int(i not in dense and n > 0 and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers)]


def check_moe_hf_config(hf_config, tp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """``MegatronConfigError`` naming the spec field and the fix when the experts cannot be laid out."""
    etp = tp if etp is None else etp
    n = int(getattr(hf_config, "num_experts", 0) or 0)
    if n <= 0 or not any(moe_layer_pattern(hf_config)):
        raise MegatronConfigError(
            f"model_type={hf_config.model_type!r} with num_experts={n} has no expert layers"
        )
    if hf_config.model_type == "qwen3_moe" and getattr(hf_config, "attention_bias", False):
        raise MegatronConfigError(
            "attention_bias=True is not supported for qwen3_moe (it also biases o_proj)"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise MegatronConfigError("use_sliding_window=True is not supported")
    if ep < 1 or n % ep:
        raise MegatronConfigError(
            f"spec.megatron.expertModelParallelSize={ep} does not divide the model's num_experts={n}; "
            f"choose a divisor of {n}"
        )
    checks = [("moe_intermediate_size", hf_config.moe_intermediate_size, etp, "expertTensorParallelSize")]
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        checks.append(
            (
                "shared_expert_intermediate_size",
                hf_config.shared_expert_intermediate_size,
                tp,
                "tensorModelParallelSize",
            )
        )
    for name, value, size, field in checks:
        if value % size:
            raise MegatronConfigError(
                f"spec.megatron.{field}={size} does not divide {name}={value} of the model; choose a divisor"
            )


def check_expert_layout(world: int, tp: int, pp: int, cp: int, ep: int, etp: int | None) -> None:
    """megatron carves expert groups out of the same ranks: ``etp * ep * pp`` must divide the world,
    and (megatron's own rule) ``ep * etp`` the ranks of one pipeline stage."""
    etp = tp if etp is None else etp
    if etp < 1 or ep < 1:
        raise MegatronConfigError(
            f"spec.megatron.expertModelParallelSize={ep} and expertTensorParallelSize={etp} must be >= 1"
        )
    if world % (etp * ep * pp):
        raise MegatronConfigError(
            f"spec.megatron.expertModelParallelSize={ep} x expertTensorParallelSize={etp} x "
            f"pipelineModelParallelSize={pp} = {etp * ep * pp} does not divide the {world} ranks; "
            f"reduce expertModelParallelSize (or expertTensorParallelSize) so that it does"
        )


def check_training_layout(hf_config, tp: int, sequence_parallel: bool) -> None:
    """megatron's MoELayer refuses to train under TP without sequence parallel; say so at start-up."""
    if is_moe(hf_config) and tp > 1 and not sequence_parallel:
        raise MegatronConfigError(
            f"spec.megatron.sequenceParallel must be true to train a mixture-of-experts model with "
            f"tensorModelParallelSize={tp} (megatron's MoE layer requires it); set it, or use "
            f"tensorModelParallelSize=1 with expertModelParallelSize for the experts"
        )


def moe_transformer_kwargs(hf_config, ep: int = 1, etp: int | None = None) -> dict[str, Any]:
    """``TransformerConfig`` fields for the MoE model (on top of the dense ones)."""
    coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    kwargs: dict[str, Any] = {
        "num_moe_experts": hf_config.num_experts,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_layer_freq": moe_layer_pattern(hf_config),
        "moe_router_score_function": "softmax",
        # norm_topk_prob: softmax over the k chosen logits == the renormalised top-k probabilities
        "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False)),
        "moe_router_load_balancing_type": "aux_loss" if coef > 0 else "none",
        "moe_aux_loss_coeff": coef,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }
    if shared:
        kwargs.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    if hf_config.model_type == "qwen2_moe":
        kwargs.update(add_qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), qk_layernorm=False)
    else:
        kwargs.update(add_qkv_bias=False, qk_layernorm=True)
    return kwargs


def moe_block_spec(config, use_te: bool):
    """megatron's per-layer block spec (dense and MoE layers as ``moe_layer_freq`` says, this
    pipeline stage's layers only) with the project's SDPA attention on the local path."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from .sdpa_attention import SDPAttention

    patch_megatron_moe_without_te()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    if not use_te:
        for layer in spec.layer_specs:  # dense and MoE layers share two spec objects
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def patch_megatron_moe_without_te() -> None:
    """megatron-core 0.16.1's ``moe_utils`` defines its TE kernels only when transformer_engine
    imports, yet ``RouterGatingLinearFunction`` reads ``te_general_gemm`` unguarded: NameError
    without TE (CPU, or a GPU image without TE). Define the absent names as None (the torch path)."""
    from megatron.core.transformer.moe import moe_utils

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_topk_with_score_function",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


# --------------------------------------------------------------------------------------------------
# weights: HF <-> this rank's experts

# Router and shared experts are per-layer entries of the ordinary table (absent on both sides in
# dense layers, so the loader skips them there).
MOE_LAYER_ENTRIES = [
    ("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",), "replicated"),
    (
        "decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight",
        (
            "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
            "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        ),
        "gate_up",
    ),
    (
        "decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight",
        ("model.layers.{i}.mlp.shared_expert.down_proj.weight",),
        "row",
    ),
    (
        "decoder.layers.{i}.mlp.shared_experts.gate_weight",
        ("model.layers.{i}.mlp.shared_expert_gate.weight",),
        "replicated",
    ),
]

# Per expert: megatron local-expert names ({j}: local index) <- HF names ({e}: global index).
EXPERT_ENTRIES = [
    (
        "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight",
        (
            "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        ),
        "gate_up",
    ),
    (
        "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight",
        ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
        "row",
    ),
]


def _expert_layout() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "ep_group": ps.get_expert_model_parallel_group(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "etp_group": ps.get_expert_tensor_parallel_group(),
    }


def _expert_items(core, hf_config, ep: int) -> Iterator[tuple[int, str, tuple[str, ...], str]]:
    """(local index j, megatron name, HF name templates with ``{e}`` = global expert index, kind) of
    this rank's experts, layer by layer. ``core``: a GPTModel (a pipeline chunk: its layers are named
    by local index, HF's by global index ``layer_number - 1``)."""
    pattern = moe_layer_pattern(hf_config)
    for local, layer in enumerate(core.decoder.layers):
        i = layer.layer_number - 1
        if not pattern[i]:
            continue
        for j in range(hf_config.num_experts // ep):
            for mname, hf_names, kind in EXPERT_ENTRIES:
                templates = tuple(h.replace("{i}", str(i)) for h in hf_names)
                yield j, mname.format(i=local, j=j), templates, kind


@torch.no_grad()
def load_expert_weights(core, reader, hf_config, load_shard, geometry) -> list[str]:
    """Copy this rank's experts (its EP slice, its expert-TP shard of each) from ``reader``.
    ``load_shard``/``geometry``: hf_weights' slicing function and shapes (passed in to keep the
    import one-way). Returns the megatron names loaded."""
    lay = _expert_layout()
    params = dict(core.named_parameters())
    loaded = []
    local = hf_config.num_experts // lay["ep"]
    for j, mname, templates, kind in _expert_items(core, hf_config, lay["ep"]):
        hf_names = tuple(h.format(e=lay["ep_rank"] * local + j) for h in templates)
        if mname not in params:
            raise ValueError(f"the megatron model has no parameter {mname} for HF tensor(s) {hf_names}")
        shard = load_shard(reader, hf_names, kind, geometry, lay["etp_rank"], lay["etp"])
        if tuple(shard.shape) != tuple(params[mname].shape):
            raise ValueError(
                f"{mname}: HF {hf_names} gives shard shape {tuple(shard.shape)}, megatron expects "
                f"{tuple(params[mname].shape)}"
            )
        params[mname].data.copy_(shard)
        loaded.append(mname)
    return loaded


@torch.no_grad()
def export_expert_weights(
    core, hf_config, gather, split_full, geometry
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every expert's full HF tensors: gathered over expert TP, then over EP (each local
    expert ``j`` of EP rank ``r`` is global expert ``r * local + j``). Collective over the EP and
    expert-TP groups: every rank must consume the iterator."""
    lay = _expert_layout()
    params = dict(core.named_parameters())
    local = hf_config.num_experts // lay["ep"]
    for j, mname, templates, kind in _expert_items(core, hf_config, lay["ep"]):
        full = gather(params[mname].detach(), 0 if kind == "gate_up" else 1, lay["etp"], lay["etp_group"])
        for r, tensor in enumerate(_all_gather_list(full, lay["ep"], lay["ep_group"])):
            names = tuple(h.format(e=r * local + j) for h in templates)
            yield from split_full(tensor, names, kind, geometry, lay["etp"])


def _all_gather_list(t: torch.Tensor, n: int, group) -> list[torch.Tensor]:
    if n == 1:
        return [t.clone()]
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    return parts


# --------------------------------------------------------------------------------------------------
# gradients on the CPU path (the GPU path: megatron DDP's expert buffers and optimizer)


def is_expert_param(name: str) -> bool:
    return EXPERT_PREFIX in name


def expert_params(core) -> list[torch.nn.Parameter]:
    return [p for n, p in core.named_parameters() if p.requires_grad and is_expert_param(n)]


def average_expert_grads(params: list[torch.nn.Parameter], dp_size: int) -> None:
    """As megatron's DDP: expert grads are summed over the expert-data-parallel group (the ranks
    holding the same experts) and scaled by 1 / (dense) data-parallel size. The all-to-all backward
    already summed the contributions of the tokens of every EP rank (and, under sequence parallel,
    the expert-TP all-gather's backward those of the expert-TP ranks). With expert TP smaller than
    TP (e.g. ``etp=1``) the expert-DP group also holds TP ranks, each with its own sequence share:
    the sum adds them up, even at DP = 1."""
    from megatron.core import parallel_state as ps

    for p in params:  # an expert no token reached on this rank: replicas must flatten alike
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # with expert TP < TP the expert-DP group spans TP ranks too: their sequence-parallel token shares
    all_reduce_grads(params, ps.get_expert_data_parallel_group(), divisor=dp_size)


def expert_grad_sq(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared expert grads over all experts, each expert-TP shard once: every rank of an
    expert-tensor-and-model-parallel group holds distinct shards (replicas sit in other groups)."""
    from megatron.core import parallel_state as ps

    sq = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
    for p in params:
        if p.grad is not None:
            sq += p.grad.detach().double().pow(2).sum()
    if ps.get_expert_tensor_and_model_parallel_world_size() > 1:
        dist.all_reduce(sq, group=ps.get_expert_tensor_and_model_parallel_group())
    return sq


# --------------------------------------------------------------------------------------------------
# load-balancing loss


def set_aux_loss_scale(scale: float, device) -> None:
    """The aux loss gradient scale matching the main loss (1 / micro-batches, times the fp16 loss
    scale): megatron's pipeline schedules set it, the actor runs its own loop."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale), device=device))


def aux_loss_enabled(config) -> bool:
    """Whether megatron's router computes the ``aux_loss`` load-balancing loss for ``config``."""
    kind = config.moe_router_load_balancing_type
    coeff = config.moe_aux_loss_coeff
    if isinstance(kind, list):
        return "aux_loss" in kind and float(coeff[kind.index("aux_loss")]) > 0
    return kind == "aux_loss" and float(coeff) > 0


def reset_aux_loss_tracker() -> None:
    """Forget megatron's process-wide aux-loss tracker: it is sized by the first model's layer count,
    so a later model with more layers in the same process would index past it."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def pop_aux_loss(num_micro_batches: int, num_moe_layers: int) -> float | None:
    """The unscaled load-balancing loss averaged over MoE layers and micro-batches since the last
    call, or None when none was computed; clears megatron's tracker. Collective over the router's
    TP x CP group: under sequence / context parallelism each rank's value is its tokens' share of
    the micro-batch loss (megatron's ``switch_load_balancing_loss_func``), summed here as
    ``reduce_aux_losses_tracker_across_ranks`` does. Per data-parallel rank (the caller averages)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if entry is None:
        return None
    values = entry["values"].detach().double().clone()  # the tracker is zeroed in place below
    clear_aux_losses_tracker()
    group = entry.get("reduce_group")  # the router's TP x CP group: its ranks hold partial sums
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    if num_moe_layers == 0:
        return None
    return float(values.sum()) / num_moe_layers / max(num_micro_batches, 1)
