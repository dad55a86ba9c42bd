"""Clipped policy loss (PPO/GRPO, clip-higher, dual clip, GSPO) and the combined GRPO loss."""

import dataclasses
import math

import pytest
import torch
from rljob_api.enums import ImportanceLevel, KLEstimator, KLPlacement, LossAggregation
from rljob_worker.algorithms import LossConfig, entropy_bonus, grpo_loss, policy_loss

TOKEN, SEQUENCE = ImportanceLevel.TOKEN, ImportanceLevel.SEQUENCE
ALL_AGGREGATIONS = list(LossAggregation)
ALL_IMPORTANCE = list(ImportanceLevel)


def _run(logp, old, adv, mask, **kw):
    """policy_loss with a leaf logp; returns (loss, metrics, d loss / d logp)."""
    logp = logp.clone().requires_grad_(True)
    kw = {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "dual_clip_c": None,
        "aggregation": LossAggregation.TOKEN_MEAN,
    } | kw
    loss, metrics = policy_loss(logp, old, adv, mask, **kw)
    loss.backward()
    return loss, metrics, logp.grad


def _ratios(*r):
    return torch.tensor([list(r)], dtype=torch.float64).log()


def test_ppo_clip_higher_by_hand():
    # ratios and advantages; clip range (0.8, 1.28)
    logp, old = _ratios(1.5, 0.5, 1.0, 1.1, 0.5), torch.zeros(1, 5, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 5)
    loss, metrics, grad = _run(logp, old, adv, mask, clip_high=0.28)
    # per-token max(-A r, -A clip(r)): [-1.28 (clipped), -0.5, 1.0, 1.1, 0.8 (clipped)]
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.0 + 1.1 + 0.8) / 5)
    # d/dlogp of -A r is -A r where unclipped, 0 where the clip is active
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 1.0, 1.1, 0.0]], dtype=torch.float64) / 5)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["dual_clip_fraction"] == 0.0
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(4.6 / 5)
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.0, 1.1, 0.5)]
    assert metrics["approx_kl"] == pytest.approx(sum(k3) / 5)
    assert metrics["pg_loss"] == pytest.approx(loss.item())
    assert all(type(v) is float for v in metrics.values())


def test_ratio_above_clip_high_with_positive_advantage_has_zero_gradient():
    logp, old = _ratios(1.3, 1.3), torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    loss, metrics, grad = _run(logp, old, adv, torch.ones(1, 2), clip_high=0.28)
    assert loss.item() == pytest.approx(-2 * 1.28)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert metrics["clip_fraction"] == 1.0
    # the same ratio inside a wider clip-higher range keeps its gradient
    _, metrics, grad = _run(logp, old, adv, torch.ones(1, 2), clip_high=0.5)
    torch.testing.assert_close(grad, torch.full((1, 2), -2 * 1.3 / 2, dtype=torch.float64))
    assert metrics["clip_fraction"] == 0.0


def test_dual_clip_by_hand():
    logp, old = _ratios(5.0, 2.0, 5.0), torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    loss, metrics, grad = _run(logp, old, adv, mask, dual_clip_c=3.0)
    # token 0: max(5, 1.2) = 5 capped at -A c = 3; token 1: 2 < 3 stays; token 2: A > 0, clipped at -1.2
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=torch.float64) / 3)
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    loss_plain, _, _ = _run(logp, old, adv, mask, dual_clip_c=None)
    assert loss_plain.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(c):
    with pytest.raises(ValueError):
        _run(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), dual_clip_c=c)


def test_negative_clip_is_rejected():
    with pytest.raises(ValueError):
        _run(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_low=-0.1)


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("deltas", [(0.1, -0.3), (0.5, -0.5), (0.0, 0.0)])
def test_gspo_equals_token_level_when_ratios_are_constant_per_sequence(aggregation, deltas):
    old = torch.randn(2, 4, dtype=torch.float64)
    logp = old + torch.tensor(deltas, dtype=torch.float64).unsqueeze(-1)
    adv = torch.tensor([[1.0] * 4, [-2.0] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tok = _run(logp, old, adv, mask, aggregation=aggregation, importance=TOKEN, dual_clip_c=3.0)
    seq = _run(logp, old, adv, mask, aggregation=aggregation, importance=SEQUENCE, dual_clip_c=3.0)
    torch.testing.assert_close(seq[0], tok[0])
    torch.testing.assert_close(seq[2], tok[2])
    for key in ("clip_fraction", "ratio_mean", "ratio_max", "ratio_min", "approx_kl"):
        assert seq[1][key] == pytest.approx(tok[1][key])


def test_gspo_gradient_reaches_every_response_token():
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[0.1, -0.1, 0.0, 7.0]], dtype=torch.float64)  # last token is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    adv = torch.ones(1, 4, dtype=torch.float64)
    loss, metrics, grad = _run(logp, old, adv, mask, importance=SEQUENCE)
    # mean log-ratio 0 -> s = 1 at every token; token-mean of -A s over 3 tokens
    assert loss.item() == pytest.approx(-1.0)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, -1 / 3, -1 / 3, 0.0]], dtype=torch.float64))
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["ratio_max"] == pytest.approx(1.0)
    # token level sees different per-token ratios instead
    _, tok_metrics, tok_grad = _run(logp, old, adv, mask, importance=TOKEN)
    assert tok_metrics["ratio_max"] == pytest.approx(math.exp(0.1))
    assert not torch.allclose(tok_grad, grad)


