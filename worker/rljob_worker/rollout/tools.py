"""The tools of spec.tools, called by the agent loop; every failure is an observation, never an exception.

- ``function: module.path:function`` (trusted code of the job's author, like rewards): called on the box's
  thread pool as ``f(arguments: dict, context: dict) -> str | JSON-serialisable``, where context holds the
  trajectory's ``prompt``, ``ground_truth`` and ``extra`` (the data row's extra_info): per-prompt state such as
  a secret or a test case. It runs in the worker's process: a call past timeoutSeconds (counted from when it
  started, or from when it was queued if the pool never got to it) gives the model a timeout observation, its
  thread is abandoned (Python cannot stop it) and later calls go to a fresh pool, so a hung tool never takes
  the box's threads away. One long-lived pool, not a thread per call: a call costs microseconds, not a thread
  start.
- ``builtin: python``: model-written code, run by :mod:`.sandbox` in a fresh subprocess with limits; the call's
  arguments are ``{"code": "..."}``. These calls have a pool of their own: every one ends by its wall limit,
  and none waits behind function calls that hang.
- a call that cannot run (not parsed, no such tool) is answered at once, in the calling thread.

Each call ends in one outcome (OUTCOMES), counted per tool in ``rljob_tool_calls_total{tool,outcome}``.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from rljob_worker.rollout.sandbox import SandboxLimits, run_python
from rljob_worker.rollout.tool_parser import ToolCall
from rljob_worker.user_code import import_function

OUTCOMES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed", "invalid_call",
            "invalid_output", "unknown_tool", "too_many_calls")


@dataclass(frozen=True)
class ToolConfig:
    """One entry of spec.tools (the worker's view, free of the API models)."""

    name: str
    function: str | None = None
    builtin: str | None = None
    timeout_seconds: float = 10.0
    max_output_tokens: int = 256
    memory_mb: int = 1024


@dataclass
class ToolResult:
    name: str
    arguments: dict
    outcome: str
    output: str  # the observation the model gets (already truncated to the tool's maxOutputTokens)
    seconds: float


def resolve_function(path: str, field: str) -> Callable:
    """``module.path:function`` -> the callable; ValueError naming ``field`` otherwise."""
    return import_function(path, field)


class ToolBox:
    """The job's tools by name. ``truncate(text, max_tokens) -> text`` bounds an observation (the agent loop
    passes one over its tokenizer)."""

    def __init__(self, tools: list[ToolConfig], truncate: Callable[[str, int], str] | None = None,
                 max_workers: int = 8):
        self.tools = {t.name: t for t in tools}
        self.functions = {t.name: resolve_function(t.function, f"spec.tools[{i}].function")
                          for i, t in enumerate(tools) if t.function}
        self.truncate = truncate or (lambda text, n: text)
        self.max_workers = max_workers
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rljob-tool")
        # Sandbox calls apart: behind hung function calls (the pool above) they would wait for ever.
        self.sandbox_pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rljob-sandbox")

    def call_all(self, calls: list[tuple[ToolCall, dict]]) -> list[ToolResult]:
        """Run (call, context) pairs concurrently; results in the same order."""
        pending = []
        for call, context in calls:
            tool = self.tools.get(call.name) if call.error is None else None
            if tool is not None and tool.function:
                started = _Started()
                pending.append((call, tool, started, time.monotonic(),
                                self.pool.submit(self._run_function, tool, call.arguments, context, started)))
            elif tool is not None:
                pending.append((call, None, None, None, self.sandbox_pool.submit(self.call, call, context)))
            else:  # not parsed, or no such tool: the answer needs no thread
                pending.append((call, None, None, None, _done(self.call(call, context))))
        return [future.result() if tool is None else self._function_result(call, tool, started, queued, future)
                for call, tool, started, queued, future in pending]

    def _run_function(self, tool: ToolConfig, arguments: dict, context: dict, started: _Started):
        start = started.set()
        try:
            return self.functions[tool.name](arguments, context), None, time.monotonic() - start
        except Exception as exc:  # noqa: BLE001 - the model sees the failure, the run goes on
            return None, exc, time.monotonic() - start

    def _function_result(self, call: ToolCall, tool: ToolConfig, started: _Started, queued: float,
                         future) -> ToolResult:
        limit = tool.timeout_seconds
        if started.wait(timeout=max(0.0, queued + limit - time.monotonic())):
            try:  # the limit counts from the call's start: calls of one batch started together end together
                value, exc, seconds = future.result(timeout=max(0.0, started.at + limit - time.monotonic()))
            except FutureTimeout:
                value, exc, seconds = None, None, None
        else:  # every thread of the pool is held by hung calls
            value, exc, seconds = None, None, None
        if seconds is None:
            self._abandon_pool()
            outcome, output = "timeout", f"Error: the tool {tool.name} did not answer within {limit:g} s"
            seconds = limit
        elif exc is not None:
            outcome, output = "error", f"Error: the tool {tool.name} failed: {type(exc).__name__}: {exc}"
        else:
            outcome, output = _function_output(tool, value)
        return ToolResult(tool.name, call.arguments, outcome, self.truncate(output, tool.max_output_tokens), seconds)

    def _abandon_pool(self) -> None:
        """A call hung: leave its thread to the old pool and send later calls to a fresh one."""
        old, self.pool = self.pool, ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="rljob-tool")
        old.shutdown(wait=False)

    def call(self, call: ToolCall, context: dict) -> ToolResult:
        start = time.monotonic()
        name = call.name or "<unparsed>"
        if call.error is not None:
            return ToolResult(name, call.arguments, "invalid_call", f"Error: {call.error}", 0.0)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(name, call.arguments, "unknown_tool",
                              f"Error: there is no tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}", 0.0)
        if tool.builtin == "python":
            outcome, output = self._python(tool, call.arguments)
        else:
            return self.call_all([(call, context)])[0]
        return ToolResult(tool.name, call.arguments, outcome, self.truncate(output, tool.max_output_tokens),
                          time.monotonic() - start)

    def _python(self, tool: ToolConfig, arguments: dict) -> tuple[str, str]:
        code = arguments.get("code")
        if not isinstance(code, str):
            return "invalid_call", 'Error: the python tool takes {"code": "<python source>"}'
        limits = SandboxLimits(wall_seconds=tool.timeout_seconds, cpu_seconds=max(1, int(tool.timeout_seconds)),
                               memory_bytes=tool.memory_mb << 20, output_bytes=max(1024, 8 * tool.max_output_tokens))
        result = run_python(code, limits)
        return result.outcome, result.output

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sandbox_pool.shutdown(wait=False, cancel_futures=True)


class _Started(threading.Event):
    """Set when a function call starts; ``at`` is when (time.monotonic)."""

    at: float = 0.0

    def set(self) -> float:
        self.at = time.monotonic()
        super().set()
        return self.at


def _done(result: ToolResult) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


def _function_output(tool: ToolConfig, value) -> tuple[str, str]:
    if isinstance(value, str):
        return "ok", value
    try:
        return "ok", json.dumps(value)
    except (TypeError, ValueError) as exc:
        return "invalid_output", f"Error: the tool {tool.name} returned a value that is not text or JSON ({exc})"
