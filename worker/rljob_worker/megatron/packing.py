"""Micro-batches as the model sees them: padding never reaches the model.

Two layouts:

- **rows** (:func:`pack`): each row's real tokens are packed to the front (order kept), the batch is
  cut to its longest row, the model runs plain causal attention with positions 0..n-1 (exactly HF's
  ``position_ids = cumsum(mask) - 1``), and per-token results are scattered back to the original
  columns (:func:`unpack`). Shorter rows still pay the longest row's columns.
- **concatenated** (:func:`pack_concatenated`): the rows' real tokens, one row after another, in one
  sequence of exactly their total (rounded up to ``multiple``); attention is causal within each row's
  segment (:class:`Segments`: varlen attention, RoPE positions restarting at every segment), so every
  token sees what it sees in the rows layout and no column is padding. Results come back to the
  original ``(B, T)`` grid by each token's flat destination.

:meth:`PackedMicroBatch.unpack` undoes either layout.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

CONCATENATION_VAR = "RLJOB_SEQUENCE_PACKING"


def concatenation_wanted(on_gpu: bool, dtype: torch.dtype) -> bool:
    """Whether micro-batches run concatenated where the layout allows it (no context parallelism, the local
    layer spec): ``RLJOB_SEQUENCE_PACKING=on|off``, or ``auto`` (the
    default: on a GPU in half precision, where flash attention's varlen kernel runs every segment in one
    launch; CPU runs keep rows, each segment there being its own attention call)."""
    choice = os.environ.get(CONCATENATION_VAR, "auto")
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"{CONCATENATION_VAR}={choice!r}: use auto (concatenated on a GPU in bf16/fp16), on or off")
    if choice == "auto":
        return on_gpu and dtype in (torch.bfloat16, torch.float16)
    return choice == "on"


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


def unpack(values: torch.Tensor, order: torch.Tensor, lengths: torch.Tensor, t: int,
           drop_first: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack` for per-token values ``(B, Tc, *rest)`` aligned with the packed ids.

    Positions past each row's length and (``drop_first``) position 0 become 0 (differentiable).
    """
    b, tc = values.shape[:2]
    rest = values.shape[2:]
    j = torch.arange(tc, device=values.device)
    keep = (j[None, :] >= int(drop_first)) & (j[None, :] < lengths[:, None])
    keep = keep.reshape(b, tc, *([1] * len(rest)))
    values = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    out = torch.zeros(b, max(t, int(order.max().item()) + 1), *rest, dtype=values.dtype, device=values.device)
    index = order.reshape(b, tc, *([1] * len(rest))).expand_as(values)
    return out.scatter(1, index, values)[:, :t]


@dataclass(frozen=True)
class Segments:
    """Where each row's tokens sit in a concatenated sequence: megatron's ``thd`` packed format.

    ``cu_seqlens``: ``(n + 1,) int32`` segment boundaries (a trailing padding segment included),
    ``lengths``: the ``n`` segment lengths as Python ints (kernels that loop over segments need no
    device sync), ``max_len``: the longest segment."""

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    def to(self, device) -> Segments:
        return Segments(self.cu_seqlens.to(device), self.lengths)

    def padded_to(self, total: int) -> Segments:
        """These segments and one of padding after them, ``total`` tokens in all (themselves if they fill it)."""
        pad = total - int(sum(self.lengths))
        if pad <= 0:
            return self
        end = self.cu_seqlens[-1:] + pad
        return Segments(torch.cat([self.cu_seqlens, end.to(self.cu_seqlens.dtype)]), (*self.lengths, pad))

    def seq_params(self):
        """megatron's ``PackedSeqParams`` for these segments (``qkv_format="thd"``); it carries them as
        ``.segments`` for :class:`.sdpa_attention.SDPAttention`."""
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                                 max_seqlen_q=self.max_len, max_seqlen_kv=self.max_len)
        params.segments = self
        return params


