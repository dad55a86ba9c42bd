"""PPO with a learned value model: token rewards, GAE, whitening, the clipped value loss.

Shapes: N responses, T response columns; response_mask (N, T) marks the response tokens that
count (1) and padding or tool/observation tokens that do not (0). Every function treats masked
positions as absent: they change no result, and their outputs are 0.

As verl's `compute_gae_advantage_return` / `compute_value_loss`, with one difference: a masked
position inside a response (a tool observation) is skipped by the recursion, so the token before
it bootstraps from the value of the next *counted* token, not of the observation token.
"""

from collections.abc import Callable

import torch
from rljob_api.enums import LossAggregation

from .aggregation import aggregate_loss, masked_mean, masked_zero


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last counted token; -1 for a row without one.

    response_mask: (N, T). Returns (N,) int64.
    """
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1)


def token_level_rewards(
    outcome_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards for GAE: the outcome reward on the last counted token, minus coef x KL per token.

    outcome_rewards: (N,) one scalar per response; response_mask: (N, T); kl: (N, T) per-token KL
    estimate (see kl.kl_penalty), used detached, or None. Returns (N, T) float, 0 outside the mask.
    A row without any counted token gets all zeros (its outcome reward has nowhere to go).
    """
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = last_token_index(response_mask)  # (N,)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = outcome_rewards.detach().float()[rows]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.detach().float()
    return masked_zero(rewards, response_mask)


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the counted tokens of each row.

    token_rewards: (N, T) r_t; values: (N, T) V(s_t) from the critic (old values, detached);
    response_mask: (N, T). With t' the next counted token after t (none after the last: V = 0, the
    episode ends):
        delta_t = r_t + gamma * V(t') - V(t)
        A_t = delta_t + gamma * lam * A_t'
    Returns (advantages (N, T), returns (N, T) = advantages + values), both 0 outside the mask and
    detached. gamma = lam = 1 gives A_t = sum of rewards from t on - V(t) (Monte-Carlo); lam = 0 gives
    the one-step TD error.
    """
    mask = response_mask.bool()
    rewards, values = token_rewards.detach().float(), values.detach().float()
    n, t_len = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(t_len)):
        counted = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(counted, advantage, 0.0)
        # A masked position is transparent: the recursion carries on from the next counted token.
        next_value = torch.where(counted, values[:, t], next_value)
        next_advantage = torch.where(counted, advantage, next_advantage)
    returns = masked_zero(advantages + values, mask)
    return advantages, returns


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` (float64, shape (3,)) of values over the counted positions, so that
    data-parallel ranks can all-reduce them and whiten over the whole mini-batch (:func:`whiten`).

    values, mask: same shape."""
    mask = mask.bool()
    v = masked_zero(values.detach().double(), mask)
    return torch.stack([mask.sum().double(), v.sum(), v.square().sum()])


def whiten(values: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """Normalise values with the mean and unbiased variance of ``moments`` (from :func:`masked_moments`,
    possibly summed over ranks). values, mask: (N, T). Returns (N, T), 0 outside the mask. Fewer than
    two counted positions: centred but unscaled."""
    mask = mask.bool()
    count, total, total_sq = (float(x) for x in moments)
    mean = total / max(count, 1.0)
    centred = masked_zero(values - mean, mask)
    if count < 2:
        return centred if shift_mean else masked_zero(values, mask)
    var = max((total_sq - count * mean * mean) / (count - 1), 0.0)
    whitened = centred / (var + eps) ** 0.5
    if not shift_mean:
        whitened = whitened + mean
    return masked_zero(whitened, mask)


def whiten_advantages(advantages: torch.Tensor, mask: torch.Tensor, scope: str, mini_batches: int,
                      reduce: Callable[[torch.Tensor], torch.Tensor] = lambda moments: moments) -> torch.Tensor:
    """PPO's advantage whitening over the batch or over each mini-batch (``algorithm.whitenScope``).

    advantages, mask: (N, T), this rank's rows; mini_batches: how many equal contiguous row slices the
    update splits them into (as ``split_batch``). scope ``batch``: one mean and unbiased variance over
    every counted token (verl's compute_advantage); ``mini-batch``: one per slice. ``reduce`` sums a (3,)
    moments tensor over the data-parallel ranks (identity on one rank). Returns (N, T), 0 outside the mask.
    """
    if str(scope) == "batch":
        return whiten(advantages, mask, reduce(masked_moments(advantages, mask)))
    if str(scope) != "mini-batch":
        raise ValueError(f"whiten scope must be batch or mini-batch, got {scope!r}")
    n = advantages.shape[0]
    if n % mini_batches:
        raise ValueError(f"cannot split {n} rows into {mini_batches} equal mini-batches")
    size = n // mini_batches
    parts = [whiten(advantages[i:i + size], mask[i:i + size], reduce(masked_moments(advantages[i:i + size],
                                                                                    mask[i:i + size])))
             for i in range(0, n, size)]
    return torch.cat(parts)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise values to zero mean and unit variance over the counted positions (verl's masked_whiten).

    values, mask: (N, T). The variance is the unbiased one (Bessel's correction, as verl); with
    shift_mean False the mean is added back (only the scale changes). Returns (N, T), 0 outside
    the mask. Fewer than two counted positions: returned centred but unscaled.
    """
    return whiten(values, mask, masked_moments(values, mask), shift_mean, eps)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    aggregation: LossAggregation,
    norm_length: int | None = None,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss, aggregated like the policy loss.

    values: (N, T) V from the critic being trained (carries the gradient); old_values: (N, T) V of
    the same tokens before this update (the ones GAE used); returns: (N, T) GAE targets;
    response_mask: (N, T). Per token:
        clipped = old + clamp(V - old, -c, c)
        loss_t = 0.5 * max((V - R)^2, (clipped - R)^2)
    then aggregation.aggregate_loss(loss, mask, aggregation, norm_length): token-mean,
    seq-mean-token-mean or seq-mean-token-sum-norm, as the policy loss; with ``num_tokens`` /
    ``num_sequences`` (the whole mini-batch's counts, aggregation.loss_counts summed over micro-batches
    and data-parallel ranks) the result is this batch's share of the mini-batch loss.
    Returns (scalar loss, metrics): critic/value_loss, critic/value_clip_fraction (share of
    counted tokens where the clipped error was the larger), critic/vpred_mean.
    """
    mask = response_mask.bool()
    # Zero masked positions first, so that a NaN there cannot reach the gradient through 0 * NaN.
    values = masked_zero(values, mask)
    returns, old_values = masked_zero(returns.detach(), mask), masked_zero(old_values.detach(), mask)
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped - returns).square()
    loss_mat = 0.5 * torch.maximum(unclipped_error, clipped_error)
    loss = aggregate_loss(loss_mat, mask, aggregation, norm_length, num_tokens=num_tokens, num_sequences=num_sequences)
    metrics = {
        "critic/value_loss": float(loss.detach()),
        "critic/value_clip_fraction": float(masked_mean((clipped_error > unclipped_error).float(), mask)),
        "critic/vpred_mean": float(masked_mean(values.detach(), mask)),
    }
    return loss, metrics


def explained_variance_moments(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum R, sum R^2, sum E, sum E^2]`` (float64, (5,)) with E = R - V over the counted tokens:
    what :func:`explained_variance_from_moments` needs, summable over data-parallel ranks."""
    returns, error = returns.detach(), returns.detach() - values.detach()
    r, e = masked_moments(returns, mask), masked_moments(error, mask)
    return torch.cat([r, e[1:]])


def explained_variance_from_moments(moments: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) (population variances) from :func:`explained_variance_moments`; 0.0 when
    the returns do not vary or nothing is counted."""
    count, r_sum, r_sq, e_sum, e_sq = (float(x) for x in moments)
    if count <= 0:
        return 0.0
    var_returns = r_sq / count - (r_sum / count) ** 2
    if var_returns <= 1e-12:
        return 0.0
    var_error = max(e_sq / count - (e_sum / count) ** 2, 0.0)
    return 1.0 - var_error / var_returns


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the counted tokens: 1 for a perfect critic, 0 for one that predicts
    the mean, negative for worse. values, returns, mask: (N, T). Population variances; 0.0 when the
    returns do not vary (nothing to explain)."""
    return explained_variance_from_moments(explained_variance_moments(values, returns, mask))
