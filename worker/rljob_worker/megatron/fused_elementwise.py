"""Fused elementwise kernels for megatron's local layer spec (no transformer_engine, no apex):
RMSNorm, RoPE and SwiGLU, each one ``torch.compile``d function (one fused kernel forward, one
backward on a GPU) instead of the chain of eager ops the local spec runs.

- **SwiGLU**: megatron's own ``bias_activation_fusion`` (``SwiGLUFunction``: megatron compiles
  ``swiglu`` / ``swiglu_back`` with ``torch.compile``, saves only the fc1 output for the backward).
- **RoPE**: megatron's ``apply_rope_fusion`` flag, whose kernel (``fused_apply_rotary_pos_emb``) comes
  from transformer_engine; without TE it is :func:`fused_apply_rotary_pos_emb` here, megatron's own
  ``_apply_rotary_pos_emb_bshd`` compiled (same maths; cos / sin, the half rotation, multiply-add and
  the cast in one kernel). Concatenated sequences (the ``thd`` format) take the same kernel over each
  token's position in its own segment (:func:`fused_apply_rotary_pos_emb_thd`).
- **RMSNorm**: :class:`FusedRMSNorm` in place of the spec's ``torch.nn.RMSNorm`` (the same module, the
  same ``weight``; ``F.rms_norm`` compiled), the block's final norm and the q/k norms included.

All three act per token and per TP / CP shard, so they run unchanged under TP, SP (the norm keeps
:class:`.sequence_parallel.SequenceParallelRMSNorm`'s weight tag), PP, CP and activation recompute.

On by default with a GPU and off on CPU; ``RLJOB_FUSED_ELEMENTWISE=0`` turns them off (``1`` turns
them on on CPU too). Shapes: the token dims (sequence, rows, heads) are compiled dynamic and the
feature dim static, so a new micro-batch length does not recompile; each kind of call (training,
no-grad passes, a frozen reference model, q vs k norms) compiles its own copy (:func:`_compiled`).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from .errors import MegatronConfigError
from .sequence_parallel import SequenceParallelRMSNorm

ENV = "RLJOB_FUSED_ELEMENTWISE"
_COMPILED: dict[str, Callable] = {}


def fused_elementwise_enabled(on_gpu: bool) -> bool:
    """``RLJOB_FUSED_ELEMENTWISE``: ``1`` on, ``0`` off; unset: on with a GPU, off on CPU."""
    value = os.environ.get(ENV, "").strip()
    if value == "":
        return on_gpu
    if value in ("0", "1"):
        return value == "1"
    raise MegatronConfigError(f"{ENV}={value!r}: use 1 (on) or 0 (off); unset means on with a GPU, off on CPU")


def _compiled(fn: Callable, t: torch.Tensor, *more: torch.Tensor) -> Callable:
    """``torch.compile(fn)`` for the kind of call made with ``t`` (and ``more`` tensors): its rank,
    whether it is contiguous, the grad mode and which tensors require grad; each kind is a copy of
    ``fn`` with its own code object. Dynamo keeps compiled graphs and its recompile limit (8) per
    code object, and q (contiguous) vs k (a strided view of the QKV output) norms, training, no-grad
    log-prob passes, frozen reference models and recompute would otherwise share one cache and run
    past the limit (after which dynamo runs the function eagerly)."""
    grads = "".join("g" if x.requires_grad else "n" for x in (t, *more))
    mode = "grad" if torch.is_grad_enabled() else "nograd"
    kind = f"{t.dim()}d_{'contiguous' if t.is_contiguous() else 'strided'}_{mode}_{grads}"
    key = f"{fn.__module__}.{fn.__name__}__{kind}"
    if key not in _COMPILED:
        code = fn.__code__.replace(co_name=f"{fn.__name__}__{kind}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        _COMPILED[key] = torch.compile(copy)
    return _COMPILED[key]


def _feature_dim_static(t: torch.Tensor) -> None:
    """Every dim but the last (sequence, rows, heads) compiles as a dynamic size, the last one static:
    one graph serves every micro-batch length and head count, and a norm over another width (q/k
    norms) gets its own graph instead of making the width (the reduction) dynamic."""
    for d in range(t.dim() - 1):
        torch._dynamo.maybe_mark_dynamic(t, d)
    torch._dynamo.mark_static(t, t.dim() - 1)


# ------------------------------------------------------------------------------------------ RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm``'s maths: ``x (..., H)``, ``weight (H,)`` -> ``(..., H)``."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` compiled (one kernel forward and backward): ``x (s, b, ..., H)``."""
    _feature_dim_static(x)
    return _compiled(rms_norm, x, weight)(x, weight, eps)


