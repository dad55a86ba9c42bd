"""Sequence parallelism (SP) with megatron's local (non-transformer_engine) layer spec.

Under SP the activations between the TP regions (norms, residuals, dropout) are split along the
sequence over the TP ranks. A norm there sees only its rank's tokens, so its weight gradient is a
partial sum that must be all-reduced over TP. megatron's torch norm wrapper (``WrappedTorchNorm``)
refuses SP outright; TE and apex norms instead tag their weights ``param.sequence_parallel = True``,
which ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums over TP.

:class:`SequenceParallelRMSNorm` is ``torch.nn.RMSNorm`` (the very module the local spec builds, so
the numerics are unchanged: normalise in fp32, cast back, multiply by the weight, as HF's RMSNorm)
with that tag. :func:`tp_partial_grad_params` is megatron's rule for which replicated parameters get
partial gradients, for the CPU path that reduces gradients by hand.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over the last dim whose weight megatron all-reduces over TP under SP.

    Takes megatron's norm constructor arguments (``build_module(norm, config=..., hidden_size=...,
    eps=...)``). Input ``(..., hidden_size)``, output the same shape and dtype.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"SequenceParallelRMSNorm is an RMSNorm, the config asks for {config.normalization}"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelRMSNorm does not support layernorm_zero_centered_gamma")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def tp_partial_grad_params(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], config
) -> list[torch.nn.Parameter]:
    """Parameters replicated over TP whose gradients are per-rank partial sums (all-reduce them over
    TP with SUM): SP-tagged weights under SP, and q/k layernorm weights (each TP rank normalises only
    its own heads). The same selection as megatron's ``finalize_model_grads``."""
    out = []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
            config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
        ):
            out.append(p)
    return out


def sp_norms_in_block_spec(block_spec, qk_layernorm: bool, norm: type = SequenceParallelRMSNorm) -> None:
    """Put ``norm`` (:class:`SequenceParallelRMSNorm` or a subclass) into every layer of a block spec
    (megatron's per-layer spec for mixture-of-experts models) and into its final norm, in place."""
    for layer in block_spec.layer_specs:
        layer.submodules.input_layernorm = norm
        layer.submodules.pre_mlp_layernorm = norm
        if qk_layernorm:
            attn = layer.submodules.self_attention.submodules
            attn.q_layernorm = attn.k_layernorm = norm
    block_spec.layer_norm = norm
