"""Whether the static engine compiles its decode step, and where compiled kernels are kept across restarts.

Compiling the decode step (torch.compile + inductor, by layer) costs ~25 s at 0.5B on its first call; inductor's on-disk
caches (FX graphs, AOT autograd graphs, autotuning results under ``TORCHINDUCTOR_CACHE_DIR``, Triton
kernels under ``TRITON_CACHE_DIR``) turn a later process's first call into a cache load. The operator mounts
an ``emptyDir`` in every GPU pod for them (it outlives container restarts in the pod) and sets the
variables; a local run (``rljob run``) keeps them under its workdir. A new pod restores them from the job's
object storage (checkpoint/compile_cache, ``spec.checkpoint.compileCache``).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rljob_api.enums import RolloutCompile

if TYPE_CHECKING:  # no torch import here: the worker sets the cache variables before torch reads its config
    import torch

COMPILE_ENV = "RLJOB_HF_STATIC_COMPILE"  # 1 / 0: overrides spec.rollout.compile (e.g. for a whole cluster via podTemplate.env)
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
# the cache folders kept across restarts and in the job's storage (checkpoint/compile_cache), by the variable of each
CACHE_ROOT_VARIABLES = {"inductor": CACHE_DIR_ENV, "triton": "TRITON_CACHE_DIR", "vllm": "VLLM_CACHE_ROOT"}
# inductor's local caches (on by default in torch 2.11; set so a torch build with other defaults keeps them)
CACHE_SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def compile_enabled(setting: RolloutCompile | str, device: torch.device,
                    environ: Mapping[str, str] | None = None) -> bool:
    """spec.rollout.compile -> compile the static engine's decode step or not. ``RLJOB_HF_STATIC_COMPILE``
    (1 or 0), when set, wins; else enabled / disabled as written, and auto = on CUDA only (on a CPU the compile
    costs more than the rollouts of a test or the quickstart save)."""
    environ = os.environ if environ is None else environ
    env = environ.get(COMPILE_ENV, "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"{COMPILE_ENV}={env!r}: set 1 (compile the decode step) or 0 (do not), or unset it "
                             "to follow spec.rollout.compile")
        return env == "1"
    setting = RolloutCompile(setting)
    if setting == RolloutCompile.AUTO:
        return device.type == "cuda"
    return setting == RolloutCompile.ENABLED


def compile_cache_env(workdir: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set for persistent compile caches under ``workdir`` (only those not set already:
    the operator's pod env points them at the pod's emptyDir): inductor's, Triton's (also the kernels
    outside inductor) and vLLM's. checkpoint/compile_cache keeps the same three in the job's storage."""
    environ = os.environ if environ is None else environ
    root = Path(workdir) / "compile-cache"
    wanted = {var: str(root / name) for name, var in CACHE_ROOT_VARIABLES.items()} | CACHE_SWITCHES
    return {k: v for k, v in wanted.items() if not environ.get(k)}
