"""The clipped policy-gradient loss (PPO/GRPO, DAPO clip-higher, dual clip, GSPO) and the full GRPO loss.

Tensors are (B, T): B sequences, T response positions; response_mask marks real response tokens.
Masked positions never affect a loss or its gradient, even when they hold NaN or inf: every
input is passed through aggregation.masked_zero before any arithmetic.
"""

from dataclasses import dataclass

import torch
from rljob_api.enums import ImportanceLevel, KLEstimator, KLPlacement, LossAggregation

from .aggregation import aggregate_loss, masked_mean, masked_zero
from .kl import kl_penalty


def _to_floats(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalar tensors -> python floats with one device sync instead of one per metric."""
    values = torch.stack([t.detach().to(torch.float64) for t in tensors.values()]).tolist()
    return dict(zip(tensors, values, strict=True))


def _importance_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, importance: ImportanceLevel
) -> torch.Tensor:
    """log of the importance ratio per token, (B, T); inputs already masked to 0.

    TOKEN: logprobs - old_logprobs.
    SEQUENCE (GSPO-token): sg[l_i] + logprobs - sg[logprobs], where l_i is the mean over the
    response tokens of sequence i of (logprobs - old_logprobs). Its value is the sequence ratio
    log s_i at every token; its gradient reaches each token's logprob with weight 1.
    """
    token_log_ratio = logprobs - old_logprobs
    if importance is ImportanceLevel.TOKEN:
        return token_log_ratio
    if importance is ImportanceLevel.SEQUENCE:
        tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)
        seq_log_ratio = token_log_ratio.sum(dim=-1, keepdim=True) / tokens  # (B, 1)
        return seq_log_ratio.detach() + logprobs - logprobs.detach()
    raise ValueError(f"unknown importance level {importance!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
    aggregation: LossAggregation,
    importance: ImportanceLevel = ImportanceLevel.TOKEN,
    norm_length: int | None = None,
    token_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with an asymmetric clip range and optional dual clip.

    logprobs: (B, T) current policy, with grad; old_logprobs: (B, T) rollout policy;
    advantages: (B, T) (see advantages.broadcast_to_tokens); response_mask: (B, T).
    ratio r = exp(log importance ratio) at the chosen importance level (TOKEN or SEQUENCE/GSPO).
    Per token: loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)) (clip_high >
    clip_low is DAPO's clip-higher). Dual clip (dual_clip_c = c > 1): where A < 0 the loss is
    further capped at -A * c, so a huge ratio on a bad token cannot blow up the update.
    token_weights: (B, T) constant per-token weights of the loss (rollout correction, see
    rollout_correction.rollout_correction_weights), or None for 1.
    The per-token loss is reduced by aggregation.aggregate_loss(aggregation, norm_length,
    num_tokens, num_sequences): with the mini-batch's counts given, the loss is this micro-batch's
    share of the mini-batch loss (the shares sum to it).
    Returns (loss scalar, metrics): pg_loss (this batch's own mean, whatever the counts); clip_fraction (share of response tokens where the
    clipped term is strictly the larger, i.e. the clip zeroes the gradient); dual_clip_fraction
    (share where the dual-clip cap binds); ratio_mean/min/max over response tokens (1.0 when
    there are none); approx_kl: mean over response tokens of the k3 estimate of
    KL(pi_old || pi_theta), exp(d) - d - 1 with d = logprobs - old_logprobs (token level);
    log_ratio_mean: mean of d over response tokens (its negation is the k1 estimate).
    """
    importance = ImportanceLevel(importance)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    mask = response_mask.bool()
    logprobs = masked_zero(logprobs, mask)
    old_logprobs = masked_zero(old_logprobs, mask).detach()
    advantages = masked_zero(advantages, mask).detach()

    log_ratio = _importance_log_ratio(logprobs, old_logprobs, mask, importance)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped) & mask
    dual_active = torch.zeros_like(mask)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        negative = advantages < 0
        dual_active = negative & (loss_mat > cap) & mask
        loss_mat = torch.where(negative, torch.minimum(loss_mat, cap), loss_mat)
    if token_weights is not None:
        loss_mat = loss_mat * masked_zero(token_weights, mask).detach()

    loss = aggregate_loss(loss_mat, mask, aggregation, norm_length, num_tokens=num_tokens, num_sequences=num_sequences)
    own = loss if num_tokens is None and num_sequences is None else aggregate_loss(loss_mat.detach(), mask, aggregation, norm_length)

    with torch.no_grad():
        ratio_d = ratio.detach()
        has_tokens = mask.any()
        approx_kl = kl_penalty(old_logprobs, logprobs.detach(), KLEstimator.K3)
        ratio_max = torch.where(mask, ratio_d, -torch.inf).amax()
        ratio_min = torch.where(mask, ratio_d, torch.inf).amin()
        metrics = _to_floats(
            {
                "pg_loss": own.detach(),
                "clip_fraction": masked_mean(clip_active.float(), mask),
                "dual_clip_fraction": masked_mean(dual_active.float(), mask),
                "ratio_mean": torch.where(has_tokens, masked_mean(ratio_d, mask), 1.0),
                "ratio_max": torch.where(has_tokens, ratio_max, 1.0),
                "ratio_min": torch.where(has_tokens, ratio_min, 1.0),
                "approx_kl": masked_mean(approx_kl, mask),
                "log_ratio_mean": masked_mean((logprobs - old_logprobs).detach(), mask),
            }
        )
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    aggregation: LossAggregation,
    coef: float,
    norm_length: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Entropy regulariser as a loss term: -coef * aggregate(entropy).

    entropy: (B, T) per-token entropy of the policy, with grad; response_mask: (B, T).
    num_tokens, num_sequences: the mini-batch's counts (see aggregation.aggregate_loss).
    Returns (loss scalar, {"entropy": this batch's own aggregated entropy}); adding the loss to
    the total rewards higher entropy when coef > 0.
    """
    aggregated = aggregate_loss(entropy, response_mask, aggregation, norm_length,
                                num_tokens=num_tokens, num_sequences=num_sequences)
    own = aggregated if num_tokens is None and num_sequences is None else aggregate_loss(
        entropy.detach(), response_mask, aggregation, norm_length)
    return -coef * aggregated, {"entropy": own.detach().item()}


@dataclass(frozen=True)
class LossConfig:
    """Everything grpo_loss needs to know besides tensors; built from the RLJob's algorithm section.

    clip_low, clip_high: ratio clip range (1 - clip_low, 1 + clip_high); DAPO uses 0.2 / 0.28.
    dual_clip_c: cap for negative-advantage tokens (> 1, e.g. 3), None to disable.
    kl_coef: weight of the KL(pi || ref) term; 0 disables it.
    kl_estimator: per-token KL estimator (k1, k2, k3, low_var_kl).
    kl_placement: LOSS adds kl_coef * KL to the loss here; REWARD means the trainer already
      subtracted it from the rewards (kl.apply_kl_to_rewards), so it is only reported here.
    entropy_coef: weight of the entropy bonus; 0 disables it.
    aggregation: how per-token losses become a scalar (token-mean, seq-mean-token-mean, Dr.GRPO).
    importance: TOKEN (PPO/GRPO) or SEQUENCE (GSPO) importance ratio.
    norm_length: Dr.GRPO's constant divisor (usually max response length); None means T.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.LOW_VAR_KL
    kl_placement: KLPlacement = KLPlacement.LOSS
    entropy_coef: float = 0.0
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    importance: ImportanceLevel = ImportanceLevel.TOKEN
    norm_length: int | None = None

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip_low and clip_high must be >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.norm_length is not None and self.norm_length <= 0:
            raise ValueError(f"norm_length must be positive, got {self.norm_length}")
        # Accept the plain strings of a YAML/JSON config as well as the enums.
        object.__setattr__(self, "kl_estimator", KLEstimator(self.kl_estimator))
        object.__setattr__(self, "kl_placement", KLPlacement(self.kl_placement))
        object.__setattr__(self, "aggregation", LossAggregation(self.aggregation))
        object.__setattr__(self, "importance", ImportanceLevel(self.importance))


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total GRPO loss = policy loss + kl_coef * KL (placement LOSS) - entropy_coef * entropy.

    logprobs, old_logprobs, advantages, response_mask: (B, T) as in policy_loss.
    token_weights: (B, T) rollout-correction weights of the policy-gradient term, or None.
    num_tokens, num_sequences: the counts of the whole mini-batch this micro-batch belongs to
      (aggregation.loss_counts summed over micro-batches and data-parallel ranks); all three terms
      are normalised by them, so the micro-batch losses sum to the mini-batch loss. None: this
      batch is the mini-batch. Metrics are this batch's own means either way.
    ref_logprobs: (B, T) reference-policy logprobs; required when kl_coef > 0 and placement is
      LOSS; when given with placement REWARD the KL is computed for the metrics only.
    entropy: (B, T) per-token policy entropy, or None to skip the bonus and its metric.
    KL and entropy are aggregated with the same mode and norm_length as the policy loss.
    Returns (loss scalar, metrics): everything policy_loss reports, plus loss (this batch's own total),
    kl (when ref_logprobs is given) and entropy (when entropy is given).
    """
    kl_in_loss = config.kl_placement is KLPlacement.LOSS and config.kl_coef != 0.0
    if kl_in_loss and ref_logprobs is None:
        raise ValueError("kl_coef > 0 with kl_placement=loss needs ref_logprobs")
    mask = response_mask.bool()
    loss, metrics = policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        dual_clip_c=config.dual_clip_c,
        aggregation=config.aggregation,
        importance=config.importance,
        norm_length=config.norm_length,
        token_weights=token_weights,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )
    counts = {"num_tokens": num_tokens, "num_sequences": num_sequences}
    if ref_logprobs is not None:
        kl_mat = kl_penalty(
            masked_zero(logprobs, mask), masked_zero(ref_logprobs, mask).detach(), config.kl_estimator
        )
        kl = aggregate_loss(kl_mat, mask, config.aggregation, config.norm_length, **counts)
        own = kl if num_tokens is None and num_sequences is None else aggregate_loss(
            kl_mat.detach(), mask, config.aggregation, config.norm_length)
        metrics["kl"] = own.detach().item()
        if kl_in_loss:
            loss = loss + config.kl_coef * kl
    if entropy is not None:
        bonus, entropy_metrics = entropy_bonus(
            entropy, mask, config.aggregation, config.entropy_coef, config.norm_length, **counts
        )
        metrics.update(entropy_metrics)
        if config.entropy_coef != 0.0:
            loss = loss + bonus
    # this batch's own total (a micro-batch's loss is only its share of the mini-batch's)
    metrics["loss"] = (metrics["pg_loss"] + (config.kl_coef * metrics["kl"] if kl_in_loss else 0.0)
                       - (config.entropy_coef * metrics["entropy"] if entropy is not None else 0.0))
    return loss, metrics
