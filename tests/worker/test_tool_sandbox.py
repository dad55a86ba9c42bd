"""Tools that misbehave give the model an error observation, are counted, and the rollout goes on.

Real subprocesses (the python sandbox), real threads (function tools), a real Prometheus registry. Limits are
small so each case ends in about a second."""
from __future__ import annotations

import importlib
import os
import sys
import textwrap
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rljob_worker.rollout.sandbox import SandboxLimits, run_python
from rljob_worker.rollout.tool_parser import ToolCall
from rljob_worker.rollout.tools import ToolBox, ToolConfig
from rljob_worker.telemetry.trainer_metrics import TrainerTelemetry

LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=2, memory_bytes=256 << 20, output_bytes=4096)
# For the calls that must finish: an interpreter's start on a busy 2-core machine can take seconds of wall time.
ROOMY = SandboxLimits(wall_seconds=60.0, cpu_seconds=10, memory_bytes=256 << 20, output_bytes=4096)


def test_ok_output_and_a_clean_environment_in_an_empty_directory(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    result = run_python("import os, json\nprint(json.dumps({'env': sorted(os.environ), 'cwd': os.getcwd(), "
                        "'files': os.listdir('.')}))", ROOMY)
    assert result.outcome == "ok", result.output
    import json

    seen = json.loads(result.output)
    assert "AWS_SECRET_ACCESS_KEY" not in seen["env"] and not any(k.startswith("RLJOB") for k in seen["env"])
    assert seen["cwd"] != os.getcwd() and "rljob-sandbox-" in seen["cwd"] and sorted(seen["files"]) == [".output", "main.py"]
    assert not os.path.exists(seen["cwd"])  # removed after the call


def test_hang_is_stopped_at_the_wall_clock_limit():
    start = time.monotonic()
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", LIMITS)
    assert result.outcome == "timeout" and "ran past the 2 s limit" in result.output and "started" in result.output
    assert time.monotonic() - start < LIMITS.wall_seconds + 3


def test_crash_returns_the_traceback_of_the_models_code():
    result = run_python("def f():\n    return 1 / 0\nf()", ROOMY)
    assert result.outcome == "error" and "ZeroDivisionError" in result.output and 'File "main.py", line 2' in result.output
    assert "runpy" not in result.output  # the sandbox's own frames are not shown


def test_a_megabyte_of_output_stops_at_the_output_limit():
    result = run_python("print('x' * 1_000_000)\nprint('never')", ROOMY)
    assert result.outcome == "output_limit" and "exceeded 4096 bytes" in result.output
    assert len(result.output) < LIMITS.output_bytes + 200 and "never" not in result.output


def test_memory_limit():
    result = run_python("blob = bytearray(1 << 30)", ROOMY)
    assert result.outcome == "memory_limit" and "out of memory" in result.output


def test_a_forked_child_does_not_outlive_its_call(tmp_path):
    """As root RLIMIT_NPROC does not apply and the fork succeeds; the process group dies with the call."""
    marker = tmp_path / "still-running"
    code = textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            time.sleep(1.5)
            open({str(marker)!r}, "w").write("alive")
            os._exit(0)
        print("parent done")
    """)
    result = run_python(code, ROOMY)
    assert result.outcome in ("ok", "error")  # error where RLIMIT_NPROC refuses the fork (non-root)
    time.sleep(2.5)
    assert not marker.exists()


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    (tmp_path / "bad_tools.py").write_text(textwrap.dedent("""
        import time
        def hangs(arguments, context):
            time.sleep(30)
        def crashes(arguments, context):
            raise RuntimeError("boom")
        def returns_object(arguments, context):
            return object()
        def returns_dict(arguments, context):
            return {"sum": arguments["a"] + arguments["b"]}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "bad_tools"


def test_tool_box_outcomes_for_every_bad_tool(tool_module):
    tools = [ToolConfig("hangs", function=f"{tool_module}:hangs", timeout_seconds=1.0),
             ToolConfig("crashes", function=f"{tool_module}:crashes"),
             ToolConfig("object", function=f"{tool_module}:returns_object"),
             ToolConfig("adder", function=f"{tool_module}:returns_dict"),
             ToolConfig("python", builtin="python", timeout_seconds=2.0, max_output_tokens=64, memory_mb=256)]
    box = ToolBox(tools, truncate=lambda text, n: text[:n * 8])
    calls = [ToolCall("hangs", {}), ToolCall("crashes", {}), ToolCall("object", {}), ToolCall("adder", {"a": 1, "b": 2}),
             ToolCall("python", {"code": "print(6 * 7)"}), ToolCall("python", {"code": "print('y' * 10**6)"}),
             ToolCall("python", {"script": "x"}), ToolCall("nope", {}), ToolCall(None, error="not valid JSON")]
    start = time.monotonic()
    results = box.call_all([(c, {}) for c in calls])
    assert time.monotonic() - start < 6  # concurrently, each within its limit
    assert [r.outcome for r in results] == ["timeout", "error", "invalid_output", "ok", "ok", "output_limit",
                                            "invalid_call", "unknown_tool", "invalid_call"]
    assert "did not answer within 1 s" in results[0].output and "RuntimeError: boom" in results[1].output
    assert results[3].output == '{"sum": 3}' and results[4].output == "42\n"
    assert len(results[5].output) <= 64 * 8
    box.close()


@pytest.fixture
def stuck_tool(tmp_path, monkeypatch):
    """A function tool stuck until the test lets it go (a client without a timeout on a dead service)."""
    (tmp_path / "stuck_tools.py").write_text(textwrap.dedent("""
        import threading
        RELEASE = threading.Event()
        def stuck(arguments, context):
            RELEASE.wait(60)
            return "late"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("stuck_tools")
    yield "stuck_tools:stuck"
    module.RELEASE.set()
    sys.modules.pop("stuck_tools", None)


def test_sandbox_and_bad_calls_never_wait_behind_hung_function_calls(stuck_tool):
    """Every thread of the function pool held by a hung call: the python call, an unknown tool and a call that
    did not parse in the same batch still get their answers, within the hung calls' limit plus the sandbox's."""
    limit, wall = 0.5, 5.0
    box = ToolBox([ToolConfig("search", function=stuck_tool, timeout_seconds=limit),
                   ToolConfig("python", builtin="python", timeout_seconds=wall)], max_workers=2)
    calls = [ToolCall("search", {}), ToolCall("search", {}), ToolCall("python", {"code": "print(6 * 7)"}),
             ToolCall("nope", {}), ToolCall(None, error="not valid JSON")]
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(box.call_all([(c, {}) for c in calls])), daemon=True)
    runner.start()
    # each hung call is given up at its limit (one after the other at worst), the sandbox ends by its wall limit
    runner.join(timeout=len(calls) * limit + wall)
    stuck = runner.is_alive()
    sys.modules["stuck_tools"].RELEASE.set()
    runner.join(timeout=60)
    box.close()
    assert not stuck, "call_all waited for ever behind the hung function calls"
    assert [r.outcome for r in results] == ["timeout", "timeout", "ok", "unknown_tool", "invalid_call"]
    assert results[2].output == "42\n"


def test_hung_calls_of_one_batch_time_out_together(stuck_tool):
    """Calls that start together end at their start plus timeoutSeconds, all of them: a batch of k hung calls
    costs one limit, not k limits one after the other."""
    limit, k = 1.0, 4
    box = ToolBox([ToolConfig("search", function=stuck_tool, timeout_seconds=limit)], max_workers=k)
    start = time.monotonic()
    results = box.call_all([(ToolCall("search", {}), {}) for _ in range(k)])
    elapsed = time.monotonic() - start
    sys.modules["stuck_tools"].RELEASE.set()
    box.close()
    assert [r.outcome for r in results] == ["timeout"] * k
    assert elapsed < k * limit  # waited one after the other, the batch takes k limits at least


def test_outcomes_are_counted_in_rljob_tool_calls_total():
    registry = CollectorRegistry()
    telemetry = TrainerTelemetry(job="j", namespace="ns", rank=0, model="m", algorithm="grpo", nnodes=1,
                                 registry=registry)
    telemetry.record_tool_calls({("python", "timeout"): 2, ("python", "ok"): 5})
    telemetry.record_tool_calls({("python", "timeout"): 1})
    text = generate_latest(registry).decode()
    assert 'rljob_tool_calls_total{namespace="ns",outcome="timeout",rank="0",rljob="j",tool="python"} 3.0' in text
    assert 'rljob_tool_calls_total{namespace="ns",outcome="ok",rank="0",rljob="j",tool="python"} 5.0' in text
    telemetry.close()
