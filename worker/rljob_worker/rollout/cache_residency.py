"""Whether the static engine's KV cache and CUDA graphs stay on the GPU while the actor trains.

``rollout.freeCacheEngine`` frees the colocated engine's memory for the update after every rollout. For the static hf
engine that memory is its KV cache and its captured decode graphs, and freeing them means capturing the graphs again
at the start of every rollout (a few captures a rollout, each a traced decode step; 0.5B: ~0.1-0.3 s of a ~2 s
step). Where the measured memory shows they fit beside training, they stay. The decision is taken once, after the
first step (whose training ran with the cache freed, so its measured peak holds everything training needs), and
logged; ``RLJOB_ROLLOUT_CACHE=release`` keeps freeing every step.
"""
from __future__ import annotations

import os

from rljob_worker.startup_errors import StartupError

RESIDENCY_ENV = "RLJOB_ROLLOUT_CACHE"
# of the device's memory kept free beyond the two measured peaks: fragmentation, longer responses than the first
# step's (the update's activations and the cache both grow with them). Wider than offload's 10%: keeping the cache
# saves tenths of a second a step, an out-of-memory costs the work since the last checkpoint.
KEEP_HEADROOM = 0.25


def keep_cache_resident(total_bytes: int, training_peak_bytes: int, cache_bytes: int,
                        headroom: float = KEEP_HEADROOM) -> bool:
    """True when training's peak allocation (measured with the cache freed) plus what freeing the cache returned
    fit below ``(1 - headroom)`` of the device's memory."""
    return training_peak_bytes + cache_bytes <= total_bytes * (1.0 - headroom)


def residency_forced_off() -> bool:
    """``RLJOB_ROLLOUT_CACHE=release`` (benchmarks, or a job that needs every byte): free after every rollout."""
    value = os.environ.get(RESIDENCY_ENV, "auto").strip().lower()
    if value not in ("auto", "release"):
        raise StartupError(f"{RESIDENCY_ENV}={value!r}: 'auto' (keep the static engine's cache where it fits, the "
                         "default) or 'release' (free it after every rollout)")
    return value == "release"
