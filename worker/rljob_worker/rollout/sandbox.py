"""The Python sandbox of `builtin: python` tools: model-written code, one fresh subprocess per call.

What a call gets, and what it does not:
- a fresh interpreter (``python -I``: no PYTHON* variables, no user site-packages) in a new empty temporary
  directory as its working directory and HOME, removed after the call: it never runs among the worker's files;
- a clean environment (PATH, HOME, TMPDIR, LANG and single-threaded math libraries only): the checkpoint and S3
  credentials, which reach the worker as environment variables, are not there;
- limits the child sets on itself before the code runs (resource.setrlimit): CPU seconds, address space
  (memory), file size (stdout and stderr go to a file, so this is the output limit: a megabyte of print dies
  at the limit), no core dumps, and no new processes (RLIMIT_NPROC at 0; ignored for root, see below);
- a wall-clock limit: at the deadline the whole process group is killed (start_new_session), and the group is
  killed after every call, so a forked child never outlives its call;
- no network when the kernel lets an unprivileged process create a user + network namespace
  (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``: then only a down loopback exists). The container runtimes' default
  seccomp profiles (RuntimeDefault) refuse unshare without CAP_SYS_ADMIN: there the sandbox has the pod's
  network, and a NetworkPolicy that denies the training pods' egress is the cluster operator's control.
  `SandboxResult.network_isolated` says which case ran. The worker image runs as uid 1000 (Dockerfile.worker),
  so RLIMIT_NPROC at 0 refuses forks; as root that limit does not apply and the process-group kill ends them.
Every failure becomes an outcome and a one-line observation for the model; nothing raises into the rollout.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# The child's prologue: limits first, then (best effort) a namespace without network, then the code.
_PROLOGUE = r"""
import os, resource, runpy, sys
cpu, mem, out, flag = (int(v) for v in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
if mem > 0:
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
isolated = False
try:
    os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)
    isolated = True
except (AttributeError, OSError):
    pass
os.write(flag, b"1" if isolated else b"0")
os.close(flag)
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
except (ValueError, OSError):
    pass
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


@dataclass
class SandboxResult:
    outcome: str  # ok, error, timeout, cpu_limit, memory_limit, output_limit, killed
    output: str  # what the model sees: the program's output, or an error line with its tail
    seconds: float
    network_isolated: bool = False


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    output_bytes: int = 16_384


def _clean_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter; return what it printed and how it ended."""
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="rljob-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        out_path = os.path.join(workdir, ".output")
        read_fd, write_fd = os.pipe()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _PROLOGUE, str(int(limits.cpu_seconds)), str(int(limits.memory_bytes)),
                 str(int(limits.output_bytes) + 1), str(write_fd)],
                cwd=workdir, env=_clean_env(workdir), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)  # the deadline, or children a finished call left behind
        proc.wait()
        with os.fdopen(read_fd, "rb") as flag:
            isolated = flag.read(1) == b"1"
        with open(out_path, "rb") as f:
            raw = f.read(limits.output_bytes + 1)
        seconds = time.monotonic() - start
        text = raw[:limits.output_bytes].decode("utf-8", errors="replace")
        rc = proc.returncode
        at = text.find('  File "main.py"')
        if at > 0:  # the traceback from the model's code on, without the prologue's frames
            text = "Traceback (most recent call last):\n" + text[at:]
        if timed_out:
            return SandboxResult("timeout", f"Error: the code ran past the {limits.wall_seconds:g} s limit and was "
                                 f"stopped. Output so far:\n{text[-2000:]}", seconds, isolated)
        if len(raw) > limits.output_bytes:
            return SandboxResult("output_limit", f"{text}\nError: the output exceeded {limits.output_bytes} bytes "
                                 "and the code was stopped.", seconds, isolated)
        if rc == -signal.SIGXCPU:
            return SandboxResult("cpu_limit", f"Error: the code used more than {limits.cpu_seconds} s of CPU and was "
                                 "stopped.", seconds, isolated)
        if rc == 0:
            return SandboxResult("ok", text, seconds, isolated)
        if "MemoryError" in text:
            return SandboxResult("memory_limit", f"Error: the code ran out of memory (limit "
                                 f"{limits.memory_bytes >> 20} MiB).\n{text[-2000:]}", seconds, isolated)
        if rc is not None and rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            return SandboxResult("killed", f"Error: the code was killed by {name}.\n{text[-2000:]}", seconds, isolated)
        return SandboxResult("error", f"Error: the code exited with status {rc}.\n{text[-2000:]}", seconds, isolated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
