"""Pure RL algorithm math: advantages (outcome, from token rewards, and GAE), KL estimators, loss
aggregation, policy and value losses, rollout correction, batch filters."""

from .advantages import broadcast_to_tokens, compute_outcome_advantages, compute_token_reward_advantages
from .aggregation import aggregate_loss, loss_counts, masked_mean, masked_zero
from .evaluation import pass_at_k, sample_metrics
from .gae import compute_gae, explained_variance, masked_whiten, token_level_rewards, value_loss
from .kl import apply_kl_to_rewards, kl_penalty
from .policy_loss import LossConfig, entropy_bonus, grpo_loss, policy_loss
from .rollout_correction import rollout_correction_weights
from .sampling_filters import (
    nonzero_variance_groups,
    overlong_penalty,
    response_length_clip_ratio,
    select_groups,
)

__all__ = [
    "LossConfig",
    "aggregate_loss",
    "apply_kl_to_rewards",
    "broadcast_to_tokens",
    "compute_gae",
    "compute_outcome_advantages",
    "compute_token_reward_advantages",
    "entropy_bonus",
    "explained_variance",
    "grpo_loss",
    "kl_penalty",
    "loss_counts",
    "masked_mean",
    "masked_whiten",
    "masked_zero",
    "nonzero_variance_groups",
    "overlong_penalty",
    "pass_at_k",
    "policy_loss",
    "response_length_clip_ratio",
    "rollout_correction_weights",
    "sample_metrics",
    "select_groups",
    "token_level_rewards",
    "value_loss",
]
