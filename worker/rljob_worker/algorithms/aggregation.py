"""Masked reductions and the loss aggregation modes (token-mean, seq-mean-token-mean, Dr.GRPO).

Every function here treats positions where the mask is 0 as absent: their values, even NaN or
inf, change neither the result nor its gradient.

Global normalisers: one optimizer step sees a mini-batch that is cut into micro-batches and spread
over data-parallel ranks. The loss the spec names is a mean over the *whole* mini-batch, so each
micro-batch's share is its masked sum divided by the mini-batch's counts (:func:`loss_counts`,
summed over micro-batches and ranks), not by its own: then the micro-batch losses of every rank
sum to the mini-batch loss at any micro-batch size or data-parallel layout.
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


def _count(local, given: float | None):
    """The divisor: the given mini-batch count, else this batch's own; at least 1 (empty gives 0)."""
    if given is not None:
        return max(float(given), 1.0)
    return local.clamp(min=1) if isinstance(local, torch.Tensor) else max(float(local), 1.0)


def loss_counts(mask: torch.Tensor) -> tuple[int, int]:
    """The two normalisers of a batch: (response tokens, sequences with at least one response token).

    mask: (B, T) response mask. Sum the pairs of every micro-batch and data-parallel rank of a
    mini-batch (one all-reduce of two integers) and pass them to :func:`aggregate_loss` as
    ``num_tokens`` / ``num_sequences``.
    """
    mask = mask.bool()
    return int(mask.sum()), int(mask.any(dim=-1).sum())


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    norm_length: int | None = None,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar: this batch's share of a mini-batch loss.

    loss_mat: (B, T) per-token loss; mask: (B, T) response mask (bool or 0/1).
    num_tokens, num_sequences: the counts of :func:`loss_counts` over the whole mini-batch this
      batch is a part of (all its micro-batches on all data-parallel ranks). Unset, this batch is
      the whole mini-batch (its own counts). With them set, the results of the parts sum to the
      result of the whole, whatever the split.
    mode (S = num_sequences, N = num_tokens):
      - TOKEN_MEAN: sum(loss * mask) / N (DAPO); every token weighs the same in the mini-batch.
      - SEQ_MEAN_TOKEN_MEAN: sum over sequences of each sequence's mean over its tokens, / S
        (GRPO paper); every sequence weighs the same.
      - SEQ_MEAN_TOKEN_SUM_NORM: sum over sequences of each token sum divided by the constant
        norm_length (default T), / S (Dr.GRPO: no length bias). Unset, S is all B rows.
    A batch (or mini-batch) without response tokens gives 0 with a zero gradient.
    norm_length: only used by SEQ_MEAN_TOKEN_SUM_NORM; usually the maximum response length.
    Returns a scalar tensor.
    """
    mode = LossAggregation(mode)
    mask = mask.bool()
    loss_mat = masked_zero(loss_mat, mask)
    if mode is LossAggregation.TOKEN_MEAN:
        return loss_mat.sum() / _count(mask.sum(), num_tokens)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        tokens = mask.sum(dim=-1)  # (B,)
        seq_means = loss_mat.sum(dim=-1) / tokens.clamp(min=1)  # (B,); 0 for a row without tokens
        return seq_means.sum() / _count((tokens > 0).sum(), num_sequences)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        length = loss_mat.shape[-1] if norm_length is None else norm_length
        if length <= 0:
            raise ValueError(f"norm_length must be positive, got {length}")
        return (loss_mat.sum(dim=-1) / length).sum() / _count(loss_mat.shape[0], num_sequences)
    raise ValueError(f"unknown loss aggregation {mode!r}")
