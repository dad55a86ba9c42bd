"""The fused policy head on a megatron GPTModel: the model stops before its output layer, and
:func:`.fused_logprobs.fused_logprobs_entropy` turns the last hidden state and the output weight
into per-token log-probs and entropy in chunks (no ``(b, T, V)`` fp32 logits).

Off with ``RLJOB_FUSED_LOGPROBS=0`` (then the head reads the full vocab-parallel logits, as before).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .fused_logprobs import fused_logprobs_entropy


def fused_head_enabled() -> bool:
    """On unless ``RLJOB_FUSED_LOGPROBS=0``."""
    return os.environ.get("RLJOB_FUSED_LOGPROBS", "1") != "0"


def _returns_hidden(hidden_states, weight=None, runtime_gather_output=None):
    return hidden_states, None


@contextlib.contextmanager
def output_layer_returns_hidden(chunk: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """While active, ``chunk`` (a last-stage GPTModel) returns its final-norm hidden state
    ``(b, s, H)`` (under sequence parallelism this TP rank's ``s / tp`` share) instead of logits:
    its output layer passes its input through."""
    layer = getattr(chunk, "output_layer", None)
    if not enabled or layer is None:
        yield
        return
    layer.forward = _returns_hidden  # instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        del layer.forward


def output_weight(chunk: torch.nn.Module) -> torch.Tensor:
    """This TP rank's rows of the output weight ``(V_padded / tp, H)`` (the embedding when tied)."""
    if chunk.share_embeddings_and_output_weights:
        return chunk.shared_embedding_or_output_weight()
    return chunk.output_layer.weight


def fused_token_values(
    hidden: torch.Tensor,
    chunk: torch.nn.Module,
    local_targets: torch.Tensor,
    vocab_size: int,
    with_entropy: bool,
    sequence_parallel: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token log-probs and entropy ``(b, s)`` each (entropy None unless ``with_entropy``).

    hidden: ``(b, s, H)`` from :func:`output_layer_returns_hidden` (``(b, s / tp, H)`` under
    sequence parallelism: gathered here, as the output layer would); local_targets: ``(b, s)``
    global vocab ids, the token each position predicts; vocab_size: the real (unpadded) vocab.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    tp = ps.get_tensor_model_parallel_world_size()
    if sequence_parallel and tp > 1:  # (b, s/tp, H) -> (s/tp, b, H) -> all-gather -> (b, s, H)
        # the fused backward all-reduces the hidden gradient over TP, so the gather's backward only splits
        hidden = gather_from_sequence_parallel_region(
            hidden.transpose(0, 1).contiguous(), tensor_parallel_output_grad=False
        ).transpose(0, 1)
    b, s, h = hidden.shape
    weight = output_weight(chunk)
    lp, ent = fused_logprobs_entropy(
        hidden.reshape(b * s, h),
        weight,
        local_targets.reshape(b * s).clamp(0, vocab_size - 1),
        vocab_size=vocab_size,
        vocab_start=ps.get_tensor_model_parallel_rank() * weight.shape[0],
        tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
        with_entropy=with_entropy,
    )
    return lp.view(b, s), (ent.view(b, s) if ent is not None else None)
