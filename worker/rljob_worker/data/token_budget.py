"""Token-budget micro-batches (``spec.training.maxTokensPerMicroBatch``; verl's ``use_dynamic_bsz`` /
``ppo_max_token_len_per_gpu``) and the data-parallel row assignment that balances tokens.

In the rows layout the actor packs each row's real tokens to the front and cuts a micro-batch to its
longest row, so a micro-batch of ``b`` rows whose longest row has ``L`` real tokens runs a ``(b, L)``
tensor; that product is what the budget bounds (``cost="rows"``). Rows are grouped longest first (rows
of similar length share a micro-batch: little padding), so a budget of ``B`` tokens runs ``B / L`` long
rows or many more short ones where a fixed row count would run the same few either way. In the
concatenated layout (:func:`rljob_worker.megatron.packing.pack_concatenated`) a micro-batch runs its
rows' total, which is what the budget bounds then (``cost="sum"``: first-fit decreasing).

Pure functions over row lengths; the caller gathers the rows.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batch_cost(lengths: Sequence[int], rows: Sequence[int], cost: str = "rows") -> int:
    """Tokens of the tensor the model runs for ``rows``: rows x the longest of them (``"rows"``), or
    their total (``"sum"``, the concatenated layout)."""
    if cost == "sum":
        return sum(lengths[i] for i in rows)
    return len(rows) * max((lengths[i] for i in rows), default=0)


def token_budget_micro_batches(lengths: Sequence[int], max_tokens: int, min_count: int = 1,
                               cost: str = "rows") -> list[list[int]]:
    """Row indices of each micro-batch, every row exactly once.

    lengths: (N,) real tokens per row. ``cost="rows"``: rows sorted longest first are grouped while
    ``rows x longest <= max_tokens``. ``cost="sum"``: each row, longest first, joins the first
    micro-batch whose total stays within ``max_tokens`` (first-fit decreasing). A row longer than the
    budget runs alone. Then, while there are fewer than ``min_count`` micro-batches (every data-parallel rank runs as many), the one with the
    most rows is halved; a rank with fewer rows than ``min_count`` gets fewer micro-batches.
    Micro-batches come back longest first, rows inside in their original order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if cost not in ("rows", "sum"):
        raise ValueError(f"cost must be 'rows' or 'sum', got {cost!r}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups = (_first_fit(lengths, order, max_tokens) if cost == "sum"
              else _consecutive(lengths, order, max_tokens))
    while len(groups) < min_count:
        k = max(range(len(groups)), key=lambda j: len(groups[j]), default=None)
        if k is None or len(groups[k]) < 2:
            break
        g = groups[k]
        groups[k : k + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [sorted(g) for g in groups]


def _consecutive(lengths: Sequence[int], order: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows in ``order`` (longest first) grouped while rows x the group's first (longest) row fit."""
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _first_fit(lengths: Sequence[int], order: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Each row in ``order`` (longest first) into the first group whose total it keeps within budget."""
    groups: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        k = next((k for k, total in enumerate(totals) if total + lengths[i] <= max_tokens), None)
        if k is None:
            groups.append([i])
            totals.append(lengths[i])
        else:
            groups[k].append(i)
            totals[k] += lengths[i]
    return groups


def balanced_dp_order(lengths: Sequence[int], dp_size: int, mini_batches: int = 1) -> list[int]:
    """A permutation of the rows such that slicing it the trainer's way (rank r takes the r-th
    contiguous ``N / dp_size`` rows, then splits them into ``mini_batches`` contiguous parts) gives
    every rank the same number of rows and nearly the same number of tokens in every mini-batch, and
    leaves each optimizer step's set of rows as the unpermuted slicing gives it.

    lengths: (N,) real tokens per row; N divisible by ``dp_size * mini_batches``.
    Longest-processing-time first: each row, longest first, goes to the rank with the fewest tokens
    that still has room.
    """
    n = len(lengths)
    if dp_size < 1 or mini_batches < 1 or n % (dp_size * mini_batches):
        raise ValueError(f"{n} rows do not split into {dp_size} ranks x {mini_batches} mini-batches")
    per_rank, per_mini = n // dp_size, n // dp_size // mini_batches
    # rows of optimizer step j under the plain slicing: from every rank r, rows [r*per_rank + j*per_mini, +per_mini)
    slots: list[list[list[int]]] = [[[] for _ in range(mini_batches)] for _ in range(dp_size)]
    for j in range(mini_batches):
        step_rows = [r * per_rank + j * per_mini + k for r in range(dp_size) for k in range(per_mini)]
        load = [0] * dp_size
        for i in sorted(step_rows, key=lambda i: (-lengths[i], i)):
            rank = min((r for r in range(dp_size) if len(slots[r][j]) < per_mini), key=lambda r: (load[r], r))
            slots[rank][j].append(i)
            load[rank] += lengths[i]
    return [i for r in range(dp_size) for j in range(mini_batches) for i in sorted(slots[r][j])]
