"""MoE routing replay: the actor's routers take the experts the rollout engine chose for each token.

Why: the importance ratio pi_train / pi_rollout is only meaningful when both sides ran the same sub-network.
Wherever the trainer's router rounds differently from the engine's (bf16 kernels, another TP split, weights a
step apart under async rollouts), a token's top-k changes and its log-prob jumps; large MoE RL runs collapse
on that mismatch. With replay the trainer's forward passes (old-policy and current-policy) route every token
to the experts recorded in the rollout; megatron's top-k then gathers the trainer's own router scores at those
experts, so the mixing weights stay differentiable and only the choice is replayed.

The batch carries ``routed_experts`` ``(N, T, L, k)`` aligned with ``input_ids`` (``rollout.routed_experts``).
Before each micro-batch's forward the actor hands each router its tokens' indices in the order the router sees
them: megatron's ``(s, b)`` flattened, ``s`` the packed columns this rank holds (context parallel: its two
chunks; sequence parallel: its TP share of those). The reference model routes on its own.

Activation recompute runs a router again inside the backward pass; each router keeps the indices of the
micro-batches it has run forward, oldest first, and a recompute takes the oldest (megatron's schedules run
one model chunk's backward passes in forward order).
"""
from __future__ import annotations

from collections import deque

import torch

from .context_parallel import split_for_cp
from .packing import PackedMicroBatch


def _in_backward() -> bool:
    """True inside an autograd backward pass (where activation recompute re-runs a layer's forward)."""
    return torch._C._current_graph_task_id() != -1


class TokenRoutingReplay:
    """One router's replay (megatron's ``TopKRouter.router_replay`` interface: ``get_replay_topk``)."""

    def __init__(self, layer: int):
        self.layer = layer  # the HF decoder layer (0-based)
        self.current: torch.Tensor | None = None
        self.pending: deque[torch.Tensor] = deque()

    def set(self, indices: torch.Tensor | None) -> None:
        self.current = indices
        if indices is not None:
            self.pending.append(indices)

    def clear(self) -> None:
        self.current, self.pending = None, deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        indices = self.pending.popleft() if _in_backward() and self.pending else self.current
        if indices is None:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if tuple(indices.shape) != (scores.shape[0], topk):
            raise RuntimeError(f"routing replay, layer {self.layer}: {tuple(indices.shape)} recorded experts for "
                               f"{scores.shape[0]} tokens x top-{topk}")
        indices = indices.to(scores.device, torch.long)
        return scores.gather(1, indices), indices


def install(chunks: list[torch.nn.Module]) -> list[TokenRoutingReplay]:
    """Give every MoE router of this rank's model chunks a replay; returns them (router order)."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.layer_number is None:
                    raise RuntimeError("routing replay: a router without its layer number")
                module.router_replay = TokenRoutingReplay(module.layer_number - 1)
                replays.append(module.router_replay)
    return replays


def router_tokens(routed: torch.Tensor, packed: PackedMicroBatch, *, rows: int, cols: int, cp_size: int,
                  cp_rank: int, sp_size: int, sp_rank: int) -> torch.Tensor:
    """``routed (b, T, L, k)`` of a micro-batch (original columns) -> ``(tokens, L, k)`` in the order this rank's
    routers see the packed tokens (rows or concatenated, :mod:`.packing`): rows padded to ``rows`` x ``cols``
    (pipeline schedules pad micro-batches to one shape), this rank's CP columns, transposed to megatron's (s, b),
    this rank's sequence-parallel share."""
    b, t, layers, k = routed.shape
    fill = torch.arange(k, dtype=routed.dtype, device=routed.device)
    if packed.segments is not None:  # concatenated: each token's flat place in the grid, padding after it
        flat = torch.cat([routed.reshape(b * t, layers, k), fill.expand(1, layers, k)])
        gathered = flat.index_select(0, packed.dest.to(routed.device))[None]
    else:
        order = packed.order.to(routed.device)
        tc = order.shape[1]
        if tc > t:  # pack added columns (sequence parallel rounding): they are padding
            routed = torch.cat([routed, routed[:, :1].expand(b, tc - t, layers, k)], dim=1)
        gathered = routed.gather(1, order[:, :, None, None].expand(b, tc, layers, k))
        pad = torch.arange(tc, device=routed.device)[None, :] >= packed.lengths.to(routed.device)[:, None]
        gathered = torch.where(pad[:, :, None, None], fill, gathered)
    b, tc = gathered.shape[:2]
    if (rows, cols) != (b, tc):
        full = fill.repeat(rows, cols, layers, 1)
        full[:b, :tc] = gathered
        gathered = full
    local = split_for_cp(gathered, cp_size, cp_rank).transpose(0, 1)  # (s, b, L, k)
    if sp_size > 1:
        share = local.shape[0] // sp_size
        local = local[sp_rank * share:(sp_rank + 1) * share]
    return local.reshape(-1, layers, k)


def set_micro_batch(replays: list[TokenRoutingReplay], tokens: torch.Tensor | None) -> None:
    """Hand every router its layer's indices ``tokens[:, layer]`` (None: the routers choose themselves)."""
    for replay in replays:
        replay.set(None if tokens is None else tokens[:, replay.layer].contiguous())
