"""Rewards: gsm8k / boxed / format rules, the synthetic tasks' rewards, `module:function` lookup,
and batch scoring inline and in a process pool (errors and timeouts name the sample)."""
from __future__ import annotations

import multiprocessing
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
from rljob_worker.data.synthetic import digit_sum_reward, target_token_reward
from rljob_worker.rewards import BUILTIN_REWARDS, RewardError, resolve_reward, score_all
from rljob_worker.rewards.math import (
    boxed_math_reward,
    extract_boxed,
    extract_gsm8k_answer,
    format_reward,
    gsm8k_reward,
    normalize_answer,
)

# ---------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(("completion", "expected"), [
    ("so the total is 18.\n#### 18", "18"),
    ("#### 1,234", "1,234"),
    ("####-7", "-7"),
    ("#### 3.50 dollars", "3.50"),
    ("first #### 1 then #### 2", "2"),  # the last one counts
    ("the answer is 18", None),
    ("#### none", None),
])
def test_gsm8k_extraction(completion, expected):
    assert extract_gsm8k_answer(completion) == expected


@pytest.mark.parametrize(("a", "b"), [
    ("1,234", "1234"), ("3.50", "3.5"), ("3.0", "3"), ("10.00", "10"), ("-1,000", "-1000"), (" $5 ", "5"),
    ("5\\text{ cm}", "5"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("\\tfrac12", "\\frac12"), ("x = 2.", "x=2"),
])
def test_normalisation_makes_equal_answers_equal(a, b):
    assert normalize_answer(a) == normalize_answer(b)


@pytest.mark.parametrize(("a", "b"), [("100", "1"), ("-5", "5"), ("3.05", "3.5"), ("1,234", "1.234")])
def test_normalisation_keeps_different_answers_different(a, b):
    assert normalize_answer(a) != normalize_answer(b)


@pytest.mark.parametrize(("completion", "truth", "reward"), [
    ("... #### 1,234", "1234", 1.0),
    ("... #### 1234", "#### 1,234", 1.0),  # a raw gsm8k answer as ground truth
    ("#### 3.50", "3.5", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### 5", "-5", 0.1),  # right format, wrong answer
    ("#### 1234.5", "1234", 0.1),
    ("the answer is 1234", "1234", 0.0),  # no '####': no credit
])
def test_gsm8k_reward(completion, truth, reward):
    assert gsm8k_reward("q", completion, truth, {}) == reward


# ---------------------------------------------------------------- boxed and format


@pytest.mark.parametrize(("completion", "expected"), [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\sqrt{\\frac{a}{b^{2}}}} done", "\\sqrt{\\frac{a}{b^{2}}}"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{unclosed {x}", None),
    ("no box", None),
])
def test_boxed_extraction_balances_nested_braces(completion, expected):
    assert extract_boxed(completion) == expected


@pytest.mark.parametrize(("completion", "truth", "reward"), [
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "$\\boxed{\\dfrac{1}{2}}$", 1.0),  # a boxed ground truth is unboxed first
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{2.50}", "2.5", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("1/2", "\\frac{1}{2}", 0.0),
])
def test_boxed_math_reward(completion, truth, reward):
    assert boxed_math_reward("q", completion, truth, {}) == reward


@pytest.mark.parametrize(("completion", "reward"), [
    ("\\boxed{x}", 1.0), ("#### 3", 1.0), ("3", 0.0), ("\\boxed{", 0.0), ("#### x", 0.0),
])
def test_format_reward(completion, reward):
    assert format_reward("q", completion, "anything", {}) == reward


# ---------------------------------------------------------------- synthetic tasks


def test_target_token_reward_counts_against_the_response_budget():
    assert target_token_reward("12=", "7777", "7", {"max_response_length": 4}) == 1.0
    assert target_token_reward("12=", "7717", "7", {"max_response_length": 4}) == 0.75
    assert target_token_reward("12=", "77", "7", {"max_response_length": 4}) == 0.5  # stopping early never pays
    assert target_token_reward("12=", "777777", "7", {"max_response_length": 4}) == 1.0  # only the first 4 count
    assert target_token_reward("12=", "7070", "7", {}) == 0.5  # no budget: the completion's length
    assert target_token_reward("12=", "", "7", {}) == 0.0


def test_digit_sum_reward_looks_at_the_first_token_only():
    assert digit_sum_reward("7+5=", "2", "2", {}) == 1.0
    assert digit_sum_reward("7+5=", "21", "2", {}) == 1.0
    assert digit_sum_reward("7+5=", "12", "2", {}) == 0.0
    assert digit_sum_reward("7+5=", "", "2", {}) == 0.0


