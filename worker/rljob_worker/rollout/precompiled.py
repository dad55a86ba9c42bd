"""Compiled regions saved whole, so that a new pod calls them without tracing them again.

A pod whose compile caches were restored (checkpoint/compile_cache) still spends seconds in dynamo: inductor's
cache holds compiled graphs, not traces, so each region's Python is traced again before the cached kernels are
found (3.1 s of a restored pod's 9.5 s first step at 0.5B on an H200, 4.7 s of it in the first rollout:
bench/NOTES.md, session 15). torch's ahead-of-time precompile saves a region whole (graph, guards and kernels);
a later process loads it in well under a second and calls it without dynamo (0.6 s against 2.6 s for one
decoder-layer region in bench/aot_probe.py).

Opt-in (``RLJOB_PRECOMPILE=1``), because it loses on the worker image's torch. Measured at 0.5B on an H200 with
torch 2.11 (bench/NOTES.md, session 17): a restored pod's first step took 10.2 s with the regions loaded against
8.1 s traced again (the load recompiled one graph: an inductor cache miss inside the artefact's deserialisation),
while a cold pod's first step was 25.4 / 27.3 s against 27.8 / 30.5 s. With torch 2.13 on a CPU the loaded
regions reach the first result 1.8x sooner (1.64 s against 2.91 s, tiny model): worth measuring again when the
image's torch moves.

`PrecompiledRegion` stands where ``torch.compile(fn, fullgraph=True)`` stood. Its first call loads the region's
saved artefact if there is one, else compiles ahead of time with that call's arguments (their dynamic-dim marks
included, so the artefact's sizes are as symbolic as the plain compile's) and saves it. The artefacts live under
the inductor cache folder, so the compile-cache archive carries them to the next pod; each file name holds a
key of what they depend on (`artefact_key`). Speed is all this may cost: an artefact that does not load, a
precompile that fails, or a call the artefact's guards refuse (a size it was specialised on, weights that moved
to new tensors) goes to the plain ``torch.compile`` of the same function, logged once.

Regions must be module-level functions whose arguments pickle (modules, tensors, tuples, plain values): the
artefact keeps its guards, and the guards keep the arguments' types and constants.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FOLDER = "rljob-precompiled"  # under the inductor cache folder (restored and archived with it)
SWITCH_ENV = "RLJOB_PRECOMPILE"  # 1: save and load precompiled regions (off by default: see above)
GUARD_FAILURE = "GuardManager check failed"  # what a loaded artefact raises for a call its guards refuse
# the attributes torch's dim-marking APIs set on a tensor (mark_dynamic, maybe_mark_dynamic, ...)
DIM_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
             "_dynamo_strict_unbacked_indices", "_dynamo_static_indices")


def precompile_folder(environ=None) -> Path | None:
    """Where artefacts are kept with ``RLJOB_PRECOMPILE=1``: ``$TORCHINDUCTOR_CACHE_DIR/rljob-precompiled``; None
    (the plain torch.compile) without the switch, or where the worker did not point the inductor cache at a
    folder of the job's (the machine's default cache is not this job's)."""
    environ = os.environ if environ is None else environ
    switch = environ.get(SWITCH_ENV, "").strip()
    if switch not in ("", "0", "1"):
        raise ValueError(f"{SWITCH_ENV}={switch!r}: set 1 (save and load precompiled regions) or 0 (the default)")
    root = environ.get("TORCHINDUCTOR_CACHE_DIR", "").strip()
    if switch != "1" or not root:
        return None
    return Path(root) / FOLDER