def pack_concatenated(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1):
    """The real tokens of every row, row after row, in one sequence of their total rounded up to
    ``multiple`` (padding: token 0 in a segment of its own at the end).

    input_ids, attention_mask: ``(B, T)`` (padding anywhere). Returns ``(ids (1, L), positions (1, L):
    each token's position in its row's real tokens, dest (L,) long: its flat index ``row * T + col``
    in the ``(B, T)`` grid (``B * T`` for padding), lengths (B,), segments)``. Rows without a real
    token have no segment. Bookkeeping runs on the mask's device; ids keep theirs."""
    b, t = input_ids.shape
    m = attention_mask.bool()
    lengths = m.sum(dim=1)
    dest = m.reshape(-1).nonzero().squeeze(1)  # row-major: each row's real tokens in order
    total = int(dest.numel())
    seg = [int(n) for n in lengths.tolist() if n > 0]
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    positions = torch.arange(total, device=m.device) - starts
    pad = -(-max(total, 1) // multiple) * multiple - total
    if pad:
        dest = torch.cat([dest, torch.full((pad,), b * t, dtype=dest.dtype, device=dest.device)])
        positions = torch.cat([positions, torch.arange(pad, device=positions.device)])
        seg.append(pad)
    ids = torch.nn.functional.pad(input_ids.reshape(-1), (0, 1)).index_select(0, dest.to(input_ids.device))
    cu = torch.tensor([0, *itertools.accumulate(seg)], dtype=torch.int32)
    return ids[None], positions[None], dest, lengths, Segments(cu, tuple(seg))


def unpack_concatenated(values: torch.Tensor, dest: torch.Tensor, positions: torch.Tensor, b: int, t: int,
                        drop_first: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack_concatenated` for per-token values ``(1, L, *rest)``: ``(b, t, *rest)``,
    0 where the grid had padding and (``drop_first``) at each row's first real token, as :func:`unpack`.
    Differentiable (an ``index_add`` into a scratch slot for the dropped tokens)."""
    rest = values.shape[2:]
    dump = b * t
    drop = dest >= dump
    if drop_first:
        drop = drop | (positions.reshape(-1) == 0)
    index = torch.where(drop, torch.full_like(dest, dump), dest)
    out = values.new_zeros((dump + 1, *rest)).index_add(0, index, values.reshape(-1, *rest))
    return out[:dump].reshape(b, t, *rest)


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


def token_budget_split(batch: Mapping[str, Any], max_tokens: int, concatenated: bool = False) -> list[dict[str, Any]]:
    """Micro-batches of ``batch`` whose packed tensors hold at most ``max_tokens`` tokens (rows x
    longest row; ``concatenated``: the rows' total; a longer row alone):
    :func:`rljob_worker.data.token_budget.token_budget_micro_batches` over the rows' real-token
    counts. Every row once; longest rows first."""
    from rljob_worker.data.token_budget import token_budget_micro_batches

    b = batch["input_ids"].shape[0]
    lengths = batch["attention_mask"].sum(-1).tolist()
    out = []
    for rows in token_budget_micro_batches(lengths, max_tokens, cost="sum" if concatenated else "rows"):
        idx = torch.tensor(rows, dtype=torch.long)
        out.append({
            k: (v.index_select(0, idx.to(v.device)) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b
                else v)
            for k, v in batch.items()
        })
    return out


@dataclass
class PackedMicroBatch:
    """One micro-batch as the model sees it, and what :meth:`unpack` needs to bring per-token values
    back to the batch's ``t`` columns. Rows layout: ids ``(b, Tc)`` with real tokens packed to the
    front, ``order`` their original columns. Concatenated layout (``segments`` set): ids ``(1, L)``,
    ``dest`` each token's flat index in the ``(b, t)`` grid."""

    ids: torch.Tensor
    positions: torch.Tensor
    order: torch.Tensor | None
    lengths: torch.Tensor
    t: int
    micro_batch: dict[str, Any]
    filler: bool = False  # run only to satisfy the interleaved schedule; its results are dropped
    segments: Segments | None = None
    dest: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Rows of the micro-batch (of the original grid, whatever the layout)."""
        return int(self.lengths.shape[0])

    def unpack(self, values: torch.Tensor, drop_first: bool = True) -> torch.Tensor:
        """Per-token ``values (b', Tc, *rest)`` aligned with :attr:`ids` -> ``(rows, t, *rest)`` at the
        original columns; 0 at padding and (``drop_first``: values of the token before, such as a
        log-prob) at each row's first real token."""
        if self.segments is not None:
            return unpack_concatenated(values, self.dest.to(values.device), self.positions.to(values.device),
                                       self.rows, self.t, drop_first)
        return unpack(values, self.order.to(values.device), self.lengths.to(values.device), self.t, drop_first)

    def padded_to(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(ids, positions, model keywords) padded to ``(rows, cols)`` with token 0 at the end of rows and
        columns (concatenated: ``rows`` is 1 and the padding is a segment of its own)."""
        b, tc = self.ids.shape
        ids = torch.nn.functional.pad(self.ids, (0, cols - tc, 0, rows - b))
        if self.segments is None:
            return ids, torch.arange(cols, device=ids.device).expand_as(ids), {}
        positions = torch.cat([self.positions, torch.arange(cols - tc, device=ids.device)[None]], dim=1)
        return ids, positions, {"packed_seq_params": self.segments.padded_to(cols).seq_params()}

    def padding_mask(self, rows: int, cols: int) -> torch.Tensor:
        """``(rows, cols) bool``, True where :meth:`padded_to` put padding (a filler: everywhere)."""
        if self.segments is not None:  # (1, L): the trailing padding segment's tokens have no place in the grid
            real = (self.dest < self.rows * self.t)[None]
            real = torch.nn.functional.pad(real, (0, cols - real.shape[1]))
        else:
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
