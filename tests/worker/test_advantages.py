"""Outcome advantages on hand-computed groups."""

import math

import pytest
import torch
from rljob_api.enums import AdvantageEstimator
from rljob_worker.algorithms import (
    broadcast_to_tokens,
    compute_outcome_advantages,
    compute_token_reward_advantages,
)

ALL_ESTIMATORS = [e for e in AdvantageEstimator if e is not AdvantageEstimator.GAE]  # gae: test_gae.py


def _adv(rewards, group_size, estimator, **kw):
    adv, _ = compute_outcome_advantages(
        torch.tensor(rewards, dtype=torch.float64), group_size, estimator, **kw
    )
    return adv


def test_grpo_std_normalised_group_of_four_gives_plus_minus_one():
    adv = _adv([1.0, 0.0, 0.0, 1.0], 4, AdvantageEstimator.GRPO, eps=0.0)
    # mean 0.5, population std 0.5
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]


def test_grpo_eps_is_added_to_std():
    adv = _adv([1.0, 0.0, 0.0, 1.0], 4, AdvantageEstimator.GRPO, eps=1e-6)
    expected = 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(
        adv, torch.tensor([expected, -expected, -expected, expected], dtype=torch.float64)
    )


def test_grpo_skewed_group_uses_population_std():
    # mean 0.5; population std sqrt((1.5^2 + 3 * 0.5^2) / 4) = sqrt(3) / 2
    adv = _adv([2.0, 0.0, 0.0, 0.0], 4, AdvantageEstimator.GRPO, eps=0.0)
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(adv, torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3], dtype=torch.float64))


def test_dr_grpo_without_std_is_mean_centred_only():
    adv = _adv([1.0, 0.0, 0.0, 0.0, 4.0, 2.0], 2, AdvantageEstimator.GRPO, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0], dtype=torch.float64))


def test_groups_are_contiguous_and_independent():
    adv = _adv([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0], 4, AdvantageEstimator.GRPO, eps=0.0)
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_rloo_by_hand():
    adv = _adv([1.0, 0.0, 0.0, 1.0], 4, AdvantageEstimator.RLOO)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3], dtype=torch.float64))
    # r_i - mean(others): 3 - 9/3, 1 - 11/3, 2 - 10/3, 6 - 6/3
    adv = _adv([3.0, 1.0, 2.0, 6.0], 4, AdvantageEstimator.RLOO)
    torch.testing.assert_close(adv, torch.tensor([0.0, -8 / 3, -4 / 3, 4.0], dtype=torch.float64))


def test_rloo_ignores_norm_by_std():
    a = _adv([3.0, 1.0, 2.0, 6.0], 4, AdvantageEstimator.RLOO, norm_by_std=True)
    b = _adv([3.0, 1.0, 2.0, 6.0], 4, AdvantageEstimator.RLOO, norm_by_std=False)
    assert torch.equal(a, b)


def test_rloo_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="group_size >= 2"):
        _adv([1.0, 0.0], 1, AdvantageEstimator.RLOO)


def test_reinforce_plus_plus_whitens_raw_rewards_over_the_batch():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # batch mean 0.75, population std sqrt(0.75 * 0.25) = sqrt(3) / 4; no group baseline,
    # so the all-ones group keeps a positive advantage
    adv = _adv(rewards, 4, AdvantageEstimator.REINFORCE_PLUS_PLUS, eps=0.0)
    hi, lo = 1 / math.sqrt(3.0), -math.sqrt(3.0)
    torch.testing.assert_close(adv, torch.tensor([hi, lo, lo, hi, hi, hi, hi, hi], dtype=torch.float64))
    centred = _adv(rewards, 4, AdvantageEstimator.REINFORCE_PLUS_PLUS, norm_by_std=False)
    torch.testing.assert_close(centred, torch.tensor(rewards, dtype=torch.float64) - 0.75)


@pytest.mark.parametrize("estimator", ALL_ESTIMATORS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_identical_rewards_give_zero_advantages_without_nan(estimator, norm_by_std):
    adv, metrics = compute_outcome_advantages(torch.full((8,), 0.7), 4, estimator, norm_by_std=norm_by_std)
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv, torch.zeros(8), atol=1e-6)
    assert metrics["zero_std_group_fraction"] == 1.0


@pytest.mark.parametrize("estimator", ALL_ESTIMATORS)
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_identical_rewards_are_exactly_zero_despite_rounding(estimator, eps):
    # in float32 the mean of eight 0.1s is not 0.1, so r - mean is ~7e-9 and so is the std
    rewards = torch.full((16,), 0.1)
    assert rewards.view(2, 8).mean(-1)[0] != rewards[0]
    adv, _ = compute_outcome_advantages(rewards, 8, estimator, eps=eps)
    assert torch.equal(adv, torch.zeros(16))


@pytest.mark.parametrize("estimator", ALL_ESTIMATORS)
def test_permuting_groups_permutes_advantages(estimator):
    torch.manual_seed(0)
    group_size, groups = 4, 5
    rewards = torch.rand(groups * group_size)
    perm = torch.randperm(groups)
    permuted = rewards.view(groups, group_size)[perm].reshape(-1)
    adv, _ = compute_outcome_advantages(rewards, group_size, estimator)
    adv_p, _ = compute_outcome_advantages(permuted, group_size, estimator)
    torch.testing.assert_close(adv_p, adv.view(groups, group_size)[perm].reshape(-1))


