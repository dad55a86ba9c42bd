"""Reward lookup and batch scoring."""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from rljob_worker.data.synthetic import digit_sum_reward, target_token_reward, tool_secret_reward
from rljob_worker.rewards.math import boxed_math_reward, format_reward, gsm8k_reward
from rljob_worker.user_code import import_function

RewardFn = Callable[[str, str, str, dict], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "math-boxed": boxed_math_reward,
    "format": format_reward,
    "target-token": target_token_reward,
    "digit-sum": digit_sum_reward,
    "tool-secret": tool_secret_reward,
}


class RewardError(RuntimeError):
    pass


def resolve_reward(name: str) -> RewardFn:
    """A built-in name or `module.path:function`. Raises RewardError naming spec.reward.function."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise RewardError(
            f"spec.reward.function {name!r} is not a built-in reward ({', '.join(sorted(BUILTIN_REWARDS))}) "
            "nor module.path:function")
    return import_function(name, "spec.reward.function", RewardError)


# Built-in rewards that score against reward_model.ground_truth (a custom function may or may not).
NEEDS_GROUND_TRUTH = frozenset({"gsm8k", "math-boxed", "target-token", "digit-sum", "tool-secret"})


def _score_one(fn: RewardFn, prompt: str, completion: str, truth: str, extra: dict) -> float:
    return float(fn(prompt, completion, truth, extra))


class _Timeout(BaseException):  # not an Exception: a reward's `except Exception` retry loop must not swallow it
    def __init__(self, elapsed_s: float | None = None):
        super().__init__(elapsed_s)
        self.elapsed_s = elapsed_s


def _score_inline(fn: RewardFn, args: tuple, timeout_s: float) -> float:
    """Score in this process under an alarm (main thread only: where signals are delivered), so a
    hanging reward fails the step instead of stalling the job forever."""
    if not (timeout_s and timeout_s > 0 and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()):
        return _score_one(fn, *args)

    def on_alarm(_signum, _frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        value = _score_one(fn, *args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.monotonic() - start
    if elapsed > timeout_s:  # the alarm did not stop it (swallowed, or the reward set its own SIGALRM)
        raise _Timeout(elapsed)
    return value


def score_all(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    ground_truths: Sequence[str],
    extras: Sequence[dict],
    *,
    pool: ProcessPoolExecutor | None = None,
    timeout_s: float = 30.0,
) -> list[float]:
    """Score every sample; raises RewardError naming the first sample that failed or timed out."""
    args = list(zip(prompts, completions, ground_truths, extras))
    if pool is None:
        out = []
        for i, (p, c, t, e) in enumerate(args):
            try:
                out.append(_score_inline(fn, (p, c, t, e), timeout_s))
            except _Timeout as late:
                if late.elapsed_s is not None:
                    raise RewardError(
                        f"reward function timed out on sample {i} (prompt {p[:60]!r}): it ran {late.elapsed_s:.1f}s, "
                        f"over spec.reward.timeoutSeconds {timeout_s}s, and the alarm did not stop it (the reward "
                        "catches it or sets its own SIGALRM); spec.reward.numWorkers > 0 bounds every reward") from None
                raise RewardError(f"reward function timed out after {timeout_s}s on sample {i} "
                                  f"(prompt {p[:60]!r}; spec.reward.timeoutSeconds)") from None
            except Exception as exc:
                raise RewardError(f"reward function failed on sample {i} (prompt {p[:60]!r}): {exc!r}") from exc
        return out
    futures = [pool.submit(_score_one, fn, p, c, t, e) for p, c, t, e in args]
    out = []
    for i, fut in enumerate(futures):
        try:
            out.append(fut.result(timeout=timeout_s))
        except FutureTimeout:
            raise RewardError(f"reward function timed out after {timeout_s}s on sample {i} "
                              f"(spec.reward.timeoutSeconds)") from None
        except Exception as exc:
            raise RewardError(f"reward function failed on sample {i} (prompt {args[i][0][:60]!r}): {exc!r}") from exc
    return out
