"""How the worker's pinned host memory is allocated (set before CUDA's first use).

The actor's offload copies gradients and optimizer state into pinned host buffers (megatron/offload.py).
Pinning them with torch's default (one ``cudaHostAlloc`` per buffer, page by page on one thread) took
14.3 s for 17.3 GiB on an H200 host; ``cudaHostRegister`` on 8 threads took 3.8 s for the same buffers, and
the copies afterwards run at the same 55 GB/s (bench/NOTES.md, `bash bench/gpu_all.sh offload15
offload15reg`). A ``PYTORCH_CUDA_ALLOC_CONF`` that already names a pinned-memory option is left alone.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
PINNED_OPTIONS = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def pinned_host_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allocator setting to add (an empty dict when the user chose a pinned-memory setting)."""
    environ = os.environ if environ is None else environ
    current = environ.get(ALLOC_CONF, "").strip()
    if "pinned_" in current:
        return {}
    return {ALLOC_CONF: f"{current},{PINNED_OPTIONS}" if current else PINNED_OPTIONS}
