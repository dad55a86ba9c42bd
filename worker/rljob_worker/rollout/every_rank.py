"""Rollouts on every rank with the hf engines: who samples which prompt groups, with which seed, how
the pieces are put back in batch order, and which layouts an hf engine cannot serve.

Design
------
Every global rank holds a complete hf engine (the transformers model, on a GPU the static-KV-cache
CUDA-graph engine) and is one rollout replica: with TP2 x DP2 on 4 GPUs that is 4 replicas, not 2,
because the engine is not sharded, so the two TP ranks of a data-parallel replica sample different
prompts instead of the same ones twice. The batch's prompts are split into contiguous shares of
whole prompts (`prompt_shares`); a replica samples all ``n`` responses of each of its prompts, so a
GRPO group is never split across ranks. The pieces are gathered in replica order, which is prompt
order (`gather_in_batch_order`): the estimator sees the exact layout a rank-0 rollout produces
(sample j of prompt i at row i * n + j) and computes group baselines over whole groups.

Seeds: replica r samples with ``seed + first_prompt * n`` (`replica_seed`), as the vLLM path does,
so replicas draw independent streams and a rerun of the same layout repeats itself. A different
layout (or rank-0 rollout) draws other samples: one generator per replica samples a whole chunk of
rows at once, so the samples of a row depend on its chunk. Rank-0 rollout stays available
(``spec.rollout.ranks: rank0``); its samples do not depend on the parallel layout.

What an hf engine cannot serve (`check_hf_engine_layout`, a start-up error): the hf engines keep the
whole model on each sampling GPU and have no tensor-parallel sharding, so
- ``rollout.tensorModelParallelSize`` must be 1 with them (vLLM shards, the hf engines do not);
- on a GPU, the model's weights must fit in ``rollout.gpuMemoryUtilization`` x the card's memory
  (the share of the card the colocated engine may take); a model that does not fit one card needs
  the vLLM engine with a rollout tensor-parallel size large enough to hold a shard
  (`smallest_fitting_tp` names it in the error).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rljob_worker.rollout.base import RolloutOutput, SamplingParams


class RolloutLayoutError(ValueError):
    """A rollout layout the configured engine cannot serve (a configuration error, raised at start-up)."""


def prompt_shares(num_prompts: int, replicas: int) -> list[slice]:
    """Contiguous shares of ``num_prompts`` whole prompts for ``replicas`` replicas, in replica order.

    Disjoint, covering ``range(num_prompts)``, sizes differing by at most one (the first
    ``num_prompts % replicas`` replicas take one more). A replica may get an empty share when there
    are fewer prompts than replicas.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    base, extra = divmod(num_prompts, replicas)
    shares, start = [], 0
    for r in range(replicas):
        size = base + (1 if r < extra else 0)
        shares.append(slice(start, start + size))
        start += size
    return shares


def replica_seed(base_seed: int | None, share: slice, samples_per_prompt: int) -> int | None:
    """The sampling seed of the replica that samples ``share``: ``base + share.start * n`` (None stays None).

    Distinct for distinct shares of one batch (their starts differ); the same for the same share."""
    if base_seed is None:
        return None
    return base_seed + share.start * samples_per_prompt


def gather_in_batch_order(pieces: Sequence[RolloutOutput | None], shares: Sequence[slice],
                          samples_per_prompt: int) -> RolloutOutput:
    """Concatenate per-replica outputs (replica r sampled ``shares[r]``) into batch order.

    pieces: one per replica, in replica order; ``pieces[r]`` holds ``len(shares[r]) * n`` responses
    grouped by prompt (None only for an empty share). Returns N = num_prompts * n responses with
    sample j of prompt i at row i * n + j. Raises ValueError when a piece's size does not match its
    share (a lost or duplicated group would otherwise shift every later group's advantages).
    """
    if len(pieces) != len(shares):
        raise ValueError(f"{len(pieces)} rollout pieces for {len(shares)} replicas")
    out = RolloutOutput([], [], [])
    expected_start = 0
    for r, (piece, share) in enumerate(zip(pieces, shares)):
        if share.start != expected_start:
            raise ValueError(f"replica {r}'s share starts at prompt {share.start}, expected {expected_start}")
        expected_start = share.stop
        want = (share.stop - share.start) * samples_per_prompt
        got = 0 if piece is None else len(piece.response_ids)
        if got != want or (piece is not None and not (len(piece.response_logprobs) == len(piece.finished) == got)):
            raise ValueError(f"replica {r} returned {got} responses for prompts {share.start}..{share.stop - 1} "
                             f"x {samples_per_prompt} samples; expected {want}")
        if piece is not None:
            out.extend(piece)
    return out


def sample_share_and_gather(engine, prompt_ids: list[list[int]], params: SamplingParams, *, rank: int,
                            world_size: int) -> RolloutOutput:
    """Collective over the default process group: this rank samples its share of whole prompts (all n
    samples each, seed `replica_seed`), then every rank receives the whole batch in batch order."""
    import torch.distributed as dist

    shares = prompt_shares(len(prompt_ids), world_size)
    share = shares[rank]
    mine = None
    if share.stop > share.start:
        seed = replica_seed(params.seed, share, params.n)
        mine = engine.generate(prompt_ids[share], dataclasses.replace(params, seed=seed))
    pieces: list[RolloutOutput | None] = [None] * world_size
    dist.all_gather_object(pieces, mine)
    return gather_in_batch_order(pieces, shares, params.n)


def group_owner(prompt_index: int, shares: Sequence[slice]) -> int:
    """The replica whose share holds prompt ``prompt_index`` (all ``n`` samples of it)."""
    for r, share in enumerate(shares):
        if share.start <= prompt_index < share.stop:
            return r
    raise IndexError(f"prompt {prompt_index} is in no share")


def smallest_fitting_tp(weight_bytes: int, budget_bytes: float, gpus_per_node: int) -> int | None:
    """The smallest tensor-parallel size dividing ``gpus_per_node`` whose shard fits ``budget_bytes``."""
    for tp in range(1, gpus_per_node + 1):
        if gpus_per_node % tp == 0 and weight_bytes / tp <= budget_bytes:
            return tp
    return None


def check_hf_engine_layout(*, rollout_tp: int, weight_bytes: int | None = None, card_bytes: int | None = None,
                           gpu_memory_utilization: float = 0.6, gpus_per_node: int = 1,
                           dtype_name: str = "bfloat16") -> None:
    """Raise RolloutLayoutError for a layout the hf engines cannot serve (see the module docstring).

    weight_bytes: the model's parameter bytes in the engine's dtype; card_bytes: one GPU's memory
    (both None on CPU, where only the tensor-parallel rule applies).
    """
    if rollout_tp != 1:
        raise RolloutLayoutError(
            f"spec.rollout.tensorModelParallelSize={rollout_tp} needs spec.rollout.engine: vllm; the hf engines keep "
            "the whole model on each sampling GPU and are not sharded (set it to 1, or use the vllm engine)")
    if weight_bytes is None or card_bytes is None:
        return
    budget = gpu_memory_utilization * card_bytes
    if weight_bytes <= budget:
        return
    tp = smallest_fitting_tp(weight_bytes, budget, gpus_per_node)
    fix = (f"use spec.rollout.engine: vllm with spec.rollout.tensorModelParallelSize: {tp}" if tp is not None else
           "use spec.rollout.engine: vllm with a rollout tensor-parallel size whose shard fits; no size up to "
           f"gpusPerNode={gpus_per_node} does at this gpuMemoryUtilization")
    raise RolloutLayoutError(
        f"spec.model.path: the model's weights take {weight_bytes / 2**30:.1f} GiB in {dtype_name}, more than "
        f"spec.rollout.gpuMemoryUtilization={gpu_memory_utilization} x {card_bytes / 2**30:.1f} GiB per GPU = "
        f"{budget / 2**30:.1f} GiB; the hf engines keep the whole model on one GPU: {fix} (or raise "
        "gpuMemoryUtilization if the actor is offloaded during rollout)")


def samples_on_every_rank(ranks: str, *, engine_is_vllm: bool, on_gpu: bool, world_size: int) -> bool:
    """Whether every rank runs an engine and samples a share (spec.rollout.ranks: auto | rank0 | every-rank).

    One process: no (it samples everything either way). vLLM: always (its process groups span the
    world; ``rank0`` is refused). hf: ``every-rank`` yes, ``rank0`` no, ``auto`` on a GPU.
    """
    ranks = str(ranks)
    if ranks not in ("auto", "rank0", "every-rank"):
        raise RolloutLayoutError(f"spec.rollout.ranks {ranks!r} is unknown; use auto, rank0 or every-rank")
    if engine_is_vllm and ranks == "rank0":
        raise RolloutLayoutError("spec.rollout.ranks: rank0 is for the hf engines; the vllm engine samples on every "
                                 "rollout tensor-parallel group (use auto or every-rank, or rollout.engine: hf)")
    if world_size <= 1:
        return False
    if engine_is_vllm:
        return True
    return ranks == "every-rank" or (ranks == "auto" and on_gpu)
