"""KL estimators and KL-in-reward on hand-computed tensors."""

import math

import pytest
import torch
from rljob_api.enums import KLEstimator
from rljob_worker.algorithms import apply_kl_to_rewards, kl_penalty

LN2 = math.log(2.0)
# d = logp - ref = [ln 2, -ln 2]
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
REF = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)


def test_k1_is_the_log_ratio():
    torch.testing.assert_close(
        kl_penalty(LOGP, REF, KLEstimator.K1), torch.tensor([[LN2, -LN2]], dtype=torch.float64)
    )


def test_k2_is_half_the_squared_log_ratio():
    expected = 0.5 * LN2**2
    torch.testing.assert_close(
        kl_penalty(LOGP, REF, KLEstimator.K2), torch.tensor([[expected, expected]], dtype=torch.float64)
    )


def test_k3_by_hand():
    # exp(-d) + d - 1: d = ln2 -> 0.5 + ln2 - 1; d = -ln2 -> 2 - ln2 - 1
    expected = torch.tensor([[LN2 - 0.5, 1.0 - LN2]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(LOGP, REF, KLEstimator.K3), expected)
    torch.testing.assert_close(kl_penalty(LOGP, REF, KLEstimator.LOW_VAR_KL), expected)


@pytest.mark.parametrize("estimator", [KLEstimator.K2, KLEstimator.K3, KLEstimator.LOW_VAR_KL])
def test_non_negative_estimators(estimator):
    torch.manual_seed(0)
    logp, ref = torch.randn(64, 32) * 3, torch.randn(64, 32) * 3
    assert (kl_penalty(logp, ref, estimator) >= 0).all()


@pytest.mark.parametrize("estimator", list(KLEstimator))
def test_equal_policies_give_zero(estimator):
    logp = torch.randn(3, 5)
    assert torch.equal(kl_penalty(logp, logp.clone(), estimator), torch.zeros(3, 5))


@pytest.mark.parametrize("estimator", [KLEstimator.K1, KLEstimator.K3])
def test_unbiased_estimators_average_to_the_exact_kl(estimator):
    # pi = [.5, .25, .25], ref = [.25, .5, .25]: KL(pi || ref) = .5 ln2 - .25 ln2 = .25 ln2
    pi = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    per_token = kl_penalty(pi.log(), ref.log(), estimator)
    assert (pi * per_token).sum().item() == pytest.approx(0.25 * LN2, abs=1e-12)


def test_low_var_kl_clamps_log_ratio_and_result():
    # d = logp - ref
    d = torch.tensor([3.0, -3.0, 30.0, -30.0, -1000.0])
    out = kl_penalty(d, torch.zeros(5), KLEstimator.LOW_VAR_KL)
    # d=3: exp(-3)+2 (unclamped); d=-3: e^3-4 = 16.09 -> 10; d=30: log-ratio clamped to -20,
    # exp(-20)+19 -> 10; d=-30 and -1000: clamped to 20 -> huge -> 10
    expected = torch.tensor([math.exp(-3.0) + 2.0, 10.0, 10.0, 10.0, 10.0])
    torch.testing.assert_close(out, expected)
    assert torch.isinf(kl_penalty(d, torch.zeros(5), KLEstimator.K3)[-1])


def test_low_var_kl_gradient_is_finite_for_extreme_ratios():
    logp = torch.tensor([-1000.0, 1000.0, 0.1], requires_grad=True)
    kl_penalty(logp, torch.zeros(3), KLEstimator.LOW_VAR_KL).sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[:2].tolist() == [0.0, 0.0]  # clamped: no gradient
    assert logp.grad[2].item() == pytest.approx(1 - math.exp(-0.1))


def test_string_estimator_and_unknown_estimator():
    assert torch.equal(kl_penalty(LOGP, REF, "k1"), kl_penalty(LOGP, REF, KLEstimator.K1))
    with pytest.raises(ValueError):
        kl_penalty(LOGP, REF, "k4")


def test_apply_kl_to_rewards_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = apply_kl_to_rewards(rewards, kl, 0.5, mask)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 0.85], [-0.25, 1.75, 0.0]]))
    assert not out.requires_grad  # reward shaping, not a loss term


def test_apply_kl_to_rewards_ignores_masked_nan():
    mask = torch.tensor([[1, 0]])
    out = apply_kl_to_rewards(
        torch.tensor([[1.0, float("nan")]]), torch.tensor([[0.2, float("inf")]]), 1.0, mask
    )
    torch.testing.assert_close(out, torch.tensor([[0.8, 0.0]]))
