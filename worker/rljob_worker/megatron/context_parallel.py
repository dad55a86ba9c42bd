"""Context parallelism (CP): each CP rank runs a load-balanced share of every (packed) sequence.

megatron's convention, which its RoPE (``get_pos_emb_on_this_cp_rank``) and TE attention follow:
a sequence of length ``T`` (a multiple of ``2 * cp``) is cut into ``2 * cp`` chunks of
``c = T / (2 * cp)`` tokens, and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that
order. Under causal attention chunk ``i`` costs about ``i + 1/2`` units (its queries see ``i * c +
j`` keys), so every rank does the same work: ``r + (2 * cp - 1 - r) + 1 = 2 * cp``.

"Rank-major" order is the concatenation of the ranks' local sequences in rank order (what an
all-gather over the CP group returns); :func:`rank_major_to_global` puts it back in sequence order.

The pure functions (no communication) are shape functions over one dim ``dim``; :func:`gather_from_cp`
is the differentiable all-gather used both for attention keys/values and for reassembling per-token
outputs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def sequence_multiple(cp: int, sp_tp: int = 1) -> int:
    """What the packed length must be a multiple of: ``2 * cp`` chunks (cp > 1) whose per-rank half,
    ``T / cp`` tokens, sequence parallelism splits again over ``sp_tp`` TP ranks (1 without SP)."""
    if cp < 1 or sp_tp < 1:
        raise ValueError(f"cp and sp_tp must be >= 1, got cp={cp}, sp_tp={sp_tp}")
    if cp == 1:
        return sp_tp
    return math.lcm(2 * cp, cp * sp_tp)


def chunk_indices(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(t: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """``(t / cp_size,) long``: the global positions of this rank's tokens, in local order."""
    if cp_size == 1:
        return torch.arange(t, device=device)
    c = _chunk_len(t, cp_size)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_indices(cp_size, cp_rank)]
    )


def split_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of ``x``: size ``T`` along ``dim`` -> ``T / cp_size`` (chunks ``r`` and
    ``2 cp - 1 - r`` concatenated). Identity for ``cp_size == 1``; a view-free copy otherwise."""
    if cp_size == 1:
        return x
    c = _chunk_len(x.shape[dim], cp_size)
    chunks = [x.narrow(dim, i * c, c) for i in chunk_indices(cp_size, cp_rank)]
    return torch.cat(chunks, dim=dim)


def rank_major_to_global(x: torch.Tensor, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Reorder the rank-major concatenation of all ranks' shares (size ``T`` along ``dim``) into
    sequence order. Inverse of ``cat([split_for_cp(x, cp, r, dim) for r in range(cp)], dim)``.
    Differentiable (an ``index_select``)."""
    if cp_size == 1:
        return x
    t = x.shape[dim]
    return x.index_select(dim, _global_from_rank_major(t, cp_size, x.device))


def gather_from_cp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """All-gather this rank's share ``x`` (size ``T / cp`` along ``dim``) over the CP ``group``
    and return the full sequence (size ``T``) in sequence order. Identity for a group of one.

    Backward: the incoming gradient is summed over the CP ranks and each rank keeps its own share
    (megatron's sequence-parallel gather). For keys/values that is exactly the chain rule: the
    gradient of a rank's K/V is the sum of what every rank's queries send back. For a per-token
    output that every CP rank turns into the *same* loss, the sum is ``cp`` times the gradient,
    which megatron's DDP (and the CPU path) cancels by averaging parameter gradients over DP x CP,
    the same bookkeeping as megatron's own "loss x cp" convention.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    cp_size = 1 if group is None else dist.get_world_size(group)
    if cp_size == 1:
        return x
    first = x.movedim(dim, 0).contiguous()
    gathered = gather_from_sequence_parallel_region(first, tensor_parallel_output_grad=True, group=group)
    return rank_major_to_global(gathered, cp_size, dim=0).movedim(0, dim)


def _chunk_len(t: int, cp_size: int) -> int:
    if t % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {t} is not a multiple of 2 x contextParallelSize = {2 * cp_size} "
            "(pad the packed batch first)"
        )
    return t // (2 * cp_size)


def _global_from_rank_major(t: int, cp_size: int, device=None) -> torch.Tensor:
    """``(t,) long``: for each global position, its index in the rank-major layout."""
    c = _chunk_len(t, cp_size)
    slot = torch.empty(2 * cp_size, dtype=torch.long)  # chunk index -> slot in rank-major layout
    for r in range(cp_size):
        first, second = chunk_indices(cp_size, r)
        slot[first], slot[second] = 2 * r, 2 * r + 1
    idx = (slot[:, None] * c + torch.arange(c)[None, :]).reshape(-1)
    return idx.to(device)
