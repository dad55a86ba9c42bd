"""Pure tensor plumbing between rollouts and the actor: padding, masks, slicing.

A training batch is a dict of tensors, all (N, T) with T = P + R:
    input_ids       prompt left-padded to P, then the response right-padded to R
    attention_mask  1 on real tokens (prompt and response), 0 on padding
    response_mask   1 on response tokens the loss sees, 0 elsewhere: padding, the prompt, and in multi-turn
                    rollouts the tool responses and template tokens the model did not sample (their
                    loss_mask is 0), which are in the context (attention_mask 1) but carry no loss,
                    advantage, KL or entropy and count in no normaliser
Per-token quantities (logprobs, advantages) use the same (N, T) layout, aligned with
input_ids: column t holds the value for token t.
"""
from __future__ import annotations

import torch


def pad_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
              loss_masks: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Build input_ids / attention_mask / response_mask (N, P + R) from token lists (N each). ``loss_masks``
    (N, each as long as its response): 0 on response tokens the model did not sample (agent_loop)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts vs {len(response_ids)} responses")
    n = len(prompt_ids)
    p_len = max(len(p) for p in prompt_ids)
    r_len = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((n, p_len + r_len), pad_id, dtype=torch.long)
    attention = torch.zeros((n, p_len + r_len), dtype=torch.long)
    response = torch.zeros((n, p_len + r_len), dtype=torch.long)
    if loss_masks is not None and [len(m) for m in loss_masks] != [len(r) for r in response_ids]:
        raise ValueError("each loss mask must be as long as its response")
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, p_len - len(p):p_len] = torch.tensor(p, dtype=torch.long)
        attention[i, p_len - len(p):p_len] = 1
        if r:
            input_ids[i, p_len:p_len + len(r)] = torch.tensor(r, dtype=torch.long)
            attention[i, p_len:p_len + len(r)] = 1
            response[i, p_len:p_len + len(r)] = 1 if loss_masks is None else torch.tensor(loss_masks[i], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "response_mask": response}


def scatter_response_values(values: list[list[float]], response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response lists (N of len R_i) -> (N, T) float tensor placed on the response positions."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i, row in enumerate(values):
        cols = response_mask[i].nonzero().flatten()
        if len(row) != len(cols):
            raise ValueError(f"row {i}: {len(row)} values for {len(cols)} response tokens")
        if len(row):
            out[i, cols] = torch.tensor(row, dtype=torch.float32)
    return out


def slice_batch(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in batch.items()}


def take_rows(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """The rows ``rows`` of every (N, ...) tensor, in that order."""
    idx = torch.tensor(rows, dtype=torch.long)
    return {k: v.index_select(0, idx) for k, v in batch.items()}


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Split along N into `parts` equal contiguous pieces (N must divide)."""
    n = next(iter(batch.values())).shape[0]
    if n % parts:
        raise ValueError(f"cannot split {n} rows into {parts} equal parts")
    size = n // parts
    return [slice_batch(batch, i * size, (i + 1) * size) for i in range(parts)]


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop columns that are padding in every row (mini-batches of short responses run faster)."""
    used = batch["attention_mask"].bool().any(dim=0).nonzero().flatten()
    if len(used) == 0:
        return batch
    lo, hi = int(used[0]), int(used[-1]) + 1
    return {k: (v[:, lo:hi] if v.dim() >= 2 and v.shape[1] == batch["attention_mask"].shape[1] else v)
            for k, v in batch.items()}