def test_gspo_token_form_weights_each_token_by_its_own_advantage():
    # GSPO-token: d loss / d logp_t = -A_t * s / N; the plain sequence form would instead give
    # every token the sequence's mean advantage
    logp = torch.tensor([[0.2, -0.2]], dtype=torch.float64)
    old, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2)
    adv = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    loss, _, grad = _run(logp, old, adv, mask, importance=SEQUENCE)
    assert loss.item() == pytest.approx(-2.0)  # s = exp(0) = 1
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -1.5]], dtype=torch.float64))


def test_gspo_clips_whole_sequences():
    # per-token log-ratios 1.0 and 0.0: the second token alone is unclipped, but the sequence
    # ratio exp(0.5) = 1.65 > 1.2, so both tokens are clipped for a positive advantage
    logp = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    old, adv, mask = (
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        torch.ones(1, 2),
    )
    loss, metrics, grad = _run(logp, old, adv, mask, importance=SEQUENCE)
    assert loss.item() == pytest.approx(-1.2)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert metrics["clip_fraction"] == 1.0
    assert metrics["ratio_min"] == pytest.approx(math.exp(0.5))
    _, tok_metrics, _ = _run(logp, old, adv, mask, importance=TOKEN)
    assert tok_metrics["clip_fraction"] == 0.5


def _random_batch(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 6, generator=g, dtype=dtype) * 2
    old = logp + 0.4 * torch.randn(4, 6, generator=g, dtype=dtype)
    adv = torch.randn(4, 6, generator=g, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    return logp, old, adv, mask


def _scramble_masked(x, mask, values):
    """Copy of x with masked-out positions overwritten by values (cycled)."""
    x = x.clone()
    n = int((mask == 0).sum())
    x[mask == 0] = torch.tensor(values, dtype=x.dtype).repeat(n // len(values) + 1)[:n]
    return x


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("importance", ALL_IMPORTANCE)
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_masked_positions_never_change_loss_gradients_or_metrics(aggregation, importance, dual_clip_c):
    logp, old, adv, mask = _random_batch(0)
    junk = [float("nan"), float("inf"), -float("inf"), 50.0, -80.0, 3.0]
    kw = {"aggregation": aggregation, "importance": importance, "dual_clip_c": dual_clip_c, "clip_high": 0.28}
    ref = _run(logp, old, adv, mask, **kw)
    other = _run(
        _scramble_masked(logp, mask, junk),
        _scramble_masked(old, mask, junk[::-1]),
        _scramble_masked(adv, mask, junk[2:] + junk[:2]),
        mask,
        **kw,
    )
    assert torch.isfinite(ref[0])
    assert ref[0].item() == other[0].item()
    assert torch.equal(ref[2], other[2])
    assert ref[1] == other[1]
    assert torch.equal(ref[2][mask == 0], torch.zeros(int((mask == 0).sum()), dtype=ref[2].dtype))


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("importance", ALL_IMPORTANCE)
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_zero_advantages_give_zero_policy_gradient(aggregation, importance, dual_clip_c):
    logp, old, _, mask = _random_batch(1)
    loss, _, grad = _run(
        logp,
        old,
        torch.zeros_like(logp),
        mask,
        aggregation=aggregation,
        importance=importance,
        dual_clip_c=dual_clip_c,
    )
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_empty_mask_gives_neutral_metrics():
    logp, old, adv, _ = _random_batch(2)
    loss, metrics, grad = _run(logp, old, adv, torch.zeros(4, 6))
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert metrics["ratio_mean"] == metrics["ratio_max"] == metrics["ratio_min"] == 1.0
    assert metrics["clip_fraction"] == metrics["approx_kl"] == 0.0


def test_old_logprobs_and_advantages_receive_no_gradient():
    logp, old, adv, mask = _random_batch(3)
    old.requires_grad_(True)
    adv.requires_grad_(True)
    _, _, _ = _run(logp, old, adv, mask)
    assert old.grad is None and adv.grad is None


# --- entropy bonus and the combined GRPO loss ---------------------------------------------------


def test_entropy_bonus_by_hand():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = entropy_bonus(entropy, mask, LossAggregation.TOKEN_MEAN, coef=0.1)
    assert metrics == {"entropy": 2.0}
    assert loss.item() == pytest.approx(-0.2)
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]]))


def _grpo_inputs():
    logp = torch.zeros(2, 2, requires_grad=True)
    old = torch.zeros(2, 2)  # ratio 1 everywhere
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])  # k1 = logp - ref = [[1, 1], [0, 0]]
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    return logp, old, adv, torch.ones(2, 2), ref, entropy


