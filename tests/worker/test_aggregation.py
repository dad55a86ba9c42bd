"""Loss aggregation modes on a hand-computed loss matrix."""

import pytest
import torch
from rljob_api.enums import LossAggregation
from rljob_worker.algorithms import aggregate_loss, masked_mean

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


def test_token_mean_by_hand():
    # (1 + 2 + 5 + 6 + 7) / 5
    assert aggregate_loss(LOSS, MASK, LossAggregation.TOKEN_MEAN).item() == pytest.approx(4.2)


def test_seq_mean_token_mean_skips_empty_sequences():
    # (mean(1, 2) + mean(5, 6, 7)) / 2 sequences with tokens
    assert aggregate_loss(LOSS, MASK, LossAggregation.SEQ_MEAN_TOKEN_MEAN).item() == pytest.approx(3.75)


def test_dr_grpo_sum_norm_defaults_to_T_and_averages_over_all_sequences():
    # (3/4 + 18/4 + 0/4) / 3
    assert aggregate_loss(LOSS, MASK, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM).item() == pytest.approx(1.75)
    # (3/8 + 18/8 + 0) / 3
    value = aggregate_loss(LOSS, MASK, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM, norm_length=8)
    assert value.item() == pytest.approx(0.875)


def test_norm_length_is_ignored_by_the_mean_modes():
    for mode in (LossAggregation.TOKEN_MEAN, LossAggregation.SEQ_MEAN_TOKEN_MEAN):
        assert (
            aggregate_loss(LOSS, MASK, mode, norm_length=100).item()
            == aggregate_loss(LOSS, MASK, mode).item()
        )


def test_gradients_by_hand():
    loss = LOSS.clone().requires_grad_(True)
    aggregate_loss(loss, MASK, LossAggregation.TOKEN_MEAN).backward()
    torch.testing.assert_close(loss.grad, MASK.float() / 5)

    loss.grad = None
    aggregate_loss(loss, MASK, LossAggregation.SEQ_MEAN_TOKEN_MEAN).backward()
    expected = torch.tensor([[1 / 4, 1 / 4, 0, 0], [1 / 6, 1 / 6, 1 / 6, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(loss.grad, expected)

    loss.grad = None
    aggregate_loss(loss, MASK, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM, norm_length=8).backward()
    torch.testing.assert_close(loss.grad, MASK.float() / 24)


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_empty_mask_gives_zero_and_zero_gradient(mode):
    loss = LOSS.clone().requires_grad_(True)
    out = aggregate_loss(loss, torch.zeros_like(MASK), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros_like(LOSS))


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_masked_positions_never_matter(mode):
    noisy = LOSS.clone()
    noisy[MASK == 0] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -7.0, 0.5, 2.0])
    a, b = LOSS.clone().requires_grad_(True), noisy.requires_grad_(True)
    out_a, out_b = aggregate_loss(a, MASK, mode), aggregate_loss(b, MASK, mode)
    out_a.backward()
    out_b.backward()
    assert out_a.item() == out_b.item()
    assert torch.equal(a.grad, b.grad)


def test_bool_and_int_masks_agree():
    for mode in LossAggregation:
        assert aggregate_loss(LOSS, MASK.bool(), mode).item() == aggregate_loss(LOSS, MASK, mode).item()


def test_bad_norm_length_and_mode():
    with pytest.raises(ValueError):
        aggregate_loss(LOSS, MASK, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM, norm_length=0)
    with pytest.raises(ValueError):
        aggregate_loss(LOSS, MASK, "seq-sum")


def test_masked_mean():
    assert masked_mean(LOSS, MASK).item() == pytest.approx(4.2)
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0


@pytest.mark.parametrize("mode", list(LossAggregation))
@pytest.mark.parametrize("sizes", [[1, 1, 1, 1, 1, 1], [2, 2, 2], [4, 2], [3, 3], [6]])
def test_micro_batch_shares_sum_to_the_mini_batch_loss(mode, sizes):
    """With the mini-batch's counts, the parts' losses (and gradients) sum to the whole's, at any split."""
    from rljob_worker.algorithms import loss_counts

    g = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = torch.zeros(6, 5, dtype=torch.long)
    for row, length in enumerate([1, 5, 2, 0, 3, 4]):  # lengths differ across parts; one empty row
        mask[row, :length] = 1
    whole_in = loss_mat.clone().requires_grad_(True)
    whole = aggregate_loss(whole_in, mask, mode, norm_length=5)
    whole.backward()
    tokens, sequences = loss_counts(mask)
    assert (tokens, sequences) == (15, 5)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        sequences = 6  # Dr.GRPO's mean runs over every row (an empty one adds 0)
    parts_in = loss_mat.clone().requires_grad_(True)
    total, start = 0.0, 0
    for size in sizes:
        sl = slice(start, start + size)
        total = total + aggregate_loss(parts_in[sl], mask[sl], mode, norm_length=5,
                                       num_tokens=tokens, num_sequences=sequences)
        start += size
    total.backward()
    torch.testing.assert_close(total, whole.detach())
    torch.testing.assert_close(parts_in.grad, whole_in.grad)


def test_token_mean_of_parts_with_their_own_counts_is_not_the_token_mean():
    """Why the counts are needed: averaging per-part token means reweights tokens by their part's size."""
    loss_mat = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whole = aggregate_loss(loss_mat, mask, LossAggregation.TOKEN_MEAN)  # (3 + 4) / 4
    per_part = sum(aggregate_loss(loss_mat[i:i + 1], mask[i:i + 1], LossAggregation.TOKEN_MEAN) for i in range(2)) / 2
    assert whole.item() == pytest.approx(1.75)
    assert per_part.item() == pytest.approx(2.5)  # (1 + 4) / 2: a sequence mean
