"""Per-token KL estimators between the policy and a reference policy, and KL-in-reward shaping."""

import torch
from rljob_api.enums import KLEstimator

from .aggregation import masked_zero

_LOG_RATIO_CLAMP = 20.0  # low_var_kl: bound on log(ref/pi) before exp
_LOW_VAR_KL_CLAMP = 10.0  # low_var_kl: bound on the per-token estimate


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi.

    logprobs: (B, T) log pi(token); ref_logprobs: (B, T) log ref(token). Returns (B, T).
    With d = logprobs - ref_logprobs:
      - K1: d (unbiased, can be negative per token).
      - K2: 0.5 * d**2 (biased, non-negative).
      - K3: exp(-d) + d - 1 (unbiased, non-negative; Schulman's estimator).
      - LOW_VAR_KL: K3 with -d clamped to [-20, 20] before exp and the result clamped to [-10, 10].
    No masking here: aggregate with the response mask (see aggregation.aggregate_loss).
    """
    estimator = KLEstimator(estimator)
    log_ratio = logprobs - ref_logprobs  # log(pi / ref)
    if estimator is KLEstimator.K1:
        return log_ratio
    if estimator is KLEstimator.K2:
        return 0.5 * log_ratio.square()
    if estimator is KLEstimator.K3:
        return torch.exp(-log_ratio) + log_ratio - 1.0
    if estimator is KLEstimator.LOW_VAR_KL:
        ref_over_pi = torch.clamp(-log_ratio, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
        k3 = torch.exp(ref_over_pi) - ref_over_pi - 1.0
        return torch.clamp(k3, min=-_LOW_VAR_KL_CLAMP, max=_LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def apply_kl_to_rewards(
    token_rewards: torch.Tensor,
    kl: torch.Tensor,
    coef: float,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """KL-in-reward (PPO-style): subtract coef * KL from each response token's reward.

    token_rewards: (B, T); kl: (B, T) from kl_penalty; response_mask: (B, T). Returns (B, T),
    0 outside the response. The KL is treated as a constant (detached): it shapes the reward,
    it is not a loss term. For outcome advantages, sum the result over T to get each sequence's
    reward, which equals reward - coef * sum_t KL_t when the outcome sits on one response token.
    """
    return masked_zero(token_rewards - coef * kl.detach(), response_mask)
