"""The bookkeeping of compiles run once each, in front of the work or beside it (rollout/background_compile.py), and
the run loop's part: saving the compile cache when one finishes, waiting for one at the end."""
from __future__ import annotations

import threading

import pytest
from rljob_worker.rollout.background_compile import BackgroundCompiles, background_default
from rljob_worker.run_loop import RunLoop


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


def test_a_run_compiles_in_front_and_refuses_the_background_switch():
    assert not background_default({}) and not background_default({"RLJOB_COMPILE_IN_BACKGROUND": "0"})
    with pytest.raises(ValueError, match="RLJOB_COMPILE_IN_BACKGROUND=1 is refused: a compile on another thread "
                                         "resets the process's default generators and dtype"):
        background_default({"RLJOB_COMPILE_IN_BACKGROUND": "1"})
    with pytest.raises(ValueError, match="RLJOB_COMPILE_IN_BACKGROUND='yes': unset it"):
        background_default({"RLJOB_COMPILE_IN_BACKGROUND": "yes"})


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
    """The run loop's compile bookkeeping (RunLoop's methods) over an engine stand-in and a cache-save counter."""

    _background_compiles = RunLoop._background_compiles
    _background_compiles_grew = RunLoop._background_compiles_grew
    _finish_background_compiles = RunLoop._finish_background_compiles

    def __init__(self, compiles):
        self.engine = type("Engine", (), {"compiles": compiles, "compile_decode": True})()
        self.is_main, self.saves = True, 0

    def _save_compile_cache(self):
        self.saves += 1


def test_a_run_saves_the_compile_cache_when_a_compile_finishes_and_waits_for_one_at_its_end(capsys):
    """After each step the loop uploads the compile cache once per finished compile (not on every step), and a
    run that ends while a compile still runs waits for it, says so, and keeps what it built."""
    gate = threading.Event()
    jobs = BackgroundCompiles(background=True, announce=False)
    loop = _Loop(jobs)
    assert loop._background_compiles_grew() is False
    jobs.ensure("greedy", lambda: None, "a")
    assert jobs.wait(timeout=30)
    assert loop._background_compiles_grew() is True and loop._background_compiles_grew() is False
    jobs.ensure("sample", lambda: gate.wait(30), "b")
    threading.Timer(0.2, gate.set).start()
    loop._finish_background_compiles()  # waits for "b", then saves once
    assert jobs.ready("sample") and loop.saves == 1 and jobs.running == []
    assert "waiting for the decode step's compile" in capsys.readouterr().out
    loop._finish_background_compiles()  # nothing running: no wait, no save
    assert loop.saves == 1


def test_a_run_without_an_engine_has_no_compiles_to_follow():
    loop = _Loop(None)
    loop.engine = None
    assert loop._background_compiles() is None and loop._background_compiles_grew() is False
    loop._finish_background_compiles()
    assert loop.saves == 0
