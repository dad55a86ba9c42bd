"""The bookkeeping of compiles run once each, in front of the work (rollout/compile_once.py), why never beside it,
and the run loop's part: saving the compile cache when a compile finishes."""
from __future__ import annotations

import threading

import pytest
from rljob_worker.rollout.compile_once import CompileOnce, refuse_background_compile
from rljob_worker.run_loop import RunLoop


def test_a_compile_runs_once_in_the_caller_and_is_ready_when_ensure_returns():
    jobs = CompileOnce(announce=False)
    where = []
    assert jobs.ensure(("sample", 20, 0.9), lambda: where.append(threading.current_thread()), "x") is True
    assert where == [threading.current_thread()] and jobs.done == 1 and jobs.ready(("sample", 20, 0.9))
    assert jobs.ensure(("sample", 20, 0.9), lambda: where.append(1), "x") is True and len(where) == 1
    assert not jobs.ready("greedy") and jobs.failed("greedy") is None


def test_a_failed_compile_is_recorded_and_never_retried(caplog):
    jobs = CompileOnce(announce=False)
    tries = []

    def broken():
        tries.append(1)
        raise RuntimeError("inductor: no C++ compiler\nsecond line")

    with caplog.at_level("WARNING"):
        assert jobs.ensure("k", broken, "the step") is False
        assert jobs.ensure("k", broken, "the step") is False
    assert tries == [1] and not jobs.ready("k") and jobs.done == 0
    assert jobs.failed("k") == "RuntimeError: inductor: no C++ compiler\nsecond line"
    assert [r.message for r in caplog.records if "failed" in r.message] == [
        "compiling the step failed after 0 s (RuntimeError: inductor: no C++ compiler); it keeps running uncompiled"]


def test_the_worker_refuses_the_background_switch_before_it_builds_an_engine(monkeypatch):
    import torch
    from rljob_api.enums import RolloutEngine as EngineName
    from rljob_worker.rollout.factory import make_engine

    monkeypatch.setenv("RLJOB_HF_STATIC", "force")  # the static engine on a CPU, as a GPU pod would pick it
    monkeypatch.setenv("RLJOB_COMPILE_IN_BACKGROUND", "1")
    with pytest.raises(ValueError, match="RLJOB_COMPILE_IN_BACKGROUND=1 is refused"):
        make_engine(EngineName.HF, "/no/model/is/read", dtype=torch.float32, device=torch.device("cpu"),
                    eos_token_id=1, pad_token_id=0)


def test_the_background_switch_is_refused():
    refuse_background_compile({})
    refuse_background_compile({"RLJOB_COMPILE_IN_BACKGROUND": "0"})
    with pytest.raises(ValueError, match="RLJOB_COMPILE_IN_BACKGROUND=1 is refused: a compile on another thread "
                                         "resets the process's default generators and dtype"):
        refuse_background_compile({"RLJOB_COMPILE_IN_BACKGROUND": "1"})
    with pytest.raises(ValueError, match="RLJOB_COMPILE_IN_BACKGROUND='yes': unset it"):
        refuse_background_compile({"RLJOB_COMPILE_IN_BACKGROUND": "yes"})


def test_a_compile_on_another_thread_rewinds_this_threads_generator_and_default_dtype():
    """Why the switch is refused (and why no compile runs beside other torch work): torch.compile saves the
    process's generators and default dtype when a compile starts and restores them when it ends. Random numbers
    drawn here during another thread's compile come again after it, and a dtype set here meanwhile is undone.
    The compile waits inside its backend until this thread has drawn, so the overlap is certain."""
    import torch

    inside, drawn = threading.Event(), threading.Event()

    def waiting_backend(gm, _example_inputs):
        inside.set()
        drawn.wait(30)
        return gm.forward

    def scaled(x):
        return torch.sin(x) * 3

    thread = threading.Thread(target=lambda: torch.compile(scaled, backend=waiting_backend)(torch.ones(4)))
    dtype = torch.get_default_dtype()
    torch.manual_seed(1234)
    thread.start()
    assert inside.wait(120)
    during = torch.rand(8)
    torch.set_default_dtype(torch.float64)
    drawn.set()
    thread.join(60)
    try:
        after = torch.rand(8)
        assert torch.equal(during, after)  # the same draws again: the generator was rewound
        assert torch.get_default_dtype() == dtype  # the float64 set during the compile was undone
    finally:
        torch.set_default_dtype(dtype)


class _Loop:
    """The run loop's compile bookkeeping (RunLoop's methods) over an engine stand-in."""

    _engine_compiles = RunLoop._engine_compiles
    _engine_compiles_grew = RunLoop._engine_compiles_grew

    def __init__(self, compiles):
        self.engine = type("Engine", (), {"compiles": compiles, "compile_decode": True})()


def test_the_run_loop_sees_each_finished_compile_once():
    """After each step the loop uploads the compile cache once per finished compile (a validation's sampler
    after the first step), not on every step; a failed compile uploads nothing."""
    jobs = CompileOnce(announce=False)
    loop = _Loop(jobs)
    assert loop._engine_compiles_grew() is False
    jobs.ensure("greedy", lambda: None, "a")
    assert loop._engine_compiles_grew() is True and loop._engine_compiles_grew() is False
    jobs.ensure("broken", lambda: 1 / 0, "b")
    assert loop._engine_compiles_grew() is False
    jobs.ensure("sample", lambda: None, "c")
    assert loop._engine_compiles_grew() is True


def test_a_run_without_an_engine_has_no_compiles_to_follow():
    loop = _Loop(None)
    loop.engine = None
    assert loop._engine_compiles() is None and loop._engine_compiles_grew() is False
