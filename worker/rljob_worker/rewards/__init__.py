"""Rewards: rule-based callables `reward(prompt, completion, ground_truth, extra) -> float`, remote
endpoints (an HTTP verifier or an OpenAI-compatible judge), and the router between them.

`resolve_reward(name)` maps a built-in name or `module.path:function` to the callable;
`score_all` scores a batch inline or in a process pool, and names the failing sample
when a reward function raises or times out; `RewardRouter` is the one face the trainer uses
(spec.reward: function or remote, and the routes of spec.reward.bySource).
"""
from rljob_worker.rewards.registry import (
    BUILTIN_REWARDS,
    NEEDS_GROUND_TRUTH,
    RewardError,
    resolve_reward,
    score_all,
)
from rljob_worker.rewards.router import DEFAULT_ROUTE, RewardRouter, Scored

__all__ = ["BUILTIN_REWARDS", "DEFAULT_ROUTE", "NEEDS_GROUND_TRUTH", "RewardError", "RewardRouter", "Scored",
           "resolve_reward", "score_all"]
