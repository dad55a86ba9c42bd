"""Token-budget micro-batches and the token-balanced data-parallel row order (pure functions)."""

from __future__ import annotations

import random

import pytest
from rljob_worker.data.token_budget import balanced_dp_order, micro_batch_cost, token_budget_micro_batches


def test_hand_computed_grouping():
    lengths = [100, 30, 400, 90, 30, 200]
    # longest first, budget 400: [400] (2 x 400 > 400); [200, 100] (2 x 200 = 400); 90 would make
    # 3 x 200 = 600, so [90, 30, 30] (3 x 90 = 270)
    assert token_budget_micro_batches(lengths, 400) == [[2], [0, 5], [1, 3, 4]]


def test_every_row_once_and_within_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(50, 1200)
        mbs = token_budget_micro_batches(lengths, budget)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
        for mb in mbs:
            assert micro_batch_cost(lengths, mb) <= budget or len(mb) == 1  # a too-long row runs alone


def test_short_rows_share_a_micro_batch_long_rows_do_not():
    lengths = [2000] * 4 + [100] * 40
    mbs = token_budget_micro_batches(lengths, 4096)
    assert [len(mb) for mb in mbs] == [2, 2, 40]


def test_min_count_splits_the_largest_micro_batch():
    mbs = token_budget_micro_batches([10] * 8, 1000, min_count=3)
    assert len(mbs) == 3 and sorted(i for mb in mbs for i in mb) == list(range(8))
    assert token_budget_micro_batches([10, 10], 1000, min_count=5) == [[0], [1]]  # cannot go below one row


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_micro_batches([1], 0)


def test_balanced_dp_order_keeps_steps_and_balances_tokens():
    rng = random.Random(1)
    dp, minis, n = 4, 2, 64
    lengths = [rng.choice([50, 2000]) for _ in range(n)]
    perm = balanced_dp_order(lengths, dp, minis)
    assert sorted(perm) == list(range(n))
    per_rank, per_mini = n // dp, n // dp // minis

    def step_rows(order, j):
        return sorted(order[r * per_rank + j * per_mini + k] for r in range(dp) for k in range(per_mini))

    identity = list(range(n))
    for j in range(minis):
        assert step_rows(perm, j) == step_rows(identity, j)  # same rows in each optimizer step
        tokens = [sum(lengths[perm[r * per_rank + j * per_mini + k]] for k in range(per_mini)) for r in range(dp)]
        plain = [sum(lengths[r * per_rank + j * per_mini + k] for k in range(per_mini)) for r in range(dp)]
        assert max(tokens) - min(tokens) <= 2000 - 50  # within one row's difference
        assert max(tokens) - min(tokens) <= max(plain) - min(plain)


def test_balanced_dp_order_refuses_uneven_split():
    with pytest.raises(ValueError, match="do not split"):
        balanced_dp_order([1] * 10, 4)



def test_the_gpu_default_never_runs_a_larger_tensor_than_row_micro_batches():
    """The budget a GPU job gets with training.maxTokensPerMicroBatch unset (microBatchSizePerGpu full rows,
    rljob_api.validation.actor_token_budget_in_effect): whatever the lengths, a micro-batch's rows x longest is
    at most what microBatchSizePerGpu full rows run, in no more micro-batches than rows of microBatchSizePerGpu."""
    rng = random.Random(5)
    for _ in range(50):
        mbs, row = rng.randint(1, 8), 3072
        lengths = [rng.randint(1, row) for _ in range(rng.randint(1, 64))]
        groups = token_budget_micro_batches(lengths, mbs * row)
        assert all(micro_batch_cost(lengths, g) <= mbs * row for g in groups)
        assert len(groups) <= -(-len(lengths) // mbs)


def test_concatenated_micro_batches_fill_first_fit_by_total():
    lengths = [100, 30, 400, 90, 30, 200]
    # total <= 400, longest first: 400 alone; 200 then 100 and 90 (390); 30 -> 200's bin is 390 + 30 > 400, new
    assert token_budget_micro_batches(lengths, 400, cost="sum") == [[2], [0, 3, 5], [1, 4]]
    assert micro_batch_cost(lengths, [0, 3, 5], cost="sum") == 390


def test_concatenated_budget_covers_every_row_once_within_its_total():
    """Whatever the lengths, every row once and no micro-batch over the budget (a longer row alone); never more
    micro-batches than the rows layout needs for the same budget (a total never exceeds rows x longest)."""
    rng = random.Random(1)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(50, 1200)
        mbs = token_budget_micro_batches(lengths, budget, cost="sum")
        assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
        assert all(micro_batch_cost(lengths, mb, cost="sum") <= budget or len(mb) == 1 for mb in mbs)
        assert len(mbs) <= len(token_budget_micro_batches(lengths, budget))


def test_an_unknown_cost_is_refused():
    with pytest.raises(ValueError, match="cost must be 'rows' or 'sum'"):
        token_budget_micro_batches([1], 10, cost="tokens")
