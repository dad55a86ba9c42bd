"""Outcome advantages for group-sampled responses (GRPO, Dr.GRPO, RLOO, REINFORCE++).

The batch holds N = G * group_size responses; the group_size responses of one prompt are
contiguous (rows [g * group_size, (g + 1) * group_size) belong to prompt g). Standard
deviations are population ones (unbiased=False): a group of rewards [1, 0, 0, 1] has std 0.5
and gets advantages of +-1, and a group of 2 is not inflated by a 1 / (n - 1) correction.
(verl's GRPO divides by Bessel's std instead, so its advantages are ours times
sqrt((G - 1) / G) for a group of G.)

REINFORCE++ (arXiv 2501.03262, and verl) whitens over response *tokens*: a response of 3 tokens
weighs 3 times one of 1 token in the batch mean and std.
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
    response_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One scalar advantage per response from its outcome reward.

    rewards: (N,) scalar reward per response, N = G * group_size, groups contiguous.
    estimator:
      - GRPO: (r - group mean) / (group std + eps) when norm_by_std, else r - group mean
        (Dr.GRPO).
      - RLOO: r_i - mean of the other group_size - 1 rewards of its group
        (= group_size / (group_size - 1) * (r_i - group mean)); needs group_size >= 2; never
        divided by a std.
      - REINFORCE_PLUS_PLUS: no group baseline; the raw rewards are whitened over all response
        tokens of the batch, (r - token mean) / (token std + eps), or only centred when
        norm_by_std is False: each response's reward counts once per token (its return at every
        token, gamma = 1), so with response_lengths (N,) the mean and std are weighted by them.
        response_lengths None counts every response once (equal lengths).
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
        if response_lengths is None:
            weights = torch.ones_like(rewards)
        else:
            weights = response_lengths.detach().to(rewards.dtype).reshape(-1)
            if weights.shape != rewards.shape:
                raise ValueError(f"response_lengths {tuple(weights.shape)} does not match rewards {tuple(rewards.shape)}")
        mean = (weights * rewards).sum() / weights.sum().clamp(min=1)
        std = ((weights * (rewards - mean).square()).sum() / weights.sum().clamp(min=1)).sqrt()
        centred = grouped - mean
        advantages = _scale(centred, std, eps) if norm_by_std else centred
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


def _reverse_cumsum(values: torch.Tensor) -> torch.Tensor:
    """(N, T) -> (N, T): out[:, t] = sum of values[:, t:]."""
    return values.flip(-1).cumsum(-1).flip(-1)


def compute_token_reward_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
    estimator: AdvantageEstimator,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages from per-token rewards, e.g. the outcome minus coef * KL per token (KL in reward).

    token_rewards: (N, T), 0 outside the response; response_mask: (N, T). Groups as above.
      - GRPO, RLOO: outcome estimators; each response's score is its summed token rewards
        (reward - coef * sum_t KL_t), normalised in its group by compute_outcome_advantages and
        given to every response token.
      - REINFORCE_PLUS_PLUS: the return at token t is the sum of the rewards from t to the end
        (gamma = 1); the returns are whitened over all response tokens of the batch. With the
        reward on one token and no KL this equals compute_outcome_advantages with the response
        lengths.
    Returns (advantages (N, T) detached, 0 outside the response; metrics as
    compute_outcome_advantages, of the sequence scores).
    """
    estimator = AdvantageEstimator(estimator)
    mask = response_mask.bool()
    token_rewards = masked_zero(token_rewards.detach().float(), mask)
    scores = token_rewards.sum(dim=-1)  # (N,)
    lengths = mask.sum(dim=-1)
    seq_adv, metrics = compute_outcome_advantages(scores, group_size, estimator, norm_by_std, eps, lengths)
    if estimator is not AdvantageEstimator.REINFORCE_PLUS_PLUS:
        return broadcast_to_tokens(seq_adv, mask), metrics
    returns = _reverse_cumsum(token_rewards)  # (N, T)
    values = returns[mask]
    if values.numel() == 0 or values.amax() == values.amin():
        advantages = torch.zeros_like(returns)
    else:
        centred = returns - values.mean()
        advantages = _scale(centred, values.std(unbiased=False), eps) if norm_by_std else centred
    advantages = masked_zero(advantages, mask)
    values = advantages[mask]
    if values.numel():
        metrics.update(advantage_mean=values.mean().item(), advantage_std=values.std(unbiased=False).item(),
                       advantage_min=values.min().item(), advantage_max=values.max().item())
    return advantages, metrics
