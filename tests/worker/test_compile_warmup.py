"""The compiler's set-up paid on a thread during start-up (runtime/compile_warmup): when it runs, what it leaves
set up, and that a warm-up that fails costs the run nothing. The run-level half (the start-up line, the first
step's line counting only the step's own graphs) is in tests/checkpoint/test_compile_cache.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from rljob_worker.runtime.compile_warmup import CompileWarmup, WarmupOutcome, warmup_wanted


def test_the_variable_wins_and_unset_follows_whether_the_run_compiles():
    assert warmup_wanted(True, {}) and not warmup_wanted(False, {})
    assert warmup_wanted(False, {"RLJOB_COMPILE_WARMUP": "1"})
    assert not warmup_wanted(True, {"RLJOB_COMPILE_WARMUP": "0"})
    with pytest.raises(ValueError, match="RLJOB_COMPILE_WARMUP='yes': set 1"):
        warmup_wanted(True, {"RLJOB_COMPILE_WARMUP": "yes"})


@pytest.mark.timeout(300)
def test_a_warm_up_sets_the_compiler_up_on_its_own_thread(tmp_path):
    """A fresh process (a pod's worker): the warm-up compiles its probe with inductor on another thread, leaves
    inductor's compile path imported and its graphs counted, and no thread is left once `settle` returns."""
    script = textwrap.dedent("""
        import sys, threading, torch
        from rljob_worker.runtime.compile_warmup import CompileWarmup, settle
        from rljob_worker.run_loop import compile_totals
        assert "torch._inductor.compile_fx" not in sys.modules
        warmup = CompileWarmup.start(torch.device("cpu"))
        settle()  # what an engine about to capture CUDA graphs calls: returns once the warm-up is done
        names = [t.name for t in threading.enumerate()]
        outcome = warmup.join()
        totals = compile_totals()
        print(outcome.error, "torch._inductor.compile_fx" in sys.modules,
              int(totals["fxgraph_cache_hit"] + totals["fxgraph_cache_miss"]), "compile warm-up" in names)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLJOB_", "TORCHINDUCTOR_", "TRITON_"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=280,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    error, imported, graphs, thread_left = out.stdout.split()[-4:]
    assert (error, imported, thread_left) == ("None", "True", "False"), out.stdout
    assert int(graphs) >= 2, out.stdout  # the probe's forward and its backward


def test_a_warm_up_that_fails_says_why_and_the_run_goes_on():
    """A device the process cannot use (no CUDA on this machine, or a CUDA index past the last GPU) fails the probe:
    the outcome names the error, the line says the first compiled region pays the set-up instead."""
    device = torch.device("cuda", torch.cuda.device_count() if torch.cuda.is_available() else 0)
    outcome = CompileWarmup.start(device).join()
    assert outcome.error, outcome
    assert outcome.line().startswith("compile warm-up failed (")
    assert "the first compiled region pays the compiler's set-up" in outcome.line()


def test_the_start_up_line_says_how_long_it_took_and_how_long_the_run_waited():
    line = WarmupOutcome(seconds=3.14, waited=0.42).line()
    assert line.startswith("compile warm-up 3.1s beside the model build (waited 0.4s for it)"), line
