"""HF ``PretrainedConfig`` -> megatron-core ``TransformerConfig`` + layer spec + ``GPTModel`` kwargs.

Supported ``model_type``: llama, qwen2, qwen3 (dense decoders with RMSNorm, SwiGLU, RoPE, GQA) and
the mixture-of-experts qwen3_moe, qwen2_moe (see :mod:`.moe`).
Every HF setting that changes the maths is either mapped or rejected with a ``ValueError`` naming
it; nothing is silently ignored.

Layer spec: megatron's local spec with :class:`SDPAttention` as core attention (the local
``DotProductAttention`` materialises fp32 scores). When transformer_engine is importable and a GPU
is present, the TE spec (fused norm+linear, TE attention) is used instead. With sequence parallelism
the local spec's norms (megatron's torch norm wrapper refuses SP) become
:class:`.sequence_parallel.SequenceParallelRMSNorm`, the final norm of the block included
(``MegatronModelConfig.final_layernorm``). Context parallelism (``cp``) is handled by
:class:`SDPAttention` (see :mod:`.context_parallel`). With ``fused_elementwise`` (default on a GPU)
the local spec's norms are :class:`.fused_elementwise.FusedRMSNorm` and megatron's SwiGLU and RoPE
fusion flags are on (:mod:`.fused_elementwise`).

Vocabulary: megatron splits the vocab evenly across TP ranks, so a vocab size TP does not divide
is padded to the next multiple of TP (extra rows are zero and their logits are masked out by the
actor; the HF mapping strips them). A checkpoint's padded size therefore depends on TP when TP
does not divide the vocab; such a checkpoint only reloads at a TP with the same padding.

Activation recompute (``spec.megatron.recompute*``) maps onto megatron's own ``recompute_granularity``
/ ``recompute_method`` / ``recompute_num_layers``: ``full`` checkpoints whole transformer layers
(``uniform``: groups of ``num_layers`` layers; ``block``: the first ``num_layers`` layers of each
stage), ``selective`` checkpoints the submodules in ``recompute_modules`` (megatron's default: the
core attention; set ``recompute_modules`` through ``overrideTransformerConfig`` for e.g. ``mlp``;
``layernorm`` needs transformer_engine with megatron-core 0.16.1). Both run through
``tensor_parallel.checkpoint``, which saves and restores the RNG states (dropout masks are identical
in the recompute), also on CPU with the patched tracker.

``overrideTransformerConfig`` sets any other ``TransformerConfig`` field (verl's
``override_transformer_config``); unknown keys, values of the wrong type and fields this module derives
from the HF model or from other spec fields are rejected with a ``MegatronConfigError`` (a ``ValueError``) naming
``spec.megatron.overrideTransformerConfig.<key>``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .errors import MegatronConfigError
from .moe import FROM_HF_FIELDS as _MOE_FROM_HF
from .moe import MOE_MODEL_TYPES, check_moe_hf_config, is_moe, moe_block_spec, moe_transformer_kwargs

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", *MOE_MODEL_TYPES)

# megatron's RotaryEmbedding._apply_scaling hard-codes these llama3 values.
_LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
OVERRIDE_PATH = "spec.megatron.overrideTransformerConfig"

# TransformerConfig fields that overrideTransformerConfig may not set: they are derived from the HF
# model (changing them breaks the weight mapping) or come from another spec field.
_FROM_HF = "it is derived from the HF model config (model.path)"
_NOT_OVERRIDABLE = {
    **{
        name: _FROM_HF
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "ffn_hidden_size",
            "normalization",
            "layernorm_epsilon",
            "gated_linear_unit",
            "activation_func",
            "add_bias_linear",
            "add_qkv_bias",
            "qk_layernorm",
            "rotary_interleaved",
            *_MOE_FROM_HF,
        )
    },
    "tensor_model_parallel_size": "set spec.megatron.tensorModelParallelSize",
    "pipeline_model_parallel_size": "set spec.megatron.pipelineModelParallelSize",
    "virtual_pipeline_model_parallel_size": "set spec.megatron.virtualPipelineModelParallelSize",
    "context_parallel_size": "set spec.megatron.contextParallelSize",
    "expert_model_parallel_size": "set spec.megatron.expertModelParallelSize",
    "expert_tensor_parallel_size": "set spec.megatron.expertTensorParallelSize",
    "sequence_parallel": "set spec.megatron.sequenceParallel",
    "variable_seq_lengths": "the actor runs each pipeline call at one fixed micro-batch shape",
    "batch_p2p_comm": "the actor picks megatron's p2p mode for the pipeline layout",
    "microbatch_group_size_per_vp_stage": "the actor sets it per call for the interleaved schedule",
    "params_dtype": "set spec.model.dtype",
    "pipeline_dtype": "set spec.model.dtype",
    "bf16": "set spec.model.dtype",
    "fp16": "set spec.model.dtype",
}


def have_transformer_engine() -> bool:
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # absent, or a broken CUDA extension
        return False
    return True


@dataclass
class MegatronModelConfig:
    """Everything needed to build a ``GPTModel`` matching an HF checkpoint."""

    model_type: str
    transformer_config: Any  # megatron.core.transformer.TransformerConfig
    layer_spec: Any  # megatron.core.transformer.spec_utils.ModuleSpec
    gpt_kwargs: dict[str, Any] = field(default_factory=dict)  # GPTModel(**gpt_kwargs) minus config/spec
    hf_vocab_size: int = 0
    padded_vocab_size: int = 0
    tie_word_embeddings: bool = False
    uses_te: bool = False
    final_layernorm: Any = None  # the block's final norm; None: megatron's default for the spec
    fused_elementwise: bool = False  # compiled RMSNorm / RoPE / SwiGLU (fused_elementwise.py)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The HF vocab size when TP divides it, else the next multiple of TP."""
    return vocab_size if vocab_size % tp == 0 else (vocab_size // tp + 1) * tp


def _rope(hf_config) -> tuple[float, dict[str, Any]]:
    """(rope_theta, GPTModel rope kwargs). Handles transformers 4.x (rope_theta/rope_scaling) and 5.x
    (rope_parameters)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "default":
        return float(theta), {}
    factor = merged.get("factor")
    if rope_type == "linear":
        return float(theta), {"seq_len_interpolation_factor": float(factor)}
    if rope_type == "llama3":
        for key, expected in _LLAMA3_ROPE_DEFAULTS.items():
            if float(merged.get(key, expected)) != float(expected):
                raise ValueError(
                    f"rope_scaling {key}={merged.get(key)} is not supported (megatron-core's llama3 rope "
                    f"scaling hard-codes {key}={expected})"
                )
        return float(theta), {"rope_scaling": True, "rope_scaling_factor": float(factor)}
    raise ValueError(
        f"rope_scaling rope_type={rope_type!r} is not supported (supported: default, linear, llama3)"
    )


def check_hf_config(hf_config, tp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """Raise ``ValueError`` naming the setting when the model cannot be built at this TP / EP /
    expert TP."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported by the megatron actor "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r} is not supported (only silu / SwiGLU)")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if model_type in ("llama", "qwen3") and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"attention_bias=True is not supported for {model_type} (it also biases o_proj)")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported")
    if is_moe(hf_config):
        check_moe_hf_config(hf_config, tp, ep, etp)
    elif ep != 1:
        raise MegatronConfigError(
            f"spec.megatron.expertModelParallelSize={ep} needs a mixture-of-experts model "
            f"(model_type {model_type!r} has no experts); use 1"
        )
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    fix = "choose a megatron.tensorModelParallelSize that divides it"
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", hf_config.intermediate_size),
    ):
        if value % tp != 0:
            raise ValueError(
                f"megatron.tensorModelParallelSize={tp} does not divide {name}={value} of the model; {fix}"
            )
    if heads % kv_heads != 0:
        raise ValueError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    _rope(hf_config)


