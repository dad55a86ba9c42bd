"""Compiles run once each, in the caller before the work that needs them, and never fatal.

A compile runs before the first rollout that needs it; a failed compile costs nothing but the speed: the step
stays uncompiled. No compile runs on a thread beside other work: torch.compile saves the process's default random
number generators (CPU and CUDA), default dtype and matmul precision when a compile starts and restores them when
it ends, whichever thread runs it, so a compile beside other torch work undoes what that work changed meanwhile.
Its draws from those generators come again, and a dtype it set is reset (tests/worker/test_compile_once.py shows
both; a compile beside a model build crashed a pod on an H200 this way, bench/NOTES.md session 18). It was also
slower (session 11: the tracing thread starves the main thread of the GIL). ``RLJOB_COMPILE_IN_BACKGROUND=1``,
which asked for that, is refused with this reason.

`CompileOnce` is the bookkeeping (one compile per key, run once, ready or failed), free of torch; the engine
supplies what a compile runs.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

BACKGROUND_ENV = "RLJOB_COMPILE_IN_BACKGROUND"  # refused: see refuse_background_compile


def refuse_background_compile(environ=None) -> None:
    """Refuse ``RLJOB_COMPILE_IN_BACKGROUND`` set to anything but 0: the compile runs before the first rollout that
    needs it (the module's docstring says why never beside the rollouts)."""
    value = (os.environ if environ is None else environ).get(BACKGROUND_ENV, "").strip()
    if value == "1":
        raise ValueError(f"{BACKGROUND_ENV}=1 is refused: a compile on another thread resets the process's default "
                         "generators and dtype when it ends, undoing what the main thread set meanwhile; unset it")
    if value not in ("", "0"):
        raise ValueError(f"{BACKGROUND_ENV}={value!r}: unset it (the compile runs before the first rollout that "
                         "needs it)")


class CompileOnce:
    """One compile per key (e.g. a sampler mode), each run once in the caller. ``ready(key)`` is True once the
    compile returned; a compile that raised is logged and never retried (the caller keeps its uncompiled path)."""

    def __init__(self, announce: bool = True):
        self.announce = announce  # log start and end (rank 0 only: one line per job, not per rank)
        self._ready: set[Hashable] = set()
        self._failed: dict[Hashable, str] = {}

    def ready(self, key: Hashable) -> bool:
        return key in self._ready

    def failed(self, key: Hashable) -> str | None:
        """Why the compile of ``key`` failed, or None."""
        return self._failed.get(key)

    @property
    def done(self) -> int:
        """Compiles that finished (the run loop saves the compile cache when this grows)."""
        return len(self._ready)

    def ensure(self, key: Hashable, compile_fn: Callable[[], None], what: str, expect: str = "") -> bool:
        """Compile ``key`` unless tried before; True when it is ready. ``what`` names it in the log lines,
        ``expect`` says how long it may take."""
        if key in self._ready or key in self._failed:
            return key in self._ready
        if self.announce:
            log.warning("compiling %s now%s", what, f": {expect}" if expect else "")
        start = time.perf_counter()
        try:
            compile_fn()
        except Exception as exc:  # noqa: BLE001 - a failed compile leaves the uncompiled path, which works
            root = _root_cause(exc)
            self._failed[key] = f"{type(root).__name__}: {root}"
            log.warning("compiling %s failed after %.0f s (%s); it keeps running uncompiled", what,
                        time.perf_counter() - start, (self._failed[key].splitlines() or [""])[0][:300])
            return False
        self._ready.add(key)
        if self.announce:
            log.warning("compiled %s in %.0f s", what, time.perf_counter() - start)
        return True


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
