"""The suite's own leak check: a nested pytest run whose test leaves a process behind (one that ignores
SIGTERM, in a session of its own, as the orphaned checkpoint writers were) fails, names it, and kills it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the check reads /proc")
def test_a_process_that_outlives_its_test_fails_the_run_and_is_killed(tmp_path):
    pidfile = tmp_path / "pid"
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(f"""
        import subprocess, sys

        def test_leaves_a_process():
            code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
            proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
            open({str(pidfile)!r}, "w").write(str(proc.pid))
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_RLJOB_SESSION")}
    env.update(PYTHONPATH=str(TESTS), PYTEST_RLJOB_LEAK_GRACE_S="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "leak_check", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
                         cwd=tmp_path, env=env, check=False, capture_output=True, text=True, timeout=120)
    pid = int(pidfile.read_text())
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout and "1 process(es) started by the tests outlived them" in run.stdout, run.stdout
    assert f"pid {pid}:" in run.stdout and "time.sleep(600)" in run.stdout, run.stdout
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the check reads /proc")
def test_the_sessions_own_resource_tracker_is_not_a_leak_but_a_pool_worker_is(tmp_path):
    """A spawn pool starts multiprocessing's resource tracker, which lives as long as the pytest process:
    not a test's leftover. A pool worker still running at the end is one."""
    (tmp_path / "test_pools.py").write_text(textwrap.dedent("""
        import multiprocessing, time
        from concurrent.futures import ProcessPoolExecutor

        def test_a_closed_pool():
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                assert pool.submit(abs, -1).result() == 1

        def test_an_abandoned_pool():
            pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            pool.submit(time.sleep, 600)
            time.sleep(1)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_RLJOB_SESSION")}
    env.update(PYTHONPATH=str(TESTS), PYTEST_RLJOB_LEAK_GRACE_S="1")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "leak_check", "-p", "no:cacheprovider", "--rootdir",
            str(tmp_path)]
    closed = subprocess.run([*args, f"{tmp_path / 'test_pools.py'}::test_a_closed_pool"], cwd=tmp_path, env=env,
                            check=False, capture_output=True, text=True, timeout=120)
    assert closed.returncode == 0, closed.stdout[-2000:] + closed.stderr[-2000:]
    abandoned = subprocess.run([*args, f"{tmp_path / 'test_pools.py'}::test_an_abandoned_pool"], cwd=tmp_path,
                               env=env, check=False, capture_output=True, text=True, timeout=120)
    assert abandoned.returncode == 1, abandoned.stdout[-2000:] + abandoned.stderr[-2000:]
    assert "1 process(es) started by the tests outlived them" in abandoned.stdout, abandoned.stdout
    assert "multiprocessing.spawn" in abandoned.stdout and "resource_tracker" not in abandoned.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_helper_that_ignores_sigterm_dies_with_its_sigkilled_worker(tmp_path):
    """The checkpoint writer's Manager (started as shield_checkpoint_writer does) ignores SIGTERM; when its worker
    was SIGKILLed it lived on as an orphan. Now the kernel ends it with its parent."""
    import signal
    import time

    script = textwrap.dedent("""
        import multiprocessing, os, sys, time
        from multiprocessing.managers import SyncManager
        from rljob_worker.runtime.process_guard import ignore_stop_signals

        if __name__ == "__main__":
            manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            manager.start(initializer=ignore_stop_signals)
            print(manager._process.pid, flush=True)
            time.sleep(600)
    """)
    (tmp_path / "worker.py").write_text(script)
    worker = subprocess.Popen([sys.executable, str(tmp_path / "worker.py")], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    helper = None
    try:
        helper = int(worker.stdout.readline())
        os.kill(helper, signal.SIGTERM)  # ignored, as torchrun's SIGTERM to the group must be
        time.sleep(0.5)
        assert Path(f"/proc/{helper}").exists()
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{helper}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{helper}").exists(), f"helper {helper} outlived its SIGKILLed worker"
    finally:
        if worker.poll() is None:
            worker.kill()
        if helper is not None and Path(f"/proc/{helper}").exists():
            os.kill(helper, signal.SIGKILL)