# ---------------------------------------------------------------- resolve_reward


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `my_rewards_<id>` in tmp_path, importable (also by pool workers) through sys.path."""
    name = f"my_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import time

        NOT_CALLABLE = 3

        def exact(prompt, completion, ground_truth, extra):
            return 1.0 if completion.strip() == ground_truth else 0.0

        def fails_on_b(prompt, completion, ground_truth, extra):
            if completion == "b":
                raise ValueError("cannot score b")
            return 1

        def sleepy(prompt, completion, ground_truth, extra):
            if completion == "slow":
                time.sleep(float(extra["sleep"]))
            return 0.5

        def spins(prompt, completion, ground_truth, extra):
            while completion == "slow":
                pass
            return 0.5

        def retries(prompt, completion, ground_truth, extra):
            # a retry loop that catches Exception: the alarm must not be swallowed by it
            deadline = time.monotonic() + float(extra.get("sleep", 0))
            while completion == "slow" and time.monotonic() < deadline:
                try:
                    time.sleep(0.05)
                except Exception:
                    pass
            return 0.5

        def own_alarm(prompt, completion, ground_truth, extra):
            # sets its own SIGALRM handler and timer: rljob's alarm never fires
            import signal
            if completion == "slow":
                signal.signal(signal.SIGALRM, lambda *a: None)
                signal.setitimer(signal.ITIMER_REAL, 30)
                time.sleep(float(extra["sleep"]))
            return 0.5
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_builtin_names_resolve_to_the_functions():
    assert resolve_reward("gsm8k") is gsm8k_reward
    assert resolve_reward("math-boxed") is boxed_math_reward
    assert set(BUILTIN_REWARDS) == {"gsm8k", "math-boxed", "format", "target-token", "digit-sum", "tool-secret"}


def test_builtin_reward_names_of_the_api_are_the_registrys():
    """Validation refuses a reward name the worker cannot resolve from rljob_api's list: keep it the registry's."""
    from rljob_api.models import BUILTIN_REWARD_NAMES

    assert sorted(BUILTIN_REWARD_NAMES) == sorted(BUILTIN_REWARDS)


def test_tool_secret_reward_scores_the_answer_after_a_successful_call():
    fn = resolve_reward("tool-secret")
    called = {"trajectory": {"tool_calls": [{"outcome": "ok"}]}}
    assert fn("12=", "7", "7", called) == 1.0 and fn("12=", "3", "7", called) == 0.0
    assert fn("12=", "7", "7", {"trajectory": {"tool_calls": []}}) == 0.0  # a guess
    assert fn("12=", "7", "7", {"trajectory": {"tool_calls": [{"outcome": "timeout"}]}}) == 0.0
    assert fn("12=", "7", "7", {}) == 1.0  # single-turn rollouts: the answer alone


def test_user_function_by_module_path(user_module):
    fn = resolve_reward(f"{user_module}:exact")
    assert fn("p", " 42 ", "42", {}) == 1.0 and fn("p", "41", "42", {}) == 0.0


@pytest.mark.parametrize(("name", "message"), [
    ("no-such-reward", r"spec\.reward\.function 'no-such-reward' is not a built-in reward \(digit-sum, format"),
    ("no_such_module_xyz:f", r"spec\.reward\.function 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"),
    ("{mod}:missing", r"spec\.reward\.function '{mod}:missing': module '{mod}' has no function 'missing'"),
    ("{mod}:NOT_CALLABLE", r"has no function 'NOT_CALLABLE'"),
])
def test_bad_reward_names_name_the_setting(user_module, name, message):
    with pytest.raises(RewardError, match=message.format(mod=user_module)):
        resolve_reward(name.format(mod=user_module))


def test_a_module_that_raises_on_import_is_a_reward_error(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"spec\.reward\.function.*cannot import.*boom at import"):
        resolve_reward("broken_rewards_mod:f")


# ---------------------------------------------------------------- score_all


def batch(completions, **extra):
    n = len(completions)
    return [f"prompt {i}" for i in range(n)], completions, ["a"] * n, [dict(extra) for _ in range(n)]


def test_score_all_inline():
    assert score_all(resolve_reward("format"), *batch(["#### 1", "x", "\\boxed{2}"])) == [1.0, 0.0, 1.0]


def test_score_all_names_the_failing_sample(user_module):
    fn = resolve_reward(f"{user_module}:fails_on_b")
    with pytest.raises(RewardError, match=r"sample 2 \(prompt 'prompt 2'\).*cannot score b"):
        score_all(fn, *batch(["a", "a", "b", "a"]))


def test_score_all_rejects_non_numbers():
    with pytest.raises(RewardError, match="sample 0"):
        score_all(lambda p, c, t, e: None, *batch(["a"]))


@pytest.fixture
def pool():
    executor = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    yield executor
    executor.shutdown(wait=False, cancel_futures=True)
    # a timed-out reward may still be sleeping, and the pool may have started a replacement for it
    for proc in multiprocessing.active_children():
        proc.kill()
        proc.join(timeout=10)


def test_score_all_in_a_process_pool(user_module, pool):
    assert score_all(resolve_reward(f"{user_module}:exact"), *batch(["a", "b", " a"]), pool=pool) == [1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match=r"sample 1 .*cannot score b"):
        score_all(resolve_reward(f"{user_module}:fails_on_b"), *batch(["a", "b"]), pool=pool)


def test_score_all_times_out_a_hanging_reward_with_its_index(user_module, pool):
    fn = resolve_reward(f"{user_module}:sleepy")
    assert score_all(fn, *batch(["fast"], sleep=0), pool=pool, timeout_s=30) == [0.5]  # the pool is warm
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"timed out after 0\.5s on sample 1 \(spec\.reward\.timeoutSeconds\)"):
        score_all(fn, *batch(["fast", "slow", "fast"], sleep=60), pool=pool, timeout_s=0.5)
    assert time.monotonic() - start < 10  # an error, not a hang


@pytest.mark.parametrize("hang", ["sleepy", "spins"])
def test_score_all_inline_times_out_a_hanging_reward_too(user_module, hang):
    """numWorkers 0 (the default) scores inline: timeoutSeconds holds there as well, for a reward that
    sleeps and for one that spins in Python, and the alarm is gone afterwards."""
    import signal

    fn = resolve_reward(f"{user_module}:{hang}")
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"timed out after 0\.5s on sample 1 \(prompt 'prompt 1'; spec\.reward\.timeoutSeconds\)"):
        score_all(fn, *batch(["fast", "slow", "fast"], sleep=60), timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert score_all(fn, *batch(["fast"], sleep=0), timeout_s=0.5) == [0.5]


@pytest.mark.parametrize("reward, words", [
    ("retries", r"timed out after 0\.5s on sample 1"),
    ("own_alarm", (r"timed out on sample 1 \(prompt 'prompt 1'\): it ran 1\.\ds, over spec\.reward\.timeoutSeconds 0\.5s, "
                   r"and the alarm did not stop it .*numWorkers > 0 bounds every reward")),
])
def test_score_all_inline_a_reward_that_beats_the_alarm_still_fails_as_timed_out(user_module, reward, words):
    """numWorkers 0: a reward that catches Exception in a retry loop, or sets its own SIGALRM, used to run past
    timeoutSeconds and score. The first is interrupted now; the second is caught when it returns (1.2 s > 0.5 s)."""
    import signal

    fn = resolve_reward(f"{user_module}:{reward}")
    with pytest.raises(RewardError, match=words):
        score_all(fn, *batch(["fast", "slow", "fast"], sleep=1.2), timeout_s=0.5)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_by_source_route_no_row_uses_is_named_with_the_sources_there_are():
    """A bySource key that is no row's data_source (a typo, 'math' for 'lighteval/MATH') silently left those rows to
    spec.reward; the trainer now logs this line at start-up. Keys that match stay unnamed."""
    from rljob_api.models import RewardSpec
    from rljob_worker.rewards import RewardRouter

    router = RewardRouter(RewardSpec.model_validate({"function": "gsm8k", "bySource": {
        "openai/gsm8k": {"function": "gsm8k"}, "math": {"function": "math-boxed"}, "Math": {"function": "format"}}}),
        environ={})
    line = router.unused_routes_warning({"openai/gsm8k", "lighteval/MATH"})
    assert line.startswith("spec.reward.bySource 'Math', 'math': no row of data.trainFiles / valFiles"), line
    assert "scored by spec.reward" in line and "the data's sources are 'lighteval/MATH', 'openai/gsm8k'" in line, line
    assert "'openai/gsm8k'," not in line.split(":")[0]
    assert router.unused_routes_warning({"openai/gsm8k", "math", "Math", "other"}) is None
    assert RewardRouter(RewardSpec.model_validate({"function": "gsm8k"}), environ={}).unused_routes_warning(set()) is None
