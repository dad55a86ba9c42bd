"""The pure context-parallel layout functions: megatron's 2*cp-chunk load balancing."""

from __future__ import annotations

import pytest
import torch
from rljob_worker.megatron.context_parallel import (
    chunk_indices,
    local_positions,
    rank_major_to_global,
    sequence_multiple,
    split_for_cp,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_split_then_reassemble_is_identity(cp, dim):
    x = torch.randn(4, 8 * cp, 3).movedim(1, dim)  # the sequence along ``dim``
    parts = [split_for_cp(x, cp, r, dim=dim) for r in range(cp)]
    assert all(p.shape[dim] == x.shape[dim] // cp for p in parts)
    assert torch.equal(rank_major_to_global(torch.cat(parts, dim=dim), cp, dim=dim), x)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_positions_are_what_split_selects(cp):
    t = 4 * cp
    for r in range(cp):
        assert torch.equal(local_positions(t, cp, r), split_for_cp(torch.arange(t), cp, r, dim=0))


def test_chunk_layout_matches_megatron_convention():
    assert [chunk_indices(2, r) for r in range(2)] == [(0, 3), (1, 2)]
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert [chunk_indices(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_work_is_balanced(cp):
    t = 16 * cp
    # a query at position p attends to p + 1 keys: every rank does the same causal work
    work = [int((local_positions(t, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work
    assert sum(work) == t * (t + 1) // 2
    covered = torch.sort(torch.cat([local_positions(t, cp, r) for r in range(cp)])).values
    assert torch.equal(covered, torch.arange(t))  # every position on exactly one rank


def test_reassembly_is_differentiable():
    x = torch.randn(2, 8, requires_grad=True)
    parts = [split_for_cp(x, 2, r, dim=1) for r in range(2)]
    y = rank_major_to_global(torch.cat(parts, dim=1), 2, dim=1)
    (y * torch.arange(8.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(8.0).expand(2, 8))


@pytest.mark.parametrize(
    "cp, sp_tp, expected",
    [(1, 1, 1), (1, 2, 2), (2, 1, 4), (4, 1, 8), (2, 2, 4), (2, 4, 8), (3, 2, 6), (2, 3, 12)],
)
def test_sequence_multiple(cp, sp_tp, expected):
    m = sequence_multiple(cp, sp_tp)
    assert m == expected
    if cp > 1:
        assert m % (2 * cp) == 0 and (m // cp) % sp_tp == 0


def test_lengths_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="multiple of 2 x contextParallelSize = 4"):
        split_for_cp(torch.zeros(1, 6), 2, 0)
    with pytest.raises(ValueError, match="cp_rank 2"):
        chunk_indices(2, 2)
