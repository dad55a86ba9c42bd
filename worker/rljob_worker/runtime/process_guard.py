"""`rljob run` owns every process it starts, even when it is SIGKILLed or its terminal closes.

torchrun starts each worker in a session of its own, and the workers start helpers (checkpoint
writers, reward pools, compile workers), so no single process group holds a run. Every process of
a run instead carries ``RLJOB_RUN_ID=<id>`` in its environment (inherited by every descendant), and
a small guard process, in a session of its own, holds the read end of a pipe whose write end only
`rljob run` holds. However `rljob run` ends (exit, signal, SIGKILL), the pipe closes, and the guard
kills every process still carrying the id. Linux only (/proc); elsewhere the guard does nothing.

    python -m rljob_worker.runtime.process_guard RUN_ID      (started by `rljob run`; reads stdin until EOF)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RUN_ID_VAR = "RLJOB_RUN_ID"


def processes_of_run(run_id: str) -> list[int]:
    """PIDs whose initial environment carries RLJOB_RUN_ID=run_id (this process excluded)."""
    return processes_marked(RUN_ID_VAR, run_id)


def processes_marked(var: str, value: str) -> list[int]:
    """PIDs whose initial environment carries var=value (this process excluded; zombies have none)."""
    marker = f"{var}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_run(run_id: str, grace_s: float = 0.0) -> list[int]:
    """SIGTERM (when grace_s > 0, then SIGKILL after it) every process of the run; returns the PIDs hit."""
    pids = processes_of_run(run_id)
    if grace_s > 0:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and processes_of_run(run_id):
            time.sleep(0.1)
    for pid in processes_of_run(run_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def ignore_stop_signals() -> None:
    """For helper processes of a worker: SIGTERM/SIGINT are the worker's to handle (finish the step, save,
    exit 143). torchrun signals a worker's whole process group, and a helper that died of it took the
    preemption save down with it; the helpers end with the worker instead."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent goes. A helper that ignores SIGTERM and
    whose worker was SIGKILLed (a killed pod, a test ending a run) otherwise lived on as an orphan
    (~270 MB each, found after the test suite)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took hold
        os.kill(os.getpid(), signal.SIGKILL)


def start_guard(run_id: str) -> subprocess.Popen | None:
    """Start the guard; keep the returned Popen (its stdin is the pipe) until the run is over."""
    if not Path("/proc/self/environ").exists():
        return None
    env = {k: v for k, v in os.environ.items() if k != RUN_ID_VAR}
    return subprocess.Popen([sys.executable, "-m", "rljob_worker.runtime.process_guard", run_id], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                            close_fds=True)


def main(argv: list[str]) -> int:
    run_id = argv[0]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe's end ends the guard
    while sys.stdin.buffer.read(4096):
        pass
    kill_run(run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