def megatron_config_from_hf(
    hf_config,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    vpp: int | None = None,
    dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    on_gpu: bool | None = None,
    use_te: bool | None = None,
    perform_initialization: bool = True,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    fused_elementwise: bool | None = None,
) -> MegatronModelConfig:
    """Build the megatron model description for ``hf_config`` at tensor/pipeline/context parallel
    sizes (``vpp``: model chunks per pipeline stage, None without interleaving).

    ``fused_elementwise``: compiled RMSNorm, RoPE and SwiGLU on the local spec
    (:mod:`.fused_elementwise`; None: ``RLJOB_FUSED_ELEMENTWISE``, else on with a GPU); the TE spec
    has its own fused kernels and ignores it.

    ``dtype`` is the compute dtype (params on CPU; Float16Module's dtype on GPU). Keep
    ``perform_initialization`` on even though HF weights overwrite the values: megatron only marks
    weights as tensor-parallel (``param.tensor_model_parallel``, used by grad-norm clipping) in its
    init functions.

    ``recompute_granularity``: ``None``/``"none"``, ``"selective"`` or ``"full"``; with ``"full"``,
    ``recompute_method`` (default ``"uniform"``) and ``recompute_num_layers`` (default 1) apply, and
    are ignored otherwise. ``overrides``: extra ``TransformerConfig`` fields
    (``spec.megatron.overrideTransformerConfig``), applied last; ``recompute_*`` keys there win
    over the arguments.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from . import fused_elementwise as fe
    from .sdpa_attention import SDPAttention
    from .sequence_parallel import SequenceParallelRMSNorm, sp_norms_in_block_spec

    check_hf_config(hf_config, tp, ep, etp)
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    use_te = (on_gpu and have_transformer_engine()) if use_te is None else use_te
    if fused_elementwise is None:
        fused_elementwise = fe.fused_elementwise_enabled(on_gpu)
    fused_elementwise = fused_elementwise and not use_te
    if not use_te:  # overrideTransformerConfig.apply_rope_fusion finds a kernel without TE too
        fe.install_rope_fusion()
    if sequence_parallel and tp == 1:  # megatron's own rule: nothing to split the sequence over
        raise MegatronConfigError(
            "spec.megatron.sequenceParallel=true needs spec.megatron.tensorModelParallelSize > 1 "
            "(sequence parallelism splits activations over the TP ranks); set it to false or raise TP"
        )
    if cp < 1:
        raise MegatronConfigError(f"spec.megatron.contextParallelSize must be >= 1, got {cp}")
    model_type = hf_config.model_type
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    theta, rope_kwargs = _rope(hf_config)
    qk_layernorm = model_type == "qwen3"

    kwargs = {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": kv_heads,
        "kv_channels": head_dim,
        "ffn_hidden_size": hf_config.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": model_type == "qwen2",
        "qk_layernorm": qk_layernorm,
        "hidden_dropout": 0.0,
        "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        "init_method_std": float(getattr(hf_config, "initializer_range", 0.02)),
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "virtual_pipeline_model_parallel_size": vpp if pp > 1 else None,
        # Interleaved stages at PP=2 exchange activations and gradients with one peer in both
        # directions at once: megatron's unbatched p2p keeps the two directions apart (on two process
        # groups); its batched p2p would pair them in posting order.
        "batch_p2p_comm": not (vpp and pp > 1),
        "sequence_parallel": sequence_parallel,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        # On GPU the model is wrapped in Float16Module for bf16/fp16 (fp32 main params live in the
        # optimizer); on CPU the parameters simply have ``dtype``.
        "bf16": on_gpu and dtype == torch.bfloat16,
        "fp16": on_gpu and dtype == torch.float16,
        "use_cpu_initialization": not on_gpu,
        "perform_initialization": perform_initialization,
        "gradient_accumulation_fusion": False,  # needs apex's fused wgrad kernel
        # megatron's torch.compile'd SwiGLU and (fused_elementwise.py's) compiled RoPE
        "bias_activation_fusion": fused_elementwise,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": fused_elementwise,
        "persist_layer_norm": False,  # apex's kernel; the fused norm is fused_elementwise.FusedRMSNorm
        "rotary_interleaved": False,
    }
    if is_moe(hf_config):
        kwargs.update(moe_transformer_kwargs(hf_config, ep, etp))
    kwargs.update(check_overrides(overrides or {}))
    kwargs.update(  # after the overrides: resolves their recompute_* keys together with the spec's
        recompute_kwargs(
            recompute_granularity,
            recompute_method,
            recompute_num_layers,
            total_layers=hf_config.num_hidden_layers,
            pp=pp * (vpp or 1),  # megatron recomputes within each model chunk
            overrides=overrides,
        )
    )
    try:
        config = TransformerConfig(**kwargs)
    except (ValueError, AssertionError, TypeError) as err:
        keys = sorted(overrides or {})
        where = f" (with {OVERRIDE_PATH} keys {keys})" if keys else ""
        raise MegatronConfigError(
            f"megatron TransformerConfig rejected the configuration{where}: {err}"
        ) from err

    if not use_te and config.recompute_granularity == "selective":
        # megatron-core 0.16.1's CheckpointWithoutOutput (behind these two) sets ``fp8 = fp8 is not None``,
        # i.e. always True, and then calls transformer_engine's FP8GlobalStateManager: NameError without TE
        needs_te = sorted({"layernorm", "moe_act"} & set(config.recompute_modules or []))
        if needs_te:
            raise MegatronConfigError(
                f"{OVERRIDE_PATH}.recompute_modules: {needs_te} recompute needs transformer_engine with "
                "megatron-core 0.16.1 (its CheckpointWithoutOutput always takes the fp8 path); "
                "without it use core_attn and/or mlp"
            )

    final_layernorm = None
    if is_moe(hf_config):
        layer_spec = moe_block_spec(config, use_te)
        if (sequence_parallel or fused_elementwise) and not use_te:  # qwen3_moe: qk norms from the MoE kwargs
            norm = fe.FusedRMSNorm if fused_elementwise else SequenceParallelRMSNorm
            sp_norms_in_block_spec(layer_spec, config.qk_layernorm, norm)
    elif use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        # TE attention: the actor always runs plain causal attention (no padding mask).
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
        layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention
        if fused_elementwise:  # compiled RMSNorm (an SP-tagged torch RMSNorm underneath)
            final_layernorm = fe.FusedRMSNorm
            fe.fused_norms_in_layer_spec(layer_spec, qk_layernorm)
        elif sequence_parallel:  # torch norms refuse SP: the same RMSNorm, weights tagged for megatron
            final_layernorm = SequenceParallelRMSNorm
            layer_spec.submodules.input_layernorm = SequenceParallelRMSNorm
            layer_spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
            if qk_layernorm:
                attn = layer_spec.submodules.self_attention.submodules
                attn.q_layernorm = attn.k_layernorm = SequenceParallelRMSNorm

    padded = padded_vocab_size(hf_config.vocab_size, tp)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    gpt_kwargs = dict(
        vocab_size=padded,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        parallel_output=True,
        share_embeddings_and_output_weights=tie,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=theta,
        **rope_kwargs,
    )
    return MegatronModelConfig(
        model_type=model_type,
        transformer_config=config,
        layer_spec=layer_spec,
        gpt_kwargs=gpt_kwargs,
        hf_vocab_size=hf_config.vocab_size,
        padded_vocab_size=padded,
        tie_word_embeddings=tie,
        uses_te=use_te,
        final_layernorm=final_layernorm,
        fused_elementwise=fused_elementwise,
    )


def recompute_kwargs(
    granularity: str | None,
    method: str | None,
    num_layers: int | None,
    *,
    total_layers: int | None = None,
    pp: int = 1,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``TransformerConfig`` recompute fields for the spec's settings, validated.

    ``overrides`` (``overrideTransformerConfig``) may set any ``recompute_*`` field itself; those
    values win, and the spec's method / layer count fill in what a ``full`` override leaves unset.
    """
    overrides = overrides or {}
    if granularity is not None and str(granularity) not in RECOMPUTE_GRANULARITIES:
        raise MegatronConfigError(
            f"spec.megatron.recomputeGranularity={granularity!r} is not one of {', '.join(RECOMPUTE_GRANULARITIES)}"
        )
    if "recompute_granularity" in overrides:
        gran = overrides["recompute_granularity"]
        gran = None if gran == "none" else gran
        src_g = f"{OVERRIDE_PATH}.recompute_granularity"
    else:
        gran = None if granularity in (None, "none") else str(granularity)
        src_g = "spec.megatron.recomputeGranularity"
    out: dict[str, Any] = {"recompute_granularity": gran}
    if gran == "full":
        meth = overrides.get("recompute_method", method or "uniform")
        layers = overrides.get("recompute_num_layers", 1 if num_layers is None else num_layers)
        src_m = (
            f"{OVERRIDE_PATH}.recompute_method"
            if "recompute_method" in overrides
            else "spec.megatron.recomputeMethod"
        )
        src_n = (
            f"{OVERRIDE_PATH}.recompute_num_layers"
            if "recompute_num_layers" in overrides
            else "spec.megatron.recomputeNumLayers"
        )
        if meth not in RECOMPUTE_METHODS:
            raise MegatronConfigError(
                f"{src_m}={meth!r} is not one of {', '.join(RECOMPUTE_METHODS)} ({src_g}=full)"
            )
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise MegatronConfigError(f"{src_n}={layers!r} must be an integer >= 1 ({src_g}=full)")
        if total_layers is not None:
            per_stage = total_layers // max(pp, 1)
            if meth == "uniform" and per_stage % layers != 0:
                raise MegatronConfigError(
                    f"{src_n}={layers} must divide the {per_stage} transformer layers per pipeline stage "
                    f"with recomputeMethod uniform (megatron recomputes groups of that many layers)"
                )
            if meth == "block" and layers > per_stage:
                raise MegatronConfigError(
                    f"{src_n}={layers} exceeds the {per_stage} transformer layers per pipeline stage "
                    f"(recomputeMethod block recomputes that many layers of each stage)"
                )
        out.update(recompute_method=meth, recompute_num_layers=layers)
    elif gran == "selective":
        # megatron rejects recompute_num_layers with selective; the method has no effect there
        out.update(recompute_method=None, recompute_num_layers=None)
    elif gran is not None:
        raise MegatronConfigError(f"{src_g}={gran!r} is not one of {', '.join(RECOMPUTE_GRANULARITIES)}")
    else:
        out.update(recompute_method=None, recompute_num_layers=None)
    return out


