"""Batch layout between rollout and actor: left-padded prompts, right-padded responses, masks."""
from __future__ import annotations

import pytest
import torch
from rljob_worker.data.batching import (
    pad_batch,
    scatter_response_values,
    slice_batch,
    split_batch,
    trim_padding,
)

PAD = 0
PROMPTS = [[11, 12], [21, 22, 23], [31]]
RESPONSES = [[13, 14, 15], [24], []]


def test_pad_batch_layout_by_hand():
    b = pad_batch(PROMPTS, RESPONSES, PAD)
    # P = 3 prompt columns (left-padded), R = 3 response columns (right-padded)
    assert b["input_ids"].tolist() == [
        [0, 11, 12, 13, 14, 15],
        [21, 22, 23, 24, 0, 0],
        [0, 0, 31, 0, 0, 0],
    ]
    assert b["attention_mask"].tolist() == [
        [0, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0],
        [0, 0, 1, 0, 0, 0],
    ]
    assert b["response_mask"].tolist() == [
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    assert all(v.dtype == torch.long for v in b.values())


def test_pad_batch_with_only_empty_responses_keeps_one_response_column():
    b = pad_batch([[5, 6]], [[]], PAD)
    assert b["input_ids"].tolist() == [[5, 6, 0]]
    assert b["response_mask"].tolist() == [[0, 0, 0]]


def test_pad_batch_uses_the_pad_id_and_rejects_mismatched_lengths():
    b = pad_batch([[5], [6, 7]], [[8], [9]], pad_id=99)
    assert b["input_ids"].tolist() == [[99, 5, 8], [6, 7, 9]]
    with pytest.raises(ValueError, match="2 prompts vs 1 responses"):
        pad_batch([[1], [2]], [[3]], PAD)


def test_scatter_response_values_places_values_on_response_tokens():
    b = pad_batch(PROMPTS, RESPONSES, PAD)
    out = scatter_response_values([[-0.5, -1.0, -1.5], [-2.0], []], b["response_mask"])
    assert out.dtype == torch.float32
    assert out.tolist() == [
        [0, 0, 0, -0.5, -1.0, -1.5],
        [0, 0, 0, -2.0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    with pytest.raises(ValueError, match="row 1: 2 values for 1 response tokens"):
        scatter_response_values([[-0.5, -1.0, -1.5], [-2.0, -3.0], []], b["response_mask"])


def numbered_batch(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(n * 3).view(n, 3), "advantages": torch.arange(n, dtype=torch.float32)}


def test_slice_and_split_are_contiguous_along_rows():
    b = numbered_batch(6)
    assert slice_batch(b, 2, 4)["input_ids"].tolist() == [[6, 7, 8], [9, 10, 11]]
    parts = split_batch(b, 3)
    assert len(parts) == 3
    assert [p["advantages"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), b["input_ids"])
    with pytest.raises(ValueError, match="cannot split 6 rows into 4"):
        split_batch(b, 4)


def test_trim_padding_drops_all_padding_columns_only():
    b = pad_batch([[1, 2], [3]], [[4, 5], [6]], PAD)
    # the same rows inside a wider batch: 2 all-padding columns before, 3 after
    wide = {k: torch.cat([torch.zeros(2, 2, dtype=v.dtype), v, torch.zeros(2, 3, dtype=v.dtype)], dim=1)
            for k, v in b.items()}
    wide["advantages"] = scatter_response_values([[1.0, 1.0], [-1.0]], wide["response_mask"])
    wide["group"] = torch.tensor([0, 1])  # not (N, T): untouched
    trimmed = trim_padding(wide)
    for key in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(trimmed[key], b[key]), key
    assert trimmed["advantages"].tolist() == [[0, 0, 1, 1], [0, 0, -1, 0]]
    assert torch.equal(trimmed["group"], wide["group"])
    # already tight: unchanged
    assert all(torch.equal(trim_padding(b)[k], b[k]) for k in b)
