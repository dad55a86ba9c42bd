"""Rule-based rewards as plain callables `reward(prompt, completion, ground_truth, extra) -> float`.

`resolve_reward(name)` maps a built-in name or `module.path:function` to the callable;
`score_all` scores a batch inline or in a process pool, and names the failing sample
when a reward function raises or times out.
"""
from rljob_worker.rewards.registry import (
    BUILTIN_REWARDS,
    NEEDS_GROUND_TRUTH,
    RewardError,
    resolve_reward,
    score_all,
)

__all__ = ["BUILTIN_REWARDS", "NEEDS_GROUND_TRUTH", "RewardError", "resolve_reward", "score_all"]
