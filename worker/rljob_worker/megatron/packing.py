"""Micro-batches as the model sees them: padding never reaches the model.

Each row's real tokens are packed to the front (order kept), the batch is cut to the longest row, the
model runs plain causal attention with positions 0..n-1 (exactly HF's ``position_ids = cumsum(mask) -
1``), and per-token results are scattered back to the original columns (:func:`unpack`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1):
    """Move each row's real tokens to the front (order kept) and cut to the longest row, rounded up
    to ``multiple``. Returns (ids (B, Tc), order (B, Tc): original column of each packed token,
    lengths (B,))."""
    m = attention_mask.bool()
    t = input_ids.shape[1]
    lengths = m.sum(dim=1)
    tc = max(int(lengths.max().item()) if lengths.numel() else 1, 1)
    tc = -(-tc // multiple) * multiple
    if tc > t:  # only with multiple > 1 (sequence parallel): extra padding columns
        input_ids = torch.nn.functional.pad(input_ids, (0, tc - t))
        m = torch.nn.functional.pad(m, (0, tc - t))
    order = torch.argsort((~m).to(torch.int32), dim=1, stable=True)[:, :tc]
    return torch.gather(input_ids, 1, order), order, lengths


def unpack(values: torch.Tensor, order: torch.Tensor, lengths: torch.Tensor, t: int) -> torch.Tensor:
    """Inverse of :func:`pack` for per-token values ``(B, Tc)`` aligned with the packed ids.

    Position 0 and positions past each row's length become 0 (differentiable).
    """
    tc = values.shape[1]
    j = torch.arange(tc, device=values.device)
    keep = (j[None, :] >= 1) & (j[None, :] < lengths[:, None])
    values = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    out = torch.zeros(
        values.shape[0], max(t, int(order.max().item()) + 1), dtype=values.dtype, device=values.device
    )
    return out.scatter(1, order, values)[:, :t]


def split_micro_batches(batch: Mapping[str, Any], micro_batch_size: int) -> Iterator[dict[str, Any]]:
    b = batch["input_ids"].shape[0]
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    for start in range(0, b, micro_batch_size):
        end = min(start + micro_batch_size, b)
        yield {
            k: (v[start:end] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b else v)
            for k, v in batch.items()
        }


def token_budget_split(batch: Mapping[str, Any], max_tokens: int) -> list[dict[str, Any]]:
    """Micro-batches of ``batch`` whose packed tensors hold at most ``max_tokens`` tokens (rows x
    longest row; a longer row alone): :func:`rljob_worker.data.token_budget.token_budget_micro_batches`
    over the rows' real-token counts. Every row once; longest rows first."""
    from rljob_worker.data.token_budget import token_budget_micro_batches

    b = batch["input_ids"].shape[0]
    lengths = batch["attention_mask"].sum(-1).tolist()
    out = []
    for rows in token_budget_micro_batches(lengths, max_tokens):
        idx = torch.tensor(rows, dtype=torch.long)
        out.append({
            k: (v.index_select(0, idx.to(v.device)) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b
                else v)
            for k, v in batch.items()
        })
    return out


@dataclass
class PackedMicroBatch:
    """One micro-batch as the model sees it: ids (b, Tc) with real tokens packed to the front, and
    what :func:`unpack` needs to bring per-token values back to the batch's ``t`` columns."""

    ids: torch.Tensor
    positions: torch.Tensor
    order: torch.Tensor
    lengths: torch.Tensor
    t: int
    micro_batch: dict[str, Any]
    filler: bool = False  # run only to satisfy the interleaved schedule; its results are dropped

    def padded_to(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) padded to ``(rows, cols)`` with token 0 at the end of rows and columns."""
        b, tc = self.ids.shape
        ids = torch.nn.functional.pad(self.ids, (0, cols - tc, 0, rows - b))
        positions = torch.arange(cols, device=ids.device).expand_as(ids)
        return ids, positions

    def padding_mask(self, rows: int, cols: int) -> torch.Tensor:
        """``(rows, cols) bool``, True where :meth:`padded_to` put padding (a filler: everywhere)."""
        real = torch.arange(cols, device=self.ids.device)[None, :] < self.lengths[:, None]
        real = torch.nn.functional.pad(real, (0, 0, 0, rows - real.shape[0]))
        return torch.ones_like(real) if self.filler else ~real


def interleaving_group(num_micro_batches: int, pp: int) -> int:
    """Micro-batches per virtual-stage group for megatron's interleaved schedule, which needs
    ``pp <= group <= M`` and ``M % group`` either 0 or >= ``pp``: the smallest such group (megatron's
    default is ``pp``; a larger one only when ``pp`` leaves a short remainder)."""
    for group in range(pp, num_micro_batches + 1):
        rest = num_micro_batches % group
        if rest == 0 or rest >= pp:
            return group
    raise ValueError(f"{num_micro_batches} micro-batches cannot be interleaved over {pp} stages")
