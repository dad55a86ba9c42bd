"""Rollout/training mismatch correction: truncated importance sampling and sequence masking.

The rollout engine samples with its own kernels (and sometimes its own sampling settings), so the
distribution that produced a response, pi_rollout, is not exactly the trainer's pi_train. The
policy gradient is then off-policy. Two corrections (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"; Liu, Li et al. 2025, "When speed kills stability"),
applied to the policy-gradient term only:

- token-level truncated importance sampling (TIS): each token's policy-gradient loss is weighted
  by min(pi_train / pi_rollout, C), a constant (no gradient). verl: rollout_is token with
  rollout_is_threshold (default 2); TRL: vllm_importance_sampling_mode token_truncate with
  vllm_importance_sampling_cap (default 3).
- sequence-level masking: a response whose sequence ratio leaves [1 / D, D] gets weight 0 on every
  token. The sequence ratio is the geometric mean of its token ratios, exp(mean_t log(pi_train /
  pi_rollout)), as verl's geometric rejection sampling (rollout_rs geometric, lower bound 1/D).
  D has its own default (1.01), far below C: a geometric mean outside [1/2, 2] needs a drift of
  0.69 nats on every token. TRL's sequence_mask differs: it masks when the product of the token
  ratios exceeds its cap (upper side only), so on long responses it follows the length more than
  the mismatch.

A masked response still counts in the loss normaliser (as in TRL): the loss scale does not
depend on how many responses were masked.
"""

import torch

from .aggregation import masked_zero


def rollout_correction_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    threshold: float,
    token_truncation: bool,
    sequence_masking: bool,
    mask_threshold: float = 1.01,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights for the policy-gradient loss.

    train_logprobs: (B, T) log pi_train of the sampled tokens (the trainer's old log-probs);
    rollout_logprobs: (B, T) log pi_rollout reported by the engine; response_mask: (B, T).
    threshold: C > 1. token_truncation: weight min(exp(train - rollout), C) per token (else 1).
    mask_threshold: D > 1. sequence_masking: weight 0 on rows whose geometric-mean ratio is outside [1/D, D].
    Returns (weights (B, T) detached, 0 outside the response; metrics) with metrics
    weight_mean (mean weight over response tokens, 1.0 without tokens), clipped_frac (share of
    response tokens whose ratio exceeds C; reported with token_truncation off too) and
    masked_frac (share of rows with response tokens that fall outside the band; reported with
    sequence_masking off too).
    """
    if threshold <= 1.0:
        raise ValueError(f"threshold must be > 1, got {threshold}")
    if mask_threshold <= 1.0:
        raise ValueError(f"mask_threshold must be > 1, got {mask_threshold}")
    mask = response_mask.bool()
    log_ratio = masked_zero(train_logprobs.detach() - rollout_logprobs.detach(), mask)  # (B, T)
    ratio = torch.exp(log_ratio)
    weights = torch.clamp(ratio, max=threshold) if token_truncation else torch.ones_like(ratio)
    tokens = mask.sum(dim=-1)  # (B,)
    has_tokens = tokens > 0
    seq_log_ratio = log_ratio.sum(dim=-1) / tokens.clamp(min=1)  # (B,) log of the geometric mean
    bound = torch.log(torch.tensor(mask_threshold, dtype=seq_log_ratio.dtype))
    outside = (seq_log_ratio.abs() > bound) & has_tokens  # (B,)
    if sequence_masking:
        weights = torch.where(outside[:, None], 0.0, weights)
    weights = masked_zero(weights, mask)
    n_tok = mask.sum()
    metrics = {
        "weight_mean": float(weights.sum() / n_tok) if n_tok > 0 else 1.0,
        "clipped_frac": float(((ratio > threshold) & mask).sum() / n_tok) if n_tok > 0 else 0.0,
        "masked_frac": float(outside.sum() / has_tokens.sum()) if has_tokens.any() else 0.0,
    }
    return weights, metrics