def artefact_key(parts: dict[str, Any], sources: Iterable[str], device: torch.device) -> str:
    """A short hash of what a saved region depends on: ``parts`` (the model's shape, dtype, engine settings), the
    source files of the modules whose code it traced (a code change must not load an old trace), torch's and
    CUDA's versions and the device (named as the compile-cache archive names it)."""
    from rljob_worker.checkpoint.compile_cache import device_name

    digest = hashlib.sha256()
    digest.update(json.dumps(parts, sort_keys=True, default=str).encode())
    for name in sorted(sources):
        path = getattr(sys.modules.get(name), "__file__", None)
        digest.update(name.encode())
        if path and os.path.exists(path):
            digest.update(Path(path).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{device_name(device)}".encode())
    return digest.hexdigest()[:16]


def _aot_compile(fn: Callable, args: tuple) -> Any:
    """torch's ahead-of-time precompile of ``fn`` for a call with ``args`` (inductor, whole graph). The entry point
    is the one ``torch.compile(...).aot_compile`` calls in torch 2.13; torch 2.11 (the worker image) has it without
    that method."""
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    backend = torch._TorchCompileInductorWrapper("default", None, None)
    return aot_compile_fullgraph(fn, (args, {}), hooks=Hooks(), backend=backend)


class PrecompiledRegion:
    """``fn`` compiled by torch.compile (fullgraph, inductor), its compiled form kept in ``folder`` as
    ``<name>-<key>.pt2``. ``source``: how the first call got it, "loaded" (no trace), "precompiled" (traced and
    saved here), or "traced" (the plain torch.compile path)."""

    def __init__(self, fn: Callable, name: str, folder: Path | None, key: str):
        self.fn, self.name, self.folder, self.key = fn, name, folder, key
        self.path = None if folder is None else folder / f"{name}-{key}.pt2"
        self.source: str | None = None
        self._traced: Callable | None = None
        self._ahead: Callable | None = None
        self._refused = False  # a call the artefact's guards refused was logged

    @property
    def traced(self) -> Callable:
        if self._traced is None:
            self._traced = torch.compile(self.fn, fullgraph=True)
        return self._traced

    def __call__(self, *args):
        if self.source is None:  # the first call (the samplers' tails and every layer share one region)
            self._ahead, self.source = self._load() or self._precompile(args) or (None, "traced")
        if self._ahead is None:
            return self.traced(*args)
        try:
            return self._ahead(*(_unmarked(a) for a in args) if self.source == "loaded" else args)
        except RuntimeError as exc:
            if GUARD_FAILURE not in str(exc):
                raise
            if not self._refused:
                self._refused = True
                log.warning("the precompiled %s does not serve a call (%s); such calls compile as usual",
                            self.name, _guard_reason(str(exc)))
            return self.traced(*args)

    def _load(self) -> tuple[Callable, str] | None:
        if self.path is None or not self.path.exists():
            return None
        start = time.perf_counter()
        try:
            with open(self.path, "rb") as f:
                loaded = torch.compiler.load_compiled_function(f, f_globals=self.fn.__globals__)
        except Exception as exc:  # noqa: BLE001 - an artefact that does not load costs a compile, nothing more
            log.warning("could not load the precompiled %s from %s (%s: %s); compiling it", self.name, self.path,
                        type(exc).__name__, str(exc)[:200])
            return None
        log.info("loaded the precompiled %s in %.2f s", self.name, time.perf_counter() - start)
        return loaded, "loaded"

    def _precompile(self, args: tuple) -> tuple[Callable, str] | None:
        if self.path is None:
            return None
        start = time.perf_counter()
        try:
            compiled = _aot_compile(self.fn, args)
        except Exception as exc:  # noqa: BLE001 - the plain compile still works
            log.warning("precompiling %s failed (%s: %s); it compiles as usual, without a saved artefact",
                        self.name, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            return None
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(partial))
            os.replace(partial, self.path)  # a reader sees a whole artefact or none (ranks share the folder)
        except Exception as exc:  # noqa: BLE001 - this process keeps the compiled region; the next pod compiles
            partial.unlink(missing_ok=True)
            log.warning("could not save the precompiled %s to %s (%s: %s)", self.name, self.path,
                        type(exc).__name__, str(exc)[:200])
            return compiled, "precompiled"
        log.info("precompiled %s in %.1f s (saved to %s)", self.name, time.perf_counter() - start, self.path)
        return compiled, "precompiled"


def _guard_reason(message: str) -> str:
    """The failed guard's source from a refusal's message (torch prints it as ``verbose_code_parts=[...]``)."""
    for line in message.splitlines():
        if "verbose_code_parts" in line:
            return line.strip()[:300]
    return message.strip()[:300]


def _unmarked(value):
    """``value`` with each dim-marked tensor (also inside tuples) replaced by a plain view of it. A loaded artefact
    rebuilds its guards from tensors without the marks the compile saw, and then refuses any marked argument
    (torch 2.13); its sizes are symbolic already, so the marks the engine sets for a plain compile are dropped.
    A view shares the storage: writes into it (the KV cache, the token buffers) land in the tensor."""
    if isinstance(value, torch.Tensor):
        return value.view(value.shape) if any(hasattr(value, a) for a in DIM_MARKS) else value
    if isinstance(value, tuple):
        items = [_unmarked(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value
