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


@dataclass
class RolloutOutput:
    """N = len(prompts) x n responses, grouped by prompt (sample j of prompt i at i*n + j)."""

    response_ids: list[list[int]]  # generated tokens, EOS included when produced
    response_logprobs: list[list[float]]  # log-prob of each generated token under the sampling distribution
    finished: list[bool]  # True when the response ended with EOS, False when cut at max_new_tokens


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (streamed; each may be freed after the call consumes it)."""

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) while the actor trains."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-acquire memory before the next generate(): `["weights"]` (then update_weights), then
        `["kv_cache"]`; None does both. Engines without the distinction treat every call alike."""
