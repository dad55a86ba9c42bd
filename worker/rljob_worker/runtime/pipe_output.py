"""stdout/stderr that outlive their reader.

`rljob run job.yaml | tee log`, then Ctrl-C: the terminal's SIGINT ends `tee` too, and the next
progress line raised BrokenPipeError in the worker before its preemption save. A closed reader must
never stop a save: on the first EPIPE the stream's file descriptor is pointed at a log file
(`os.dup2`, so buffered bytes and anything else writing to that descriptor follow) and the write is
retried there. Output that never meets a closed pipe is untouched.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

OUTPUT_LOG_VAR = "RLJOB_OUTPUT_LOG"  # where every process of a run diverts its output (one file)


class PipeSafeStream:
    """A text stream wrapper: writes and flushes that meet EPIPE go on into `fallback`."""

    def __init__(self, stream, fallback: Path):
        self._stream = stream
        self._fallback = Path(fallback)
        self.diverted = False

    def _divert(self) -> None:
        self._fallback.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._fallback, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"rljob: the reader of this process's output went away at "
                         f"{time.strftime('%Y-%m-%dT%H:%M:%S')}; its output continues here\n".encode())
            os.dup2(fd, self._stream.fileno())
        finally:
            os.close(fd)
        self.diverted = True

    def _retry(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            if exc.errno != errno.EPIPE or self.diverted:
                raise
            self._divert()
            return call(*args)

    def write(self, text: str) -> int:
        return self._retry(self._stream.write, text)

    def flush(self) -> None:
        self._retry(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def protect_output(fallback: Path) -> None:
    """Wrap sys.stdout and sys.stderr (idempotent); call before logging is configured, so its handler
    writes through the wrapper."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, PipeSafeStream):
            setattr(sys, name, PipeSafeStream(stream, fallback))
