"""HF ``PretrainedConfig`` -> megatron-core ``TransformerConfig`` + layer spec + ``GPTModel`` kwargs.

Supported ``model_type``: llama, qwen2, qwen3 (dense decoders with RMSNorm, SwiGLU, RoPE, GQA).
Every HF setting that changes the maths is either mapped or rejected with a ``ValueError`` naming
it; nothing is silently ignored.

Layer spec: megatron's local spec with :class:`SDPAttention` as core attention (the local
``DotProductAttention`` materialises fp32 scores). When transformer_engine is importable and a GPU
is present, the TE spec (fused norm+linear, TE attention) is used instead.

Vocabulary: megatron splits the vocab evenly across TP ranks, so a vocab size TP does not divide
is padded to the next multiple of TP (extra rows are zero and their logits are masked out by the
actor; the HF mapping strips them). A checkpoint's padded size therefore depends on TP when TP
does not divide the vocab; such a checkpoint only reloads at a TP with the same padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

# megatron's RotaryEmbedding._apply_scaling hard-codes these llama3 values.
_LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
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


def check_hf_config(hf_config, tp: int = 1) -> None:
    """Raise ``ValueError`` naming the setting when the model cannot be built at this TP."""
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
    if getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None):
        raise ValueError("mixture-of-experts models are not supported")
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
    dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    on_gpu: bool | None = None,
    use_te: bool | None = None,
    perform_initialization: bool = True,
) -> MegatronModelConfig:
    """Build the megatron model description for ``hf_config`` at tensor/pipeline parallel sizes.

    ``dtype`` is the compute dtype (params on CPU; Float16Module's dtype on GPU). Keep
    ``perform_initialization`` on even though HF weights overwrite the values: megatron only marks
    weights as tensor-parallel (``param.tensor_model_parallel``, used by grad-norm clipping) in its
    init functions.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from .sdpa_attention import SDPAttention

    check_hf_config(hf_config, tp)
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    use_te = (on_gpu and have_transformer_engine()) if use_te is None else use_te
    if sequence_parallel and not use_te:
        raise ValueError(
            "megatron.sequenceParallel=true needs transformer_engine (megatron's torch norms reject it) and "
            "a GPU (gloo has no reduce-scatter)"
        )
    model_type = hf_config.model_type
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    theta, rope_kwargs = _rope(hf_config)
    qk_layernorm = model_type == "qwen3"

    config = TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # On GPU the model is wrapped in Float16Module for bf16/fp16 (fp32 main params live in the
        # optimizer); on CPU the parameters simply have ``dtype``.
        bf16=on_gpu and dtype == torch.bfloat16,
        fp16=on_gpu and dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=perform_initialization,
        gradient_accumulation_fusion=False,  # needs apex's fused wgrad kernel
        bias_activation_fusion=False,  # the fused SwiGLU is torch.compile'd: recompiles per sequence length
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        rotary_interleaved=False,
    )

    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        # TE attention: the actor always runs plain causal attention (no padding mask).
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
        layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention

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
    )


def build_gpt_model(mcfg: MegatronModelConfig, pre_process: bool = True, post_process: bool = True):
    """Instantiate this rank's ``GPTModel`` (needs megatron's parallel state initialised)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=mcfg.transformer_config,
        transformer_layer_spec=mcfg.layer_spec,
        pre_process=pre_process,
        post_process=post_process,
        **mcfg.gpt_kwargs,
    )
