"""The compile stack's one-time costs, paid beside the model build instead of inside the first rollout.

A process's first ``torch.compile`` imports and sets up dynamo, AOTAutograd, inductor and (on a GPU) Triton: sympy
and the symbolic-shape machinery, the fake-tensor and custom-op registries, inductor's prims, Triton's driver and
kernel launcher, cuBLAS. A pod whose kernels all come from the restored compile cache still pays this, once, inside
its first compiled region: the first rollout's decode step. :class:`CompileWarmup` pays it earlier, on a thread of
its own, by compiling and running a tiny function shaped like the regions the run compiles (dynamic token dim,
a norm, a GEMM, SwiGLU, a backward) on the run's device.

When: started right after the compile cache is restored (the kernels it loads are the archive's, and its own join
the archive for the next pod) and joined before the first step. It never runs beside a rollout or a CUDA graph
capture: a thread tracing Python starves the main thread of the GIL (rollout/background_compile), and a capture in
global mode (vLLM captures while its engine starts, inside the model build) fails on another thread's allocations,
so whatever is about to capture calls :func:`settle` first. A warm-up that fails or hangs costs nothing but the
time it would have saved.

``RLJOB_COMPILE_WARMUP``: ``0`` off, ``1`` on; unset: on when the run compiles anything (the static engine's decode
step, the trainer's fused kernels).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV = "RLJOB_COMPILE_WARMUP"
JOIN_TIMEOUT_S = 300.0  # a warm-up still running then is left to finish on its own (it is a daemon)


def warmup_wanted(run_compiles: bool, environ: Mapping[str, str] | None = None) -> bool:
    """``RLJOB_COMPILE_WARMUP`` (1 on, 0 off) wins; unset: warm up when the run compiles anything."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: set 1 (warm the compile stack up during start-up) or 0 (let the first "
                         "compiled region pay it), or unset it (on when the run compiles anything)")
    return run_compiles if value == "" else value == "1"


def _probe(x, w):
    """``x (tokens, 64)``, ``w (64, 128)`` -> ``(tokens, 64)``: RMSNorm, a GEMM and SwiGLU, the kinds of op the
    decode step and the trainer's fused regions compile."""
    import torch.nn.functional as F

    gate, up = (F.rms_norm(x, (x.shape[-1],)) @ w).chunk(2, dim=-1)
    return F.silu(gate) * up


def run_probe(device) -> None:
    """Compile :func:`_probe` (token dim dynamic, as the regions compile it) and run it forward and backward."""
    import torch

    compiled = torch.compile(_probe)
    x = torch.randn(16, 64, device=device, requires_grad=True)
    w = torch.randn(64, 128, device=device, requires_grad=True)
    torch._dynamo.maybe_mark_dynamic(x, 0)
    compiled(x, w).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class WarmupOutcome:
    seconds: float  # the warm-up's own time, on its thread
    waited: float  # how long the caller waited for it at the join
    error: str | None = None  # why it failed (the first step then pays the set-up itself)

    def line(self) -> str:
        """The start-up line's words."""
        if self.error:
            return f"compile warm-up failed ({self.error}); the first compiled region pays the compiler's set-up"
        return (f"compile warm-up {self.seconds:.1f}s beside the model build (waited {self.waited:.1f}s for it): "
                "the compiler is set up before the first step")


class CompileWarmup:
    """:func:`run_probe` on a daemon thread from :meth:`start`; :meth:`join` waits for it (bounded) once."""

    def __init__(self, device) -> None:
        self.device = device
        self._seconds: float | None = None
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="compile warm-up", daemon=True)

    @classmethod
    def start(cls, device) -> CompileWarmup:
        global _running
        warmup = cls(device)
        warmup._thread.start()
        _running = warmup
        return warmup

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            run_probe(self.device)
        except Exception as exc:  # noqa: BLE001 - never fatal: the first compiled region pays the set-up instead
            self._error = f"{type(exc).__name__}: {exc}"
        self._seconds = time.perf_counter() - began

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> WarmupOutcome:
        began = time.perf_counter()
        self._thread.join(timeout)
        waited = time.perf_counter() - began
        if self._thread.is_alive():
            return WarmupOutcome(waited, waited, f"still running after {timeout:.0f}s; left to finish on its own")
        return WarmupOutcome(self._seconds or 0.0, waited, self._error)


_running: CompileWarmup | None = None  # the process's warm-up, for settle()


def settle(timeout: float = JOIN_TIMEOUT_S) -> None:
    """Wait for this process's warm-up, if one is running: before a CUDA graph capture in global mode."""
    if _running is not None:
        _running.join(timeout)
