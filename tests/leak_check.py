"""A pytest plugin: the run fails when a process the suite started outlives it.

At session start a marker (``PYTEST_RLJOB_SESSION=<id>``) goes into this process's environment, so every
process a test starts inherits it (tests that filter the environment drop ``RLJOB_*``, ``PET_*`` and
``TORCHELASTIC*`` only). At session end the processes still carrying it (this one and its ancestors
aside) get a grace period to exit, are then SIGKILLed, and the run fails naming them: a test that ends
without ending what it started is a bug. Linux only (/proc); elsewhere it checks nothing.
"""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

MARKER_VAR = "PYTEST_RLJOB_SESSION"
GRACE_S = float(os.environ.get("PYTEST_RLJOB_LEAK_GRACE_S", "10"))


def _own_resource_tracker(entry: Path) -> bool:
    """multiprocessing's resource tracker of this very process: started by the first spawn-context pool
    or lock, it lives as long as its parent (it ends on EOF of its pipe when this process exits), so it
    is this process's, not a test's."""
    try:
        ppid = next(int(line.split()[1]) for line in (entry / "status").read_text().splitlines()
                    if line.startswith("PPid:"))
        return ppid == os.getpid() and b"multiprocessing.resource_tracker" in (entry / "cmdline").read_bytes()
    except (OSError, StopIteration, ValueError):
        return False


def processes_with_marker(value: str) -> list[int]:
    """PIDs (this process and its resource tracker excluded) whose initial environment has MARKER_VAR=value."""
    marker = f"{MARKER_VAR}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0") and not _own_resource_tracker(entry):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _describe(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        argv = "?"
    return f"pid {pid}: {argv[:200]}"


def leftovers(value: str, grace_s: float) -> list[str]:
    """Wait up to grace_s for the marked processes to end; SIGKILL and describe those that did not."""
    deadline = time.monotonic() + grace_s
    while processes_with_marker(value) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_with_marker(value)
    described = [_describe(pid) for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return described


def pytest_sessionstart(session: pytest.Session) -> None:
    if Path("/proc/self/environ").exists() and MARKER_VAR not in os.environ:
        os.environ[MARKER_VAR] = uuid.uuid4().hex


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    value = os.environ.get(MARKER_VAR)
    if not value or not Path("/proc/self/environ").exists():
        return
    # a nested pytest run (a test of this plugin) inherits the marker: only the outermost run checks
    if os.environ.get(f"{MARKER_VAR}_OWNER", str(os.getpid())) != str(os.getpid()):
        return
    left = leftovers(value, GRACE_S)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(left)} process(es) started by the tests outlived them (killed now):", *left]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(f"{MARKER_VAR}_OWNER", str(os.getpid()))
