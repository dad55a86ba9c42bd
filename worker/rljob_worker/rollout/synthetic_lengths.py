"""Long-tailed response lengths for throughput benchmarks with random-init models (``RLJOB_SYNTHETIC_LENGTHS``).

A random-init model almost never samples EOS, so every response runs to data.maxResponseLength and a benchmark
of what long tails cost (a batch waiting for its longest response; rollout/static_refill.py) has no tail to
measure. With ``RLJOB_SYNTHETIC_LENGTHS=lognormal:<median>:<sigma>`` in the worker's environment the hf engines
(batch at a time) and the rollout pool's refilling rows end each response at a length drawn from
LogNormal(ln median, sigma), capped at the call's max_new_tokens, as if it had sampled EOS there (no EOS token is
added; ``finished`` is true unless the draw reached the cap). The draw is a pure function of the prompt's tokens,
the sample's index in its group and the call's seed, so every engine and every replica cuts the same response at
the same length. For benchmarks only: the training signal of a response cut this way is meaningless. vLLM and the
chunked partial loop ignore it.
"""
from __future__ import annotations

import hashlib
import math
import os
import struct
from dataclasses import dataclass

import torch

from rljob_worker.rollout.base import RolloutOutput

ENV = "RLJOB_SYNTHETIC_LENGTHS"


@dataclass(frozen=True)
class LengthLaw:
    median: float
    sigma: float

    def budget(self, prompt: list[int], sample: int, seed: int | None, cap: int) -> int:
        """The length at which sample ``sample`` of ``prompt`` ends, within [1, cap]."""
        digest = hashlib.blake2b(struct.pack(f"<{len(prompt) + 2}q", sample, seed or 0, *prompt), digest_size=8)
        u = (int.from_bytes(digest.digest(), "little") + 0.5) / 2**64  # uniform in (0, 1)
        z = math.sqrt(2) * torch.erfinv(torch.tensor(2 * u - 1, dtype=torch.float64)).item()  # standard normal
        return max(1, min(cap, round(self.median * math.exp(self.sigma * z))))


def law_from_env() -> LengthLaw | None:
    """The law ``RLJOB_SYNTHETIC_LENGTHS`` names, None when unset; a malformed value fails with the format."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    parts = value.split(":")
    try:
        if parts[0] != "lognormal" or len(parts) != 3:
            raise ValueError
        law = LengthLaw(float(parts[1]), float(parts[2]))
        if law.median <= 0 or law.sigma < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected lognormal:<median tokens > 0>:<sigma >= 0>, e.g. lognormal:300:1.0")
    return law


def cut_to_budgets(out: RolloutOutput, budgets: list[int], cap: int) -> RolloutOutput:
    """Each response cut at its budget (in place): a cut response counts as finished unless its budget is the cap;
    one that ended on its own by then is kept as it is."""
    for i, budget in enumerate(budgets):
        ids = out.response_ids[i]
        if len(ids) > budget or (len(ids) == budget and not out.finished[i]):
            if out.routed_experts is not None:  # prompt + response - 1 fed tokens
                out.routed_experts[i] = out.routed_experts[i][:len(out.routed_experts[i]) - (len(ids) - budget)]
            out.response_ids[i] = ids[:budget]
            out.response_logprobs[i] = out.response_logprobs[i][:budget]
            out.finished[i] = budget < cap
    return out
