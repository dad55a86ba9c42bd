"""PPO value-model math (rljob_worker.algorithms.gae) against hand-computed cases."""
from __future__ import annotations

import math

import pytest
import torch
from rljob_api.enums import LossAggregation
from rljob_worker.algorithms.gae import (
    compute_gae,
    explained_variance,
    last_token_index,
    masked_whiten,
    token_level_rewards,
    value_loss,
    whiten_advantages,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, t(expected) if not isinstance(expected, torch.Tensor) else expected,
                               atol=tol, rtol=0)


# --------------------------------------------------------------------------- token rewards


def test_outcome_reward_lands_on_the_last_counted_token_minus_kl_per_token():
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    kl = t([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    rewards = token_level_rewards(t([1.0, 0.5, 2.0]), mask, kl, kl_coef=0.1)
    close(rewards, [[-0.01, -0.02, 0.97, 0.0], [-0.04, 0.45, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    close(token_level_rewards(t([1.0, 0.5, 2.0]), mask), [[0, 0, 1, 0], [0, 0.5, 0, 0], [0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 1, -1]


def test_last_token_is_the_last_counted_one_with_holes():
    mask = t([[1, 0, 1, 0, 0]])
    close(token_level_rewards(t([3.0]), mask), [[0, 0, 3, 0, 0]])


# --------------------------------------------------------------------------- GAE

REWARDS = [0.0, 0.0, 1.0]
VALUES = [0.2, 0.5, 0.7]


@pytest.mark.parametrize(("gamma", "lam", "advantages"), [
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t = 1 - V_t
    (1.0, 1.0, [0.8, 0.5, 0.3]),
    # lam = 0.5: deltas 0.3, 0.2, 0.3 -> A2 = 0.3, A1 = 0.2 + 0.5 * 0.3, A0 = 0.3 + 0.5 * 0.35
    (1.0, 0.5, [0.475, 0.35, 0.3]),
    # gamma 0.9, lam 0.8: deltas 0.9*0.5-0.2 = 0.25, 0.9*0.7-0.5 = 0.13, 1-0.7 = 0.3; gamma*lam = 0.72
    (0.9, 0.8, [0.25 + 0.72 * (0.13 + 0.72 * 0.3), 0.13 + 0.72 * 0.3, 0.3]),
    # lam = 0: the one-step TD errors
    (0.9, 0.0, [0.25, 0.13, 0.3]),
])
def test_gae_hand_cases(gamma, lam, advantages):
    adv, returns = compute_gae(t([REWARDS]), t([VALUES]), t([[1, 1, 1]]), gamma, lam)
    close(adv, [advantages])
    close(returns, [[a + v for a, v in zip(advantages, VALUES)]])


def test_gae_with_gamma_and_lambda_one_returns_the_reward_to_go():
    rewards = t([[-0.01, -0.02, 0.97]])
    _, returns = compute_gae(rewards, t([VALUES]), t([[1, 1, 1]]), 1.0, 1.0)
    close(returns, [[0.94, 0.95, 0.97]])


def test_gae_padding_and_holes_are_transparent():
    """Trailing padding and a masked observation token in the middle change nothing at the counted tokens."""
    nan = float("nan")
    plain_adv, plain_ret = compute_gae(t([REWARDS]), t([VALUES]), t([[1, 1, 1]]), 0.9, 0.8)
    rewards = t([[0.0, nan, 0.0, 1.0, 99.0]])
    values = t([[0.2, nan, 0.5, 0.7, 99.0]])
    mask = t([[1, 0, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, 0.9, 0.8)
    close(adv[:, [0, 2, 3]], plain_adv)
    close(ret[:, [0, 2, 3]], plain_ret)
    assert adv[0, 1] == 0 and adv[0, 4] == 0 and ret[0, 1] == 0 and ret[0, 4] == 0


def test_gae_rows_are_independent():
    adv, _ = compute_gae(t([REWARDS, [0.0, 2.0, 0.0]]), t([VALUES, [0.0, 0.0, 0.0]]), t([[1, 1, 1], [1, 1, 0]]), 1.0, 1.0)
    close(adv, [[0.8, 0.5, 0.3], [2.0, 2.0, 0.0]])


# --------------------------------------------------------------------------- whitening


def test_masked_whiten_uses_the_counted_tokens_and_the_unbiased_variance():
    nan = float("nan")
    close(masked_whiten(t([[1.0, 2.0, 3.0, nan]]), t([[1, 1, 1, 0]])), [[-1.0, 0.0, 1.0, 0.0]], tol=1e-6)
    std = math.sqrt(20 / 3)  # [2, 4, 6, 8]: mean 5, unbiased variance 20 / 3
    close(masked_whiten(t([[2.0, 4.0], [6.0, 8.0]]), t([[1, 1], [1, 1]])), [[-3 / std, -1 / std], [1 / std, 3 / std]])
    close(masked_whiten(t([[1.0, 2.0, 3.0, 7.0]]), t([[1, 1, 1, 0]]), shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])


def test_masked_whiten_of_one_token_is_only_centred():
    close(masked_whiten(t([[5.0, 1.0]]), t([[1, 0]])), [[0.0, 0.0]])


def test_whiten_scope_batch_and_mini_batch_by_hand():
    """Advantages 1, 2, 3, 5 (one token per row, a padded column), two mini-batches of two rows.
    batch (verl): mean 11/4, unbiased variance (1.75^2 + 0.75^2 + 0.25^2 + 2.25^2) / 3 = 35/12.
    mini-batch: [1, 2] (mean 1.5, variance 0.5) and [3, 5] (mean 4, variance 2): each -1/sqrt2, +1/sqrt2."""
    adv = torch.tensor([[1.0, 9.0], [2.0, 9.0], [3.0, 9.0], [5.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]] * 4)
    std = math.sqrt(35 / 12)
    expected = torch.tensor([[-1.75 / std, 0], [-0.75 / std, 0], [0.25 / std, 0], [2.25 / std, 0]], dtype=torch.float64)
    torch.testing.assert_close(whiten_advantages(adv, mask, "batch", 2), expected, atol=1e-7, rtol=0)  # eps 1e-8 in var
    r = 1 / math.sqrt(2)
    expected = torch.tensor([[-r, 0], [r, 0], [-r, 0], [r, 0]], dtype=torch.float64)
    torch.testing.assert_close(whiten_advantages(adv, mask, "mini-batch", 2), expected, atol=1e-7, rtol=0)
    # one mini-batch: the two scopes agree
    torch.testing.assert_close(whiten_advantages(adv, mask, "mini-batch", 1), whiten_advantages(adv, mask, "batch", 1))
    # data-parallel: rank 0 holds rows 0 and 2, rank 1 rows 1 and 3 of the same mini-batches; `reduce` adds the
    # other rank's moments, and each rank's rows come out as in the one-rank batch
    from rljob_worker.algorithms.gae import masked_moments

    rank0, rank1 = adv[[0, 2]], adv[[1, 3]]
    out0 = whiten_advantages(rank0, mask[:2], "batch", 2, lambda m: m + masked_moments(rank1, mask[:2]))
    torch.testing.assert_close(out0[:, 0], torch.tensor([-1.75 / std, 0.25 / std], dtype=torch.float64),
                               atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="batch or mini-batch"):
        whiten_advantages(adv, mask, "rows", 2)


# --------------------------------------------------------------------------- value loss

V = [1.0, 0.0, 2.0]
OLD = [0.0, 0.0, 1.0]
RET = [2.0, 1.0, 0.0]
# t0: V moved up by 1 (clipped to 0.5): (1-2)^2 = 1 < (0.5-2)^2 = 2.25, the clipped error counts -> 1.125
# t1: V = old: both errors 1 -> 0.5, not a clip
# t2: V moved up by 1 (clipped 1.5): (2-0)^2 = 4 > (1.5-0)^2 = 2.25, the unclipped error counts -> 2.0
TOKEN_LOSSES = [1.125, 0.5, 2.0]


def test_value_loss_hand_case_token_mean():
    values = t([V]).requires_grad_()
    loss, metrics = value_loss(values, t([OLD]), t([RET]), t([[1, 1, 1]]), 0.5, LossAggregation.TOKEN_MEAN)
    assert loss.item() == pytest.approx(sum(TOKEN_LOSSES) / 3)
    assert metrics["critic/value_clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["critic/vpred_mean"] == pytest.approx(1.0)
    loss.backward()
    # t0: the clipped branch wins and is flat in V (clamp saturated): no gradient. t1: V - R = -1. t2: V - R = 2.
    close(values.grad, [[0.0, -1 / 3, 2 / 3]])


def test_value_loss_clips_downward_moves_too():
    # V moved down by 1 from old 0 (clipped -0.5). R = -2: (-1+2)^2 = 1 < (-0.5+2)^2 = 2.25 -> clipped counts.
    # R = 1: (-1-1)^2 = 4 > (-0.5-1)^2 = 2.25 -> unclipped counts.
    loss, metrics = value_loss(t([[-1.0, -1.0]]), t([[0.0, 0.0]]), t([[-2.0, 1.0]]), t([[1, 1]]), 0.5,
                               LossAggregation.TOKEN_MEAN)
    assert loss.item() == pytest.approx((1.125 + 2.0) / 2)
    assert metrics["critic/value_clip_fraction"] == pytest.approx(0.5)


def test_value_loss_aggregations():
    values, old, ret = t([[1.0, 0.0], [2.0, 9.0]]), t([[0.0, 0.0], [1.0, 9.0]]), t([[2.0, 1.0], [0.0, 9.0]])
    mask = t([[1, 1], [1, 0]])
    seq, _ = value_loss(values, old, ret, mask, 0.5, LossAggregation.SEQ_MEAN_TOKEN_MEAN)
    assert seq.item() == pytest.approx(((1.125 + 0.5) / 2 + 2.0) / 2)
    tok, _ = value_loss(values, old, ret, mask, 0.5, LossAggregation.TOKEN_MEAN)
    assert tok.item() == pytest.approx((1.125 + 0.5 + 2.0) / 3)
    norm, _ = value_loss(values, old, ret, mask, 0.5, LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM, norm_length=4)
    assert norm.item() == pytest.approx(((1.125 + 0.5) / 4 + 2.0 / 4) / 2)


def test_value_loss_ignores_masked_tokens_even_nan():
    nan = float("nan")
    values = t([[1.0, nan]]).requires_grad_()
    loss, metrics = value_loss(values, t([[0.0, nan]]), t([[2.0, nan]]), t([[1, 0]]), 0.5, LossAggregation.TOKEN_MEAN)
    assert loss.item() == pytest.approx(1.125)
    loss.backward()
    assert torch.isfinite(values.grad).all()
    assert metrics["critic/vpred_mean"] == pytest.approx(1.0)


def test_wide_clip_range_is_the_plain_squared_error():
    loss, metrics = value_loss(t([V]), t([OLD]), t([RET]), t([[1, 1, 1]]), 100.0, LossAggregation.TOKEN_MEAN)
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 4) / 3)
    assert metrics["critic/value_clip_fraction"] == 0


# --------------------------------------------------------------------------- explained variance


def test_explained_variance_hand_cases():
    returns, mask = t([[1.0, 2.0, 3.0, 4.0]]), t([[1, 1, 1, 1]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(t([[2.5] * 4]), returns, mask) == pytest.approx(0.0)
    # error [0, 0, 0, -1]: population variance 0.1875; Var(R) = 1.25 -> 1 - 0.15
    assert explained_variance(t([[1.0, 2.0, 3.0, 5.0]]), returns, mask) == pytest.approx(0.85)
    assert explained_variance(t([[9.0, 2.0, 3.0, 4.0]]), returns, t([[0, 1, 1, 1]])) == pytest.approx(1.0)
    assert explained_variance(t([[0.0, 0.0]]), t([[1.0, 1.0]]), t([[1, 1]])) == 0.0  # nothing to explain


def test_moments_summed_over_row_shards_give_the_whole_batch_result():
    """What data-parallel ranks do: each sums its rows' moments, the sum whitens / scores like one batch."""
    from rljob_worker.algorithms.gae import (
        explained_variance_from_moments,
        explained_variance_moments,
        masked_moments,
        whiten,
    )

    gen = torch.Generator().manual_seed(0)
    values, returns = torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    whole = masked_whiten(values, mask)
    moments = masked_moments(values[:3], mask[:3]) + masked_moments(values[3:], mask[3:])
    close(torch.cat([whiten(values[:3], mask[:3], moments), whiten(values[3:], mask[3:], moments)]), whole, tol=1e-5)
    ev = explained_variance_from_moments(explained_variance_moments(values[:3], returns[:3], mask[:3])
                                         + explained_variance_moments(values[3:], returns[3:], mask[3:]))
    assert ev == pytest.approx(explained_variance(values, returns, mask), abs=1e-9)
