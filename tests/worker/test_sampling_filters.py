"""DAPO dynamic sampling and overlong reward shaping."""

import pytest
import torch
from rljob_api.enums import AdvantageEstimator
from rljob_worker.algorithms import (
    compute_outcome_advantages,
    nonzero_variance_groups,
    overlong_penalty,
    response_length_clip_ratio,
    select_groups,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.6])


def test_nonzero_variance_groups_by_hand():
    assert nonzero_variance_groups(REWARDS, 4).tolist() == [True, False, False, True]


def test_nonzero_variance_groups_rejects_ragged_batches():
    with pytest.raises(ValueError):
        nonzero_variance_groups(REWARDS[:7], 4)


def test_select_groups_on_tensors_and_lists():
    keep = torch.tensor([True, False, True])
    rows = torch.arange(12).view(6, 2)  # 3 groups of 2 rows
    assert select_groups(rows, keep, 2).tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]
    assert select_groups(list("abcdef"), keep, 2) == ["a", "b", "e", "f"]
    assert select_groups(rows, torch.zeros(3, dtype=torch.bool), 2).shape == (0, 2)
    with pytest.raises(ValueError):
        select_groups(list("abcde"), keep, 2)


def test_kept_groups_all_carry_advantage():
    keep = nonzero_variance_groups(REWARDS, 4)
    kept = select_groups(REWARDS, keep, 4)
    adv, metrics = compute_outcome_advantages(kept, 4, AdvantageEstimator.GRPO)
    assert metrics["zero_std_group_fraction"] == 0.0
    assert (adv != 0).all()


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # L = 20, buffer 4: 0 up to 16, then -1/4 per token, -factor from 20 on
    out = overlong_penalty(lengths, max_response_length=20, overlong_buffer_length=4, penalty_factor=1.0)
    assert out.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    out = overlong_penalty(lengths, max_response_length=20, overlong_buffer_length=4, penalty_factor=0.5)
    assert out.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert (out <= 0).all()


def test_overlong_penalty_without_buffer_only_hits_longer_responses():
    out = overlong_penalty(
        torch.tensor([19, 20, 21]), max_response_length=20, overlong_buffer_length=0, penalty_factor=2.0
    )
    assert out.tolist() == [0.0, 0.0, -2.0]


@pytest.mark.parametrize("buffer", [-1, 21])
def test_overlong_penalty_rejects_bad_buffers(buffer):
    with pytest.raises(ValueError):
        overlong_penalty(
            torch.tensor([5]), max_response_length=20, overlong_buffer_length=buffer, penalty_factor=1.0
        )


def test_response_length_clip_ratio():
    assert response_length_clip_ratio(torch.tensor([5, 20, 20, 3]), 20) == 0.5
    assert response_length_clip_ratio(torch.tensor([], dtype=torch.long), 20) == 0.0
    assert type(response_length_clip_ratio(torch.tensor([1]), 20)) is float
