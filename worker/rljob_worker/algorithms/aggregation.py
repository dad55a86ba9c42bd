"""Masked reductions and the loss aggregation modes (token-mean, seq-mean-token-mean, Dr.GRPO).

Every function here treats positions where the mask is 0 as absent: their values, even NaN or
inf, change neither the result nor its gradient.
"""

import torch
from rljob_api.enums import LossAggregation


def masked_zero(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Replace masked-out entries by 0 so that neither their value nor a NaN gradient leaks through.

    values: any shape; mask: same shape (bool or 0/1). Returns the same shape as values.
    Uses torch.where, not multiplication, so NaN or inf at masked positions become exactly 0.
    """
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over the positions where mask is set; 0 when the mask is empty.

    values, mask: same shape. Returns a scalar tensor.
    """
    mask = mask.bool()
    count = mask.sum().clamp(min=1)
    return masked_zero(values, mask).sum() / count


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar.

    loss_mat: (B, T) per-token loss; mask: (B, T) response mask (bool or 0/1).
    mode:
      - TOKEN_MEAN: sum(loss * mask) / sum(mask) over the whole batch (DAPO); 0 when no token is set.
      - SEQ_MEAN_TOKEN_MEAN: each sequence's mean over its tokens, then the mean over the sequences
        that have at least one token (GRPO paper); 0 when none has.
      - SEQ_MEAN_TOKEN_SUM_NORM: each sequence's token sum divided by the constant norm_length
        (default T), then the mean over all B sequences (Dr.GRPO: no length bias).
    norm_length: only used by SEQ_MEAN_TOKEN_SUM_NORM; usually the maximum response length.
    Returns a scalar tensor.
    """
    mode = LossAggregation(mode)
    mask = mask.bool()
    loss_mat = masked_zero(loss_mat, mask)
    if mode is LossAggregation.TOKEN_MEAN:
        return loss_mat.sum() / mask.sum().clamp(min=1)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        tokens = mask.sum(dim=-1)  # (B,)
        seq_means = loss_mat.sum(dim=-1) / tokens.clamp(min=1)  # (B,)
        has_tokens = tokens > 0
        return masked_zero(seq_means, has_tokens).sum() / has_tokens.sum().clamp(min=1)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        if length <= 0:
            raise ValueError(f"norm_length must be positive, got {length}")
        return (loss_mat.sum(dim=-1) / length).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")
