"""The bookkeeping of compiles that run beside the work (rollout/background_compile.py), without torch."""
from __future__ import annotations

import threading

import pytest
from rljob_worker.rollout.background_compile import BackgroundCompiles, background_default


def test_a_background_compile_runs_once_on_its_own_thread_and_reports_ready():
    gate, ran = threading.Event(), []
    jobs = BackgroundCompiles(background=True, announce=False)

    def compile_it():
        ran.append(threading.current_thread().name)
        assert gate.wait(30)

    assert jobs.ensure("greedy", compile_it, "the step") is False  # started, not ready: the caller goes on
    assert jobs.ensure("greedy", compile_it, "the step") is False  # never started twice
    assert not jobs.ready("greedy") and jobs.running == ["greedy"] and jobs.done == 0
    assert jobs.wait(timeout=0.05) is False  # a bounded wait returns while it runs
    gate.set()
    assert jobs.wait(timeout=30) and jobs.ready("greedy") and jobs.done == 1 and jobs.running == []
    assert ran == ["compile the step"]
    assert jobs.ensure("greedy", compile_it, "the step") is True and len(ran) == 1


def test_a_foreground_compile_is_ready_when_ensure_returns():
    jobs = BackgroundCompiles(background=False, announce=False)
    where = []
    assert jobs.ensure(("sample", 20, 0.9), lambda: where.append(threading.current_thread()), "x") is True
    assert where == [threading.current_thread()] and jobs.done == 1


def test_a_failed_compile_is_recorded_and_never_retried(caplog):
    jobs = BackgroundCompiles(background=True, announce=False)
    tries = []

    def broken():
        tries.append(1)
        raise RuntimeError("inductor: no C++ compiler\nsecond line")

    with caplog.at_level("WARNING"):
        jobs.ensure("k", broken, "the step")
        assert jobs.wait(timeout=30)
        assert jobs.ensure("k", broken, "the step") is False
    assert tries == [1] and not jobs.ready("k") and jobs.done == 0
    assert jobs.failed("k") == "RuntimeError: inductor: no C++ compiler\nsecond line"
    assert [r.message for r in caplog.records if "failed" in r.message] == [
        "compiling the step failed after 0 s (RuntimeError: inductor: no C++ compiler); it keeps running uncompiled"]


def test_the_env_switch_reads_0_and_1_and_refuses_the_rest():
    assert not background_default({}) and background_default({"RLJOB_COMPILE_IN_BACKGROUND": "1"})
    assert not background_default({"RLJOB_COMPILE_IN_BACKGROUND": "0"})
    with pytest.raises(ValueError, match="RLJOB_COMPILE_IN_BACKGROUND='yes': set 1"):
        background_default({"RLJOB_COMPILE_IN_BACKGROUND": "yes"})
