"""Partial rollouts (``spec.rollout.partial``): a batch generated in chunks, newer weights loaded between chunks.

The first chunk samples ``n`` responses per prompt as one engine call; each later chunk continues every response
that is still running (no EOS or stop token yet, budget left) from its prompt and its tokens so far, one sample
per row, under whatever weights ``refresh`` installed. Every token is tagged with the policy version that sampled
it, so the trainer can bound staleness by a response's oldest token and weigh each token's importance ratio
against the log-prob of the version that produced it (those log-probs are the engine's own, per token).

Rows that are still running after a chunk used all of its tokens, so every running row has the same length
after chunk c (c x chunk tokens): each later call asks for the same number of new tokens from all of them.
``refresh`` is called before every chunk after the first, also when this replica has nothing left to continue:
it is collective within the rollout pool, and all replicas go through the same number of chunks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rljob_worker.rollout.base import RolloutOutput, SamplingParams

CHUNKS = 4  # a batch is generated in this many chunks (the field's documentation says 4)
_SEED_STRIDE = 1_000_003  # a later chunk's seed: the batch's seed + chunk index x this


def chunk_tokens(max_new_tokens: int, chunks: int = CHUNKS) -> int:
    """Tokens per chunk: the response budget split into ``chunks`` (the last one may be shorter)."""
    return max(1, -(-max_new_tokens // chunks))


@dataclasses.dataclass
class PartialOutput:
    """``out`` as an engine returns it (N = prompts x n rows) and ``token_versions`` (N rows, one version per token)."""

    out: RolloutOutput
    token_versions: list[list[int]]


def generate_partial(generate: Callable[[list[list[int]], SamplingParams], RolloutOutput],
                     refresh: Callable[[], int], prompt_ids: list[list[int]], params: SamplingParams,
                     version: int, chunk: int) -> PartialOutput:
    """Generate ``params.n`` responses per prompt in chunks of ``chunk`` tokens (see the module docstring).

    generate: the engine's generate; refresh: loads the newest weights, returns the version now installed;
    version: the version installed for the first chunk.
    """
    budget, n = params.max_new_tokens, params.n
    rows = [list(p) for p in prompt_ids for _ in range(n)]
    ids: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[float]] = [[] for _ in rows]
    versions: list[list[int]] = [[] for _ in rows]
    finished = [False] * len(rows)
    for index in range(-(-budget // chunk)):
        if index:
            version = refresh()
        live = [i for i in range(len(rows)) if not finished[i] and len(ids[i]) < budget]
        if not live:
            continue
        new_tokens = min(chunk, budget - index * chunk)
        if index == 0:
            out = generate(prompt_ids, dataclasses.replace(params, max_new_tokens=new_tokens))
        else:
            seed = None if params.seed is None else params.seed + index * _SEED_STRIDE
            out = generate([rows[i] + ids[i] for i in live],
                           dataclasses.replace(params, n=1, max_new_tokens=new_tokens, seed=seed))
        for row, i in enumerate(live):
            ids[i] += out.response_ids[row]
            logprobs[i] += out.response_logprobs[row]
            versions[i] += [version] * len(out.response_ids[row])
            finished[i] = out.finished[row]
    return PartialOutput(RolloutOutput(ids, logprobs, finished), versions)