def test_grpo_loss_combines_terms_by_hand():
    logp, old, adv, mask, ref, entropy = _grpo_inputs()
    config = LossConfig(kl_coef=0.1, kl_estimator=KLEstimator.K1, entropy_coef=0.01)
    loss, metrics = grpo_loss(logp, old, adv, mask, config, ref_logprobs=ref, entropy=entropy)
    # pg 0 (advantages cancel), kl token-mean 0.5, entropy token-mean 2.5
    assert loss.item() == pytest.approx(0.1 * 0.5 - 0.01 * 2.5)
    assert metrics["pg_loss"] == pytest.approx(0.0)
    assert metrics["kl"] == pytest.approx(0.5)
    assert metrics["entropy"] == pytest.approx(2.5)
    assert metrics["loss"] == pytest.approx(loss.item())
    loss.backward()
    # pg: -A r / 4; kl (k1): +0.1 / 4 per token
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]) + 0.025)
    torch.testing.assert_close(entropy.grad, torch.full((2, 2), -0.01 / 4))


def test_grpo_loss_kl_in_reward_only_reports_kl():
    logp, old, adv, mask, ref, entropy = _grpo_inputs()
    config = LossConfig(kl_coef=0.1, kl_estimator="k1", kl_placement=KLPlacement.REWARD, entropy_coef=0.0)
    loss, metrics = grpo_loss(logp, old, adv, mask, config, ref_logprobs=ref, entropy=entropy)
    assert loss.item() == pytest.approx(0.0)
    assert metrics["kl"] == pytest.approx(0.5)
    assert metrics["entropy"] == pytest.approx(2.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))


def test_grpo_loss_without_ref_or_entropy_is_the_policy_loss():
    logp, old, adv, mask = _random_batch(4)
    config = LossConfig(clip_high=0.28, aggregation=LossAggregation.SEQ_MEAN_TOKEN_MEAN)
    loss, metrics = grpo_loss(logp, old, adv, mask, config)
    expected, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip_c=None,
        aggregation=LossAggregation.SEQ_MEAN_TOKEN_MEAN,
    )
    assert loss.item() == expected.item()
    assert "kl" not in metrics and "entropy" not in metrics


def test_grpo_loss_needs_ref_when_kl_is_in_the_loss():
    logp, old, adv, mask, _, _ = _grpo_inputs()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, old, adv, mask, LossConfig(kl_coef=0.1))


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("importance", ALL_IMPORTANCE)
@pytest.mark.parametrize("estimator", list(KLEstimator))
def test_grpo_loss_masked_positions_never_matter(aggregation, importance, estimator):
    logp, old, adv, mask = _random_batch(5)
    g = torch.Generator().manual_seed(6)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    entropy = torch.rand(logp.shape, generator=g, dtype=logp.dtype)
    config = LossConfig(
        clip_high=0.28,
        dual_clip_c=3.0,
        kl_coef=0.05,
        kl_estimator=estimator,
        entropy_coef=0.01,
        aggregation=aggregation,
        importance=importance,
        norm_length=8,
    )
    junk = [float("nan"), float("inf"), -float("inf"), 60.0, -90.0]

    def run(lp, o, a, r, e):
        lp, e = lp.clone().requires_grad_(True), e.clone().requires_grad_(True)
        loss, metrics = grpo_loss(lp, o, a, mask, config, ref_logprobs=r, entropy=e)
        loss.backward()
        return loss.item(), metrics, lp.grad, e.grad

    clean = run(logp, old, adv, ref, entropy)
    dirty = run(
        *(
            _scramble_masked(x, mask, junk[i:] + junk[:i])
            for i, x in enumerate((logp, old, adv, ref, entropy))
        )
    )
    assert math.isfinite(clean[0])
    assert clean[0] == dirty[0]
    assert clean[1] == dirty[1]
    assert torch.equal(clean[2], dirty[2]) and torch.equal(clean[3], dirty[3])


def test_loss_config_accepts_strings_and_is_frozen():
    config = LossConfig(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip_c=3.0,
        kl_coef=0.001,
        kl_estimator="k3",
        kl_placement="reward",
        entropy_coef=0.0,
        aggregation="seq-mean-token-sum-norm",
        importance="sequence",
        norm_length=1024,
    )
    assert config.kl_estimator is KLEstimator.K3
    assert config.kl_placement is KLPlacement.REWARD
    assert config.aggregation is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM
    assert config.importance is ImportanceLevel.SEQUENCE
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kl_coef = 1.0
    with pytest.raises(ValueError):
        LossConfig(aggregation="sum")


@pytest.mark.parametrize(
    "kwargs", [{"clip_low": -0.1}, {"clip_high": -0.1}, {"dual_clip_c": 1.0}, {"norm_length": 0}]
)
def test_loss_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        LossConfig(**kwargs)
