"""DAPO's batch filters and reward shaping: dynamic sampling and the overlong penalty.

Groups are contiguous runs of group_size responses to one prompt, as in advantages.py.
"""

from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def nonzero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: which groups have at least two different rewards.

    rewards: (N,), N = G * group_size. Returns keep_mask (G,) bool: False for a group whose
    rewards are all equal (all solved or all failed), which gives zero GRPO advantages and so
    no gradient. Compared exactly (max != min), not against a tolerance.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.detach().view(-1, group_size)
    return grouped.amax(dim=-1) != grouped.amin(dim=-1)


def select_groups(
    items: torch.Tensor | Sequence[T], keep_mask: torch.Tensor, group_size: int
) -> torch.Tensor | list[T]:
    """Keep the rows of the groups marked in keep_mask.

    items: a tensor (N, ...) or a sequence of length N, N = G * group_size; keep_mask: (G,) bool.
    Returns a tensor (K * group_size, ...) for a tensor input, else a list of K * group_size
    items, K = keep_mask.sum(); order is preserved.
    """
    keep_mask = keep_mask.bool()
    if len(items) != keep_mask.numel() * group_size:
        raise ValueError(f"{len(items)} items do not match {keep_mask.numel()} groups of {group_size}")
    row_mask = keep_mask.repeat_interleave(group_size)  # (N,)
    if isinstance(items, torch.Tensor):
        return items[row_mask.to(items.device)]
    return [item for item, keep in zip(items, row_mask.tolist(), strict=True) if keep]


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_length: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment, to be added to the rewards.

    response_lengths: (N,) response token counts. With L = max_response_length and
    B = overlong_buffer_length, a response of length l gets 0 when l <= L - B, then a penalty
    falling linearly to -penalty_factor at l = L, and -penalty_factor beyond. With B = 0 only
    responses longer than L are penalised. Returns (N,) float penalties in [-penalty_factor, 0].
    """
    if not 0 <= overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"overlong_buffer_length must be in [0, {max_response_length}], got {overlong_buffer_length}"
        )
    lengths = response_lengths.detach().to(torch.float32)
    if overlong_buffer_length == 0:
        return torch.where(lengths > max_response_length, -penalty_factor, 0.0)
    exceed = lengths - (max_response_length - overlong_buffer_length)
    penalty = -exceed / overlong_buffer_length * penalty_factor
    return penalty.clamp(min=-penalty_factor, max=0.0)


def response_length_clip_ratio(response_lengths: torch.Tensor, max_response_length: int) -> float:
    """Share of responses cut off at the length limit (length >= max_response_length).

    response_lengths: (N,). Returns a python float in [0, 1]; 0.0 for an empty batch.
    """
    if response_lengths.numel() == 0:
        return 0.0
    return (response_lengths >= max_response_length).float().mean().item()