class FusedRMSNorm(SequenceParallelRMSNorm):
    """The local spec's RMSNorm (``torch.nn.RMSNorm``, the SP weight tag of its base) computed by
    :func:`fused_rms_norm`; ``fused = False`` runs the eager module (benchmarks compare both)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs: object) -> None:
        super().__init__(config, hidden_size, eps, **kwargs)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().forward(x)
        return fused_rms_norm(x, self.weight, self.eps if self.eps is not None else torch.finfo(x.dtype).eps)


# ------------------------------------------------------------------------------------------ RoPE


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                               **_: Any) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` compiled, in the place of transformer_engine's
    ``fused_apply_rotary_pos_emb`` (what ``apply_rope_fusion`` calls): ``t (s, b, heads, d)``,
    ``freqs (s, 1, 1, d_rot)`` fp32 -> ``(s, b, heads, d)``."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    _feature_dim_static(t)
    _feature_dim_static(freqs)
    return _compiled(_apply_rotary_pos_emb_bshd, t)(t, freqs, rotary_interleaved=interleaved)


def segment_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``(total,) long``: each token's position within its segment of a concatenated sequence whose
    segment boundaries are ``cu_seqlens (n + 1,)`` (no host sync)."""
    cu = cu_seqlens.long()
    index = torch.arange(total, device=cu.device)
    segment = torch.searchsorted(cu[1:], index, right=True)
    return index - cu[segment]


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                                   cp_size: int = 1, cp_rank: int = 0, **_: Any) -> torch.Tensor:
    """The thd counterpart of :func:`fused_apply_rotary_pos_emb` (what ``apply_rope_fusion`` calls with
    ``cu_seqlens``): ``t (tokens, heads, d)`` of concatenated segments, ``freqs (max_len, 1, 1, d_rot)``;
    each token rotated by its position in its segment. No context parallelism."""
    if cp_size != 1:
        raise NotImplementedError("the compiled thd RoPE runs without context parallelism")
    return fused_apply_rotary_pos_emb(t[:, None], _segment_freqs(cu_seqlens, freqs, t.shape[0]))[:, 0]


_LAST_SEGMENT_FREQS: list = [None]  # (cu_seqlens, freqs, total, per-token freqs) of the last call


def _segment_freqs(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int) -> torch.Tensor:
    """``freqs`` at each token's position in its segment, ``(total, 1, 1, d_rot)``. Every layer's q and k of one
    forward pass the same ``cu_seqlens`` and ``freqs`` objects: computed once for them (host time is what a small
    model's layer is short of)."""
    last = _LAST_SEGMENT_FREQS[0]
    if last is not None and last[0] is cu_seqlens and last[1] is freqs and last[2] == total:
        return last[3]
    per_token = freqs[segment_positions(cu_seqlens.to(freqs.device), total)]
    _LAST_SEGMENT_FREQS[0] = (cu_seqlens, freqs, total, per_token)
    return per_token


def install_rope_fusion() -> None:
    """Give megatron's ``apply_rope_fusion`` the compiled RoPE (rows and thd) when transformer_engine's
    is absent (idempotent; a model runs it only when its config sets ``apply_rope_fusion``)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd


# ------------------------------------------------------------------------------------------ wiring


def transformer_kwargs() -> dict[str, bool]:
    """The ``TransformerConfig`` fields that turn megatron's own SwiGLU and RoPE fusions on."""
    install_rope_fusion()
    return {"bias_activation_fusion": True, "apply_rope_fusion": True}


def fused_norms_in_layer_spec(layer_spec, qk_layernorm: bool) -> None:
    """Put :class:`FusedRMSNorm` into a local layer spec's norms (q/k norms included), in place."""
    layer_spec.submodules.input_layernorm = FusedRMSNorm
    layer_spec.submodules.pre_mlp_layernorm = FusedRMSNorm
    if qk_layernorm:
        attn = layer_spec.submodules.self_attention.submodules
        attn.q_layernorm = attn.k_layernorm = FusedRMSNorm


def set_fused_elementwise(chunks: Iterable[torch.nn.Module], enabled: bool) -> None:
    """Switch the fusions of models built with them on (benchmarks: one model, fused and eager).
    ``chunks``: GPTModels sharing one ``TransformerConfig``."""
    for chunk in chunks:
        config = chunk.config
        config.bias_activation_fusion = enabled
        config.apply_rope_fusion = enabled
        for module in chunk.modules():
            if isinstance(module, FusedRMSNorm):
                module.fused = enabled
