"""The rollout interface every engine implements."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt; outputs of one prompt are contiguous
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    seed: int | None = None
    # Tokens that end a response like EOS and are kept as its last token (the agent loop's tool-call end,
    # e.g. Qwen's `</tool_call>`); a stop must be one token, so the engine checks it inside its decode step.
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class RolloutOutput:
    """N = len(prompts) x n responses, grouped by prompt (sample j of prompt i at i*n + j)."""

    response_ids: list[list[int]]  # generated tokens, EOS included when produced
    response_logprobs: list[list[float]]  # log-prob of each generated token under the sampling distribution
    finished: list[bool]  # True when the response ended with EOS or a stop token, False when cut at max_new_tokens
    # MoE routing replay (algorithm.routingReplay): per response, the experts the engine routed each token it fed
    # through the model to, (fed tokens, layers, top-k) integers over prompt + response in order (the last sampled
    # token is never fed); None when not recorded.
    routed_experts: list[torch.Tensor] | None = None

    def extend(self, other: RolloutOutput) -> None:
        """Append ``other``'s responses (in order), routed experts included when both carry them."""
        if not self.response_ids and self.routed_experts is None:
            self.routed_experts = None if other.routed_experts is None else []
        self.response_ids += other.response_ids
        self.response_logprobs += other.response_logprobs
        self.finished += other.finished
        if self.routed_experts is not None:
            if other.routed_experts is None:
                raise ValueError("routed experts: one engine output carries them and another does not")
            self.routed_experts += other.routed_experts


def first_stop(row: list[int], stops: set[int]) -> int:
    """The length of ``row`` up to and including its first token in ``stops``; len(row) when there is none."""
    for i, tok in enumerate(row):
        if tok in stops:
            return i + 1
    return len(row)


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Load HF-named full tensors (streamed; each may be freed after the call consumes it). Every
        parameter must come unless ``partial`` (LoRA: only the weights the adapters change)."""

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) while the actor trains."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-acquire memory before the next generate(): `["weights"]` (then update_weights), then
        `["kv_cache"]`; None does both. Engines without the distinction treat every call alike."""