def check_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``overrideTransformerConfig`` against ``TransformerConfig``'s fields and types;
    returns the values converted to the field types (enum names -> enum members, dtype names ->
    ``torch.dtype``). Raises ``ValueError`` naming ``spec.megatron.overrideTransformerConfig.<key>``."""
    from megatron.core.transformer import TransformerConfig

    if not isinstance(overrides, Mapping):
        raise MegatronConfigError(
            f"{OVERRIDE_PATH} must be a mapping of TransformerConfig fields, got {type(overrides).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    hints = _type_hints(TransformerConfig)
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        where = f"{OVERRIDE_PATH}.{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise MegatronConfigError(
                f"{where}: megatron-core's TransformerConfig has no field {key!r}{hint}"
            )
        if key in _NOT_OVERRIDABLE:
            raise MegatronConfigError(f"{where} cannot be overridden: {_NOT_OVERRIDABLE[key]}")
        if key == "recompute_granularity" and value == "none":
            value = None  # the spec's spelling of megatron's None
        hint_type = hints.get(key)
        ok, converted = _coerce(value, hint_type) if hint_type is not None else (True, value)
        if not ok:
            raise MegatronConfigError(
                f"{where}={value!r} does not match the field's type {_type_name(hint_type)}"
            )
        out[key] = converted
    return out


def _type_hints(cls) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError, AttributeError):  # an unresolvable annotation: skip type checks
        return {}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(matches, value converted to ``tp``) for the JSON-ish ``value``; unknown types match."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        for arg in args:
            ok, converted = _coerce(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin is typing.Literal:
        return value in args, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if tp is torch.dtype:
        if isinstance(value, torch.dtype):
            return True, value
        dt = getattr(torch, str(value).removeprefix("torch."), None) if isinstance(value, str) else None
        return isinstance(dt, torch.dtype), dt if isinstance(dt, torch.dtype) else value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return True, value
        if isinstance(value, str) and value in tp.__members__:
            return True, tp[value]
        try:
            return True, tp(value)
        except (ValueError, TypeError):
            return False, value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        if not args or (origin is tuple and Ellipsis in args):
            item_types = [args[0]] * len(value) if args else [Any] * len(value)
        elif origin is tuple:
            if len(args) != len(value):
                return False, value
            item_types = list(args)
        else:
            item_types = [args[0]] * len(value)
        items = []
        for item, item_tp in zip(value, item_types):
            ok, converted = _coerce(item, item_tp)
            if not ok:
                return False, value
            items.append(converted)
        return True, (tuple(items) if (origin is tuple or tp is tuple) else items)
    if origin is collections.abc.Callable or tp is typing.Callable:
        return callable(value), value
    return True, value  # a type we do not check (context managers, recipe objects, ...)


def build_gpt_model(
    mcfg: MegatronModelConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
):
    """Instantiate one ``GPTModel`` (chunk) of this rank (needs megatron's parallel state initialised)."""
    from megatron.core.models.gpt import GPTModel

    spec = mcfg.layer_spec
    if mcfg.final_layernorm is not None:  # megatron picks the final norm itself for a layer spec
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        n = get_num_layers_to_build(mcfg.transformer_config, vp_stage=vp_stage)
        spec = TransformerBlockSubmodules(layer_specs=[mcfg.layer_spec] * n, layer_norm=mcfg.final_layernorm)
    return GPTModel(
        config=mcfg.transformer_config,
        transformer_layer_spec=spec,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **mcfg.gpt_kwargs,
    )


def build_model_chunks(mcfg: MegatronModelConfig) -> list:
    """This rank's model chunks: one ``GPTModel`` per virtual pipeline stage (one without VPP), each
    holding its share of the layers; the embedding lives on the first chunk of the first stage, the
    final norm and output layer on the last chunk of the last stage."""
    from megatron.core import parallel_state as ps

    vpp = mcfg.transformer_config.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    return [
        build_gpt_model(
            mcfg,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        for stage in stages
    ]
