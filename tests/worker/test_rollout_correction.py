"""Rollout/training mismatch correction on hand-computed log-probs."""

import math

import pytest
import torch
from rljob_api.enums import LossAggregation
from rljob_worker.algorithms import policy_loss, rollout_correction_weights

# row 0: token ratios 3, 1, 0.5 (log-ratio mean log(1.5) / 3: geometric mean 1.5^(1/3), inside [1/2, 2])
# row 1: ratios 4, 4 (geometric mean 4: outside); row 2: ratio 0.25 then a masked NaN (0.25: outside)
TRAIN = torch.log(torch.tensor([[3.0, 1.0, 0.5], [4.0, 4.0, 1.0], [0.25, 1.0, 1.0]], dtype=torch.float64))
ROLLOUT = torch.zeros(3, 3, dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])


def test_token_truncation_by_hand():
    w, m = rollout_correction_weights(TRAIN, ROLLOUT, MASK, threshold=2.0, mask_threshold=2.0, token_truncation=True,
                                      sequence_masking=False)
    expected = torch.tensor([[2.0, 1.0, 0.5], [2.0, 2.0, 0.0], [0.25, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert m["weight_mean"] == pytest.approx((2 + 1 + 0.5 + 2 + 2 + 0.25) / 6)
    assert m["clipped_frac"] == pytest.approx(3 / 6)  # 3, 4, 4 exceed C = 2
    assert m["masked_frac"] == pytest.approx(2 / 3)  # reported even with masking off


def test_sequence_masking_by_hand():
    w, m = rollout_correction_weights(TRAIN, ROLLOUT, MASK, threshold=2.0, mask_threshold=2.0, token_truncation=False,
                                      sequence_masking=True)
    expected = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert m["masked_frac"] == pytest.approx(2 / 3)
    assert m["weight_mean"] == pytest.approx(3 / 6)


def test_both_and_band_edges():
    w, _ = rollout_correction_weights(TRAIN, ROLLOUT, MASK, threshold=2.0, mask_threshold=2.0, token_truncation=True,
                                      sequence_masking=True)
    torch.testing.assert_close(w[0], torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64))
    assert w[1:].abs().sum() == 0
    # exactly at the band's edges (ratios 2 and 1/2) a row is kept; D = 4 keeps row 1 and row 2
    edge = torch.log(torch.tensor([[2.0], [0.5]], dtype=torch.float64))
    w, m = rollout_correction_weights(edge, torch.zeros(2, 1, dtype=torch.float64), torch.ones(2, 1),
                                      threshold=2.0, mask_threshold=2.0, token_truncation=False, sequence_masking=True)
    assert w.flatten().tolist() == [1.0, 1.0] and m["masked_frac"] == 0.0
    w, _ = rollout_correction_weights(TRAIN, ROLLOUT, MASK, threshold=4.0, mask_threshold=4.0, token_truncation=True,
                                      sequence_masking=True)
    assert w[1, :2].tolist() == [4.0, 4.0] and w[2, 0].item() == 0.25


def test_masked_positions_and_nan_never_matter():
    train = TRAIN.clone()
    train[2, 1:] = float("nan")
    w, m = rollout_correction_weights(train, ROLLOUT, MASK, threshold=2.0, mask_threshold=2.0, token_truncation=True,
                                      sequence_masking=True)
    assert torch.isfinite(w).all() and w[2].abs().sum() == 0
    assert all(math.isfinite(v) for v in m.values())


def test_empty_mask_and_bad_threshold():
    w, m = rollout_correction_weights(TRAIN, ROLLOUT, torch.zeros(3, 3), threshold=2.0, mask_threshold=2.0, token_truncation=True,
                                      sequence_masking=True)
    assert w.abs().sum() == 0 and m == {"weight_mean": 1.0, "clipped_frac": 0.0, "masked_frac": 0.0}
    with pytest.raises(ValueError, match="threshold"):
        rollout_correction_weights(TRAIN, ROLLOUT, MASK, threshold=1.0, token_truncation=True, sequence_masking=False)
    with pytest.raises(ValueError, match="mask_threshold"):
        rollout_correction_weights(TRAIN, ROLLOUT, MASK, threshold=2.0, mask_threshold=1.0, token_truncation=False,
                                   sequence_masking=True)


def test_the_default_masking_band_fires_on_a_systematic_drift_and_not_on_noise():
    """The spec's defaults (C = 2 for truncation, D = 1.01 for masking), 100 response tokens per row:
    row 0 drifts +0.02 nats on every token (geometric mean e^0.02 = 1.0202 > 1.01: masked), row 1 -0.02
    (1/1.0202 < 1/1.01: masked), row 2 +0.005 (1.0050: kept), row 3 alternates +-0.05 (mean 0: kept).
    With the band tied to C = 2, none of them would be masked (that needs |mean| > ln 2 = 0.69)."""
    from rljob_api.models import RolloutCorrectionSpec

    spec = RolloutCorrectionSpec(sequenceMasking=True)
    assert spec.threshold == 2.0 and spec.sequence_masking_threshold == 1.01
    T = 100
    drift = torch.tensor([0.02, -0.02, 0.005, 0.0], dtype=torch.float64)[:, None].expand(4, T).clone()
    drift[3] = torch.tensor([0.05, -0.05], dtype=torch.float64).repeat(T // 2)
    rollout = torch.full((4, T), -1.0, dtype=torch.float64)
    w, m = rollout_correction_weights(rollout + drift, rollout, torch.ones(4, T), threshold=spec.threshold,
                                      mask_threshold=spec.sequence_masking_threshold, token_truncation=False,
                                      sequence_masking=True)
    assert w.sum(-1).tolist() == [0.0, 0.0, T, T]
    assert m["masked_frac"] == 0.5
    _, tied = rollout_correction_weights(rollout + drift, rollout, torch.ones(4, T), threshold=2.0,
                                         mask_threshold=2.0, token_truncation=False, sequence_masking=True)
    assert tied["masked_frac"] == 0.0


def test_weights_scale_each_tokens_policy_gradient():
    # ratio 1 (on-policy update), advantages 1: per-token loss -1, gradient -w / N per token
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([[2.0, 0.5, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss(logp, logp.detach(), torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3),
                          clip_low=0.2, clip_high=0.2, dual_clip_c=None, aggregation=LossAggregation.TOKEN_MEAN,
                          token_weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-2.5 / 3)  # a masked row's tokens still count in the normaliser
    torch.testing.assert_close(logp.grad, -weights / 3)
