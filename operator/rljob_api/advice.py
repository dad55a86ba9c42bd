"""Warnings about valid specs that are likely to train badly: `rljob validate` prints them and the worker
logs them at start-up. Pure; one line each, naming the field and what to do."""
from __future__ import annotations

from rljob_api.models import LoraSpec, RLJobSpec

# RL full fine-tuning runs at 1e-7..5e-6; LoRA's best rate is about 10x full fine-tuning's, nearly
# independent of the rank at a fixed alpha (Thinking Machines, "LoRA Without Regret", 2025; Biderman et
# al., "LoRA Learns Less and Forgets Less", 2024). Below this, a LoRA run is likely in the full-fine-tuning range.
LORA_MIN_LR = 1e-5


def _lora_lr_warning(lora: LoraSpec | None, lr: float, lr_path: str, lora_path: str) -> list[str]:
    if lora is None or lr >= LORA_MIN_LR:
        return []
    return [(f"{lr_path}: {lr:g} is in the full fine-tuning range; with {lora_path} the best learning rate is about "
             f"10x higher (try {lr * 10:g}; at least {LORA_MIN_LR:g}), see `rljob explain {lora_path}`")]


def _greedy_group_warning(spec: RLJobSpec) -> list[str]:
    """rollout.temperature 0 under an estimator without a group baseline (gae, reinforce_plus_plus; grpo and rloo
    are refused by validation): it still learns, but every prompt's samples are one response computed n times."""
    from rljob_api.enums import AlgorithmName

    r = spec.rollout
    if spec.algorithm.name == AlgorithmName.SFT or r.temperature != 0 or r.samples_per_prompt < 2:
        return []
    baseline = "the critic's values" if spec.critic is not None else "the batch-whitened returns"
    return [(f"spec.rollout.temperature: 0 samples greedily, so the samplesPerPrompt={r.samples_per_prompt} responses "
             f"of a prompt are identical (advantages come from {baseline}, but nothing is explored); use 1.0, or "
             "samplesPerPrompt: 2 if greedy rollouts are intended")]


def spec_warnings(spec: RLJobSpec) -> list[str]:
    warnings = _lora_lr_warning(spec.lora, spec.training.lr, "spec.training.lr", "spec.lora")
    if spec.critic is not None:
        warnings += _lora_lr_warning(spec.critic.lora, spec.critic.lr, "spec.critic.lr", "spec.critic.lora")
    return warnings + _greedy_group_warning(spec)


def spec_notes(spec: RLJobSpec) -> list[str]:
    """What a valid spec does that its fields do not say outright (printed by `rljob validate`)."""
    from rljob_api.enums import AlgorithmName, RolloutMode
    from rljob_api.validation import (
        actor_token_budget_in_effect,
        rollout_lookahead,
        token_truncation_in_effect,
    )

    r, notes = spec.rollout, []
    if r.mode != RolloutMode.SYNC:
        ahead = rollout_lookahead(spec)
        notes.append(f"spec.rollout.mode {r.mode.value}: the rollout pool generates up to {ahead} batch(es) ahead, so a "
                     f"sample can be up to {ahead} policy version(s) old (older ones are dropped and counted)")
        if token_truncation_in_effect(spec):
            notes.append("spec.algorithm.rolloutCorrection.tokenTruncation is on (unset: on for off-policy modes): the "
                         "loss weights each token by min(pi_train / pi_rollout, "
                         f"{spec.algorithm.rollout_correction.threshold:g}) against the rollout's own log-probs")
        else:
            notes.append("spec.algorithm.rolloutCorrection.tokenTruncation is off: the loss does not correct for "
                         "samples from older policies; set it to true (or unset) unless that is intended")
    budget = actor_token_budget_in_effect(spec, on_gpu=spec.device == "gpu")
    if spec.algorithm.name != AlgorithmName.SFT and budget and spec.training.max_tokens_per_micro_batch is None:
        notes.append("spec.training.maxTokensPerMicroBatch unset on a GPU without pipeline stages: actor-update "
                     f"micro-batches hold up to {budget} tokens (microBatchSizePerGpu full rows: the same memory "
                     "bound, less padding; concatenated in bf16 without context parallelism, "
                     "else rows grouped by length); 0 keeps microBatchSizePerGpu rows")
    if spec.algorithm.routing_replay:
        notes.append("spec.algorithm.routingReplay: the rollout engine records each token's experts and the actor's "
                     "old-policy pass and updates route to them (the reference model routes on its own); the worker "
                     "refuses a model without experts at start-up")
    return notes
