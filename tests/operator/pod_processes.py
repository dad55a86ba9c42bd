"""Every process of one local pod, found as a container runtime finds them: by membership, not parentage.

torchrun starts each worker in a session of its own (start_new_session=True), so a kill of the
launcher's process group misses the workers; once the launcher is dead, any of them without a
parent-death signal (the worker sets one; what it starts may not) is an orphan that no parent
chain leads back to, and keeps its sockets. A container has no such leak: an OOM kill or a node failure kills every process in it,
and when its PID 1 exits the kernel kills the rest of its PID namespace. Here each pod's
processes carry a marker in their environment, which every descendant inherits, and a kill
walks /proc for it, as `rljob run`'s process guard does for a run.
"""
from __future__ import annotations

import os
import signal
import time
import uuid

from rljob_worker.runtime.process_guard import processes_marked

MARKER = "RLJOB_STANDIN_POD"


def new_marker(pod_name: str) -> str:
    """A marker unique to one start of one pod (a restarted pod is a new container)."""
    return f"{pod_name}-{uuid.uuid4().hex[:12]}"


def pids_of(marker: str) -> list[int]:
    """Live processes of the pod (zombies hold no sockets and are not listed)."""
    return processes_marked(MARKER, marker)


def kill_all(marker: str, *, timeout: float = 30.0) -> None:
    """SIGKILL every process of the pod and return once none is left; a straggler is an error."""
    deadline = time.monotonic() + timeout
    while pids := pids_of(marker):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of pod {marker} outlived SIGKILL for {timeout:.0f}s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
