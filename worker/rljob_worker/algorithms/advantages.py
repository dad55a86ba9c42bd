"""Outcome advantages for group-sampled responses (GRPO, Dr.GRPO, RLOO, REINFORCE++).

The batch holds N = G * group_size responses; the group_size responses of one prompt are
contiguous (rows [g * group_size, (g + 1) * group_size) belong to prompt g). Standard
deviations are population ones (unbiased=False): a group of rewards [1, 0, 0, 1] has std 0.5
and gets advantages of +-1, and a group of 2 is not inflated by a 1 / (n - 1) correction.
"""

import torch
from rljob_api.enums import AdvantageEstimator

from .aggregation import masked_zero


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) -> (G, group_size), checking that N is a multiple of group_size."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def _scale(centred: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """centred / (std + eps), leaving entries unscaled where the divisor is 0 (eps = 0, constant rewards)."""
    denom = std + eps
    return torch.where(denom > 0, centred / denom, centred)


def compute_outcome_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: AdvantageEstimator,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One scalar advantage per response from its outcome reward.

    rewards: (N,) scalar reward per response, N = G * group_size, groups contiguous.
    estimator:
      - GRPO: (r - group mean) / (group std + eps) when norm_by_std, else r - group mean
        (Dr.GRPO).
      - RLOO: r_i - mean of the other group_size - 1 rewards of its group
        (= group_size / (group_size - 1) * (r_i - group mean)); needs group_size >= 2; never
        divided by a std.
      - REINFORCE_PLUS_PLUS: no group baseline; the raw rewards are whitened over the whole
        batch, (r - batch mean) / (batch std + eps), or only centred when norm_by_std is False.
    A group (for REINFORCE_PLUS_PLUS, the batch) whose rewards are all equal gets exactly 0,
    also with eps = 0 and when float rounding puts the mean a hair off the common value.
    Returns (advantages (N,) detached, metrics) with metrics reward_mean, reward_std,
    advantage_mean, advantage_std, advantage_min, advantage_max and zero_std_group_fraction
    (share of groups whose rewards are all equal: they carry no GRPO/RLOO learning signal).
    """
    estimator = AdvantageEstimator(estimator)
    if estimator is AdvantageEstimator.GAE:
        raise ValueError("gae needs per-token values from a critic: use rljob_worker.algorithms.gae.compute_gae")
    rewards = rewards.detach()
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = _grouped(rewards, group_size)  # (G, group_size)
    group_mean = grouped.mean(dim=-1, keepdim=True)  # (G, 1)
    group_std = grouped.std(dim=-1, unbiased=False, keepdim=True)  # (G, 1)
    # Rows whose rewards are all equal get exactly 0, even where rounding makes mean != reward.
    constant_group = grouped.amax(dim=-1, keepdim=True) == grouped.amin(dim=-1, keepdim=True)  # (G, 1)

    if estimator is AdvantageEstimator.GRPO:
        advantages = _scale(grouped - group_mean, group_std, eps) if norm_by_std else grouped - group_mean
        advantages = torch.where(constant_group, 0.0, advantages)
    elif estimator is AdvantageEstimator.RLOO:
        if group_size < 2:
            raise ValueError("RLOO needs group_size >= 2")
        others_mean = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
        advantages = torch.where(constant_group, 0.0, grouped - others_mean)
    elif estimator is AdvantageEstimator.REINFORCE_PLUS_PLUS:
        centred = grouped - rewards.mean()
        advantages = _scale(centred, rewards.std(unbiased=False), eps) if norm_by_std else centred
        if rewards.amax() == rewards.amin():
            advantages = torch.zeros_like(advantages)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")

    advantages = advantages.reshape(-1)  # (N,)
    metrics = {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "advantage_mean": advantages.mean().item(),
        "advantage_std": advantages.std(unbiased=False).item(),
        "advantage_min": advantages.min().item(),
        "advantage_max": advantages.max().item(),
        "zero_std_group_fraction": constant_group.float().mean().item(),
    }
    return advantages, metrics


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Give every response token its sequence's advantage.

    advantages: (N,); response_mask: (N, T). Returns (N, T) with advantages[i] at the response
    tokens of row i and 0 elsewhere.
    """
    per_token = advantages.unsqueeze(-1).expand(response_mask.shape)
    return masked_zero(per_token, response_mask)