@pytest.mark.parametrize("estimator", [AdvantageEstimator.GRPO, AdvantageEstimator.RLOO])
def test_group_baselines_sum_to_zero_in_each_group(estimator):
    torch.manual_seed(1)
    adv, _ = compute_outcome_advantages(torch.rand(12), 3, estimator)
    torch.testing.assert_close(adv.view(4, 3).sum(-1), torch.zeros(4), atol=1e-6, rtol=0)


def test_metrics_are_python_floats_with_expected_values():
    _, metrics = compute_outcome_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4, AdvantageEstimator.GRPO, eps=0.0
    )
    assert all(type(v) is float for v in metrics.values())
    assert metrics["reward_mean"] == 0.75
    assert metrics["zero_std_group_fraction"] == 0.5
    assert metrics["advantage_max"] == 1.0 and metrics["advantage_min"] == -1.0


def test_integer_rewards_and_string_estimator_are_accepted():
    adv, _ = compute_outcome_advantages(torch.tensor([1, 0, 0, 1]), 4, "grpo", eps=0.0)
    assert adv.dtype == torch.float32
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]


@pytest.mark.parametrize("rewards,group_size", [([1.0, 0.0, 1.0], 2), ([1.0, 0.0], 0), ([], 2)])
def test_bad_shapes_are_rejected(rewards, group_size):
    with pytest.raises(ValueError):
        compute_outcome_advantages(torch.tensor(rewards), group_size, AdvantageEstimator.GRPO)


def test_advantages_carry_no_gradient():
    rewards = torch.tensor([1.0, 0.0], requires_grad=True)
    adv, _ = compute_outcome_advantages(rewards, 2, AdvantageEstimator.GRPO)
    assert not adv.requires_grad


def test_broadcast_to_tokens_fills_response_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_gae_is_not_an_outcome_estimator():
    with pytest.raises(ValueError, match="algorithms.gae"):
        compute_outcome_advantages(torch.tensor([1.0, 0.0]), 2, AdvantageEstimator.GAE)


def test_reinforce_plus_plus_whitens_over_tokens_by_hand():
    # rewards [1, 0], lengths [1, 3]: token mean 1/4, token variance (0.75^2 + 3 * 0.25^2) / 4 = 3/16
    adv, _ = compute_outcome_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2,
                                        AdvantageEstimator.REINFORCE_PLUS_PLUS, eps=0.0,
                                        response_lengths=torch.tensor([1, 3]))
    torch.testing.assert_close(adv, torch.tensor([math.sqrt(3.0), -1 / math.sqrt(3.0)], dtype=torch.float64))
    assert adv.tolist() == pytest.approx([1.732, -0.577], abs=1e-3)
    # equal lengths: the response-level whitening of before
    same, _ = compute_outcome_advantages(torch.tensor([1.0, 0.0]), 2, AdvantageEstimator.REINFORCE_PLUS_PLUS,
                                         eps=0.0, response_lengths=torch.tensor([3, 3]))
    assert same.tolist() == pytest.approx([1.0, -1.0])


def test_kl_in_reward_enters_the_grpo_score_before_group_normalisation():
    # one group of 2, rewards [1, 1] on the last response token, k1 KL summing to [2, 0], coef 0.1:
    # scores [0.8, 1.0] -> group-normalised [-1, +1] (subtracting after normalisation gave [-0.2, 0])
    from rljob_worker.algorithms import apply_kl_to_rewards, compute_token_reward_advantages

    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    outcome = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    kl = torch.tensor([[1.5, 0.5, 9.0], [0.5, -1.0, 0.5]])
    token_rewards = apply_kl_to_rewards(outcome, kl, 0.1, mask)
    adv, metrics = compute_token_reward_advantages(token_rewards, mask, 2, AdvantageEstimator.GRPO, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]]))
    assert metrics["reward_mean"] == pytest.approx(0.9)


def test_token_reward_reinforce_plus_plus_without_kl_equals_the_token_weighted_outcome():
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    lengths = mask.sum(-1)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    outcome = torch.zeros(4, 4)
    outcome[torch.arange(4), lengths - 1] = rewards
    adv, _ = compute_token_reward_advantages(outcome, mask, 2, AdvantageEstimator.REINFORCE_PLUS_PLUS)
    seq, _ = compute_outcome_advantages(rewards, 2, AdvantageEstimator.REINFORCE_PLUS_PLUS, response_lengths=lengths)
    torch.testing.assert_close(adv, broadcast_to_tokens(seq, mask))


def test_token_reward_reinforce_plus_plus_returns_by_hand():
    # token rewards [[1, -1]] and [[0, 2]]: returns [[0, -1], [2, 2]]; token mean 0.75,
    # population std sqrt((0.5625 + 3.0625 + 1.5625 * 2) / 4) = sqrt(6.75 / 4)
    from rljob_worker.algorithms import compute_token_reward_advantages

    mask = torch.ones(2, 2)
    adv, _ = compute_token_reward_advantages(torch.tensor([[1.0, -1.0], [0.0, 2.0]]), mask, 2,
                                             AdvantageEstimator.REINFORCE_PLUS_PLUS, eps=0.0)
    std = math.sqrt(6.75 / 4)
    expected = (torch.tensor([[0.0, -1.0], [2.0, 2.0]]) - 0.75) / std
    torch.testing.assert_close(adv, expected)
