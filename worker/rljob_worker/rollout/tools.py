"""The tools of spec.tools, called by the agent loop; every failure is an observation, never an exception.

- ``function: module.path:function`` (trusted code of the job's author, like rewards): called in a worker thread
  as ``f(arguments: dict, context: dict) -> str | JSON-serialisable``, where context holds the trajectory's
  ``prompt``, ``ground_truth`` and ``extra`` (the data row's extra_info): per-prompt state such as a secret or a
  test case. It runs in the worker's process: a call past timeoutSeconds gives the model a timeout
  observation and the thread is abandoned (Python cannot stop it).
- ``builtin: python``: model-written code, run by :mod:`.sandbox` in a fresh subprocess with limits; the call's
  arguments are ``{"code": "..."}``.

Each call ends in one outcome (OUTCOMES), counted per tool in ``rljob_tool_calls_total{tool,outcome}``.
"""
from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from rljob_worker.rollout.sandbox import SandboxLimits, run_python
from rljob_worker.rollout.tool_parser import ToolCall

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
    if ":" not in path:
        raise ValueError(f"{field} {path!r} must be module.path:function")
    module_name, func_name = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a configuration error
        raise ValueError(f"{field} {path!r}: cannot import module {module_name!r}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{field} {path!r}: module {module_name!r} has no function {func_name!r}")  # noqa: TRY004
    return func


class ToolBox:
    """The job's tools by name. ``truncate(text, max_tokens) -> text`` bounds an observation (the agent loop
    passes one over its tokenizer)."""

    def __init__(self, tools: list[ToolConfig], truncate: Callable[[str, int], str] | None = None,
                 max_workers: int = 8):
        self.tools = {t.name: t for t in tools}
        self.functions = {t.name: resolve_function(t.function, f"spec.tools[{i}].function")
                          for i, t in enumerate(tools) if t.function}
        self.truncate = truncate or (lambda text, n: text)
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rljob-tool")

    def call_all(self, calls: list[tuple[ToolCall, dict]]) -> list[ToolResult]:
        """Run (call, context) pairs concurrently; results in the same order."""
        futures = [self.pool.submit(self.call, call, context) for call, context in calls]
        return [f.result() for f in futures]

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
            outcome, output = self._function(tool, call.arguments, context)
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

    def _function(self, tool: ToolConfig, arguments: dict, context: dict) -> tuple[str, str]:
        future = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rljob-tool-{tool.name}")
        try:
            pending = future.submit(self.functions[tool.name], arguments, context)
            try:
                value = pending.result(timeout=tool.timeout_seconds)
            except FutureTimeout:
                return "timeout", f"Error: the tool {tool.name} did not answer within {tool.timeout_seconds:g} s"
            except Exception as exc:  # noqa: BLE001 - the model sees the failure, the run goes on
                return "error", f"Error: the tool {tool.name} failed: {type(exc).__name__}: {exc}"
        finally:
            future.shutdown(wait=False)
        if isinstance(value, str):
            return "ok", value
        try:
            return "ok", json.dumps(value)
        except (TypeError, ValueError) as exc:
            return "invalid_output", f"Error: the tool {tool.name} returned a value that is not text or JSON ({exc})"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
