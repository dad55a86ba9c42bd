"""Compiles run once each, in front of the work, and never fatal.

A compile runs in the caller before the first rollout that needs it; a failed compile costs nothing but the speed:
the step stays uncompiled. ``BackgroundCompiles(background=True)`` can run one on a thread of its own while the work
goes on uncompiled, but no run does: ``RLJOB_COMPILE_IN_BACKGROUND=1`` is refused (`background_default`), because a
compile on another thread resets process-wide torch state under the work beside it.

`BackgroundCompiles` is the bookkeeping (one compile per key, started once, ready / failed / running), free of
torch, so its threading is tested on its own; the engine supplies what a compile runs.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

BACKGROUND_ENV = "RLJOB_COMPILE_IN_BACKGROUND"  # refused when 1: see background_default


def background_default(environ=None) -> bool:
    """False: the compile runs before the first rollout that needs it. ``RLJOB_COMPILE_IN_BACKGROUND=1`` (compile
    beside the rollouts) is refused. torch.compile saves the process's default random number generators (CPU and
    CUDA), default dtype and matmul precision when a compile starts and restores them when it ends, whichever thread
    runs it, so a compile on another thread undoes what the main thread changed meanwhile: its draws from those
    generators come again, a dtype it set is reset (tests/worker/test_background_compile.py shows both; a compile
    beside a model build crashed a pod on an H200 this way, bench/NOTES.md). The rollouts' own sampling is safe (it
    draws from the engine's generator, seeded by the trainer per call); the rest of the process is not. It was also
    slower (session 11: the tracing thread starves the main thread of the GIL)."""
    value = (os.environ if environ is None else environ).get(BACKGROUND_ENV, "").strip()
    if value == "1":
        raise ValueError(f"{BACKGROUND_ENV}=1 is refused: a compile on another thread resets the process's default "
                         "generators and dtype when it ends, undoing what the main thread set meanwhile; unset it")
    if value not in ("", "0"):
        raise ValueError(f"{BACKGROUND_ENV}={value!r}: unset it (the compile runs before the first rollout that "
                         "needs it)")
    return False


class BackgroundCompiles:
    """One compile per key (e.g. a sampler mode), each run once: on a daemon thread when ``background``, else in
    the caller. ``ready(key)`` is True once the compile returned; a compile that raised is logged and never
    retried (the caller keeps its uncompiled path)."""

    def __init__(self, background: bool = True, announce: bool = True):
        self.background = background
        self.announce = announce  # log start and end (rank 0 only: one line per job, not per rank)
        self._lock = threading.Lock()
        self._threads: dict[Hashable, threading.Thread] = {}
        self._ready: set[Hashable] = set()
        self._failed: dict[Hashable, str] = {}

    def ready(self, key: Hashable) -> bool:
        return key in self._ready

    def failed(self, key: Hashable) -> str | None:
        """Why the compile of ``key`` failed, or None."""
        return self._failed.get(key)

    @property
    def done(self) -> int:
        """Compiles that finished (the caller saves the compile cache when this grows)."""
        return len(self._ready)

    @property
    def running(self) -> list[Hashable]:
        with self._lock:
            return [k for k, t in self._threads.items() if t.is_alive()]

    def ensure(self, key: Hashable, compile_fn: Callable[[], None], what: str, expect: str = "") -> bool:
        """Start compiling ``key`` unless started before; True when it is ready now (always after a foreground
        compile that succeeded). ``what`` names it in the log lines, ``expect`` says how long it may take."""
        with self._lock:
            if key in self._ready or key in self._failed or key in self._threads:
                return key in self._ready
            thread = threading.Thread(target=self._run, args=(key, compile_fn, what), daemon=True,
                                      name=f"compile {what}")
            self._threads[key] = thread
        if self.announce:
            where = "beside the rollouts (they run uncompiled until it is ready)" if self.background else "now"
            log.warning("compiling %s %s%s", what, where, f": {expect}" if expect else "")
        if self.background:
            thread.start()
        else:
            thread.run()  # same bookkeeping, in the caller
        return key in self._ready

    def _run(self, key: Hashable, compile_fn: Callable[[], None], what: str) -> None:
        start = time.perf_counter()
        try:
            compile_fn()
        except Exception as exc:  # noqa: BLE001 - a failed compile leaves the uncompiled path, which works
            root = _root_cause(exc)
            self._failed[key] = f"{type(root).__name__}: {root}"
            log.warning("compiling %s failed after %.0f s (%s); it keeps running uncompiled", what,
                        time.perf_counter() - start, (self._failed[key].splitlines() or [""])[0][:300])
            return
        self._ready.add(key)
        if self.announce:
            log.warning("compiled %s in %.0f s%s", what, time.perf_counter() - start,
                        "; used from the next rollout" if self.background else "")

    def wait(self, key: Hashable | None = None, timeout: float | None = None) -> bool:
        """Wait for the compile of ``key`` (every running compile when None); True when none is still running."""
        with self._lock:
            threads = [t for k, t in self._threads.items() if key is None or k == key]
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


def _root_cause(exc: BaseException) -> BaseException:
    """The error under a compiler's wrapping (dynamo's BackendCompilerFailed keeps it as ``inner_exception``)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc
