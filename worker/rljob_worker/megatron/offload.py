"""Give the GPU memory of the actor's parameters, gradient buffers and optimizer state back between
phases (so a colocated rollout engine can use it), and take it again.

Mechanism: the memory is released at the level of *storages*, not tensors. For every storage that
backs a tracked tensor, the bytes are copied to a (pinned, reused) host buffer, then the device
storage is resized to 0; onload resizes it back and copies the bytes in. Every tensor object and
every view stays valid across the round trip, which is what megatron needs: ``param.data`` and
``param.main_grad`` are views into DDP's contiguous ``param_data`` / ``grad_data`` buffers, the
distributed optimizer's shards and ``model_param.main_param`` are views or separate fp32 tensors
referenced from several places, and the inner torch optimizer keys its state by tensor identity.
(megatron-core 0.16.1 frees DDP's grad buffers the same way in ``offload_grad_buffers``.)

Gradient storages are freed *without* a copy (``keep_values=False``): the actor zeroes the gradient
buffers at the start of every update, so their content between phases is dead; onload reallocates
and zeroes them.

A storage shared by several tracked tensors is handled once. Each storage belongs to exactly one
category (the first that lists it, in the order params, grads, optimizer), so offloading only the
optimizer never frees a parameter that an fp32 optimizer uses as its own main parameter.

:func:`assert_materialized` checks that tensors are on the expected device and backed by memory;
the actor runs it after every onload, so nothing is ever silently left behind (a freed storage
read by a kernel is garbage, not an error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

CATEGORIES = ("params", "grads", "optimizer")


class OffloadStateError(RuntimeError):
    """A tensor is on the wrong device or its memory is not there (still offloaded)."""


def _storage_key(t: torch.Tensor) -> int:
    """Identity of the StorageImpl behind ``t`` (stable while its memory is freed and reallocated)."""
    return t.untyped_storage()._cdata


def _needed_bytes(t: torch.Tensor) -> int:
    """Bytes of its storage that ``t`` reads (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    extent = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return extent * t.element_size()


def tensor_problem(t: torch.Tensor, device: torch.device | str) -> str | None:
    """Why ``t`` is not usable on ``device`` (wrong device, or storage freed/too small), else None."""
    device = torch.device(device)
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        return f"is on {t.device}, expected {device}"
    need = _needed_bytes(t)
    if need:
        storage = t.untyped_storage()
        if storage.nbytes() < need or storage.data_ptr() == 0:
            return f"has no memory behind it (storage {storage.nbytes()} of {need} bytes): still offloaded"
    return None


def assert_materialized(
    named: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str | Mapping[str, torch.device | str],
    what: str = "tensor",
) -> int:
    """Raise :class:`OffloadStateError` unless every tensor is on its expected device with its memory.

    ``device``: one device for all, or a ``{name: device}`` map (names missing from it are checked
    against nothing but their memory). Returns how many tensors were checked.
    """
    bad: list[str] = []
    n = 0
    for name, t in named:
        n += 1
        if isinstance(device, Mapping):
            expected = device.get(name, t.device)
        else:
            expected = device
        problem = tensor_problem(t, expected)
        if problem is not None:
            bad.append(f"{name} {problem}")
    if bad:
        more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
        raise OffloadStateError(f"{len(bad)} {what}(s) not where they must be: " + "; ".join(bad[:8]) + more)
    return n


@dataclass
class _Block:
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    first_name: str
    keep_values: bool


@dataclass
class StorageOffloader:
    """Frees and restores the memory of whole storages, grouped in named categories.

    ``host_pin``: copy into pinned host memory (only possible with CUDA). Host buffers are kept in a
    pool by size and reused by later offloads (pinning costs ~1 s per GB, the copy itself ~0.02 s per GB
    on an H200): a storage that an optimizer re-creates every step takes a free buffer of its size instead
    of pinning a new one, and the pinned memory stays bounded by the most bytes offloaded at once.
    """

    host_pin: bool = True
    # seconds of the last offload / onload by phase (host_alloc, copy_issue, copy_wait, release / alloc, ...)
    last_timing: dict[str, float] = field(default_factory=dict)
    _offloaded: dict[str, list[_Block]] = field(default_factory=dict)
    _host: dict[int, torch.Tensor] = field(default_factory=dict)  # storage -> its buffer while offloaded
    _free: dict[tuple[int, bool], list[torch.Tensor]] = field(default_factory=dict)  # (bytes, pinned) -> buffers

    @property
    def offloaded(self) -> tuple[str, ...]:
        return tuple(self._offloaded)

    def host_bytes(self) -> int:
        """Host memory this offloader holds (in use and free for reuse)."""
        return sum(t.numel() for t in self._host.values()) + sum(
            t.numel() for bufs in self._free.values() for t in bufs)

    def _take_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        free = self._free.get((nbytes, pin))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def offload(
        self, category: str, named: Iterable[tuple[str, torch.Tensor]], keep_values: bool = True
    ) -> int:
        """Release the memory of the distinct storages behind ``named``; returns the bytes released.

        Storages already released (by another category, or earlier) are skipped. Host copies are
        started asynchronously and waited for once before any memory is released.
        """
        if category in self._offloaded:
            raise OffloadStateError(f"{category} are already offloaded")
        taken_keys = {b.storage._cdata for blocks in self._offloaded.values() for b in blocks}
        blocks: list[_Block] = []
        seen: set[int] = set()
        for name, t in named:
            key = _storage_key(t)
            if key in seen or key in taken_keys:
                continue
            seen.add(key)
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:
                if t.numel():
                    raise OffloadStateError(f"{category}: {name} has no memory behind it before the offload")
                continue
            blocks.append(_Block(storage, nbytes, t.device, name, keep_values))
        # copy out (async into pinned memory on CUDA), wait once, then release
        timing = {"host_alloc": 0.0, "copy_issue": 0.0}
        for b in blocks:
            if b.keep_values:
                t = time.perf_counter()
                host = self._take_host(b.nbytes, self.host_pin and b.device.type == "cuda")
                self._host[b.storage._cdata] = host
                timing["host_alloc"] += time.perf_counter() - t
                t = time.perf_counter()
                host.untyped_storage().copy_(b.storage, non_blocking=b.device.type == "cuda")
                timing["copy_issue"] += time.perf_counter() - t
        t = time.perf_counter()
        if any(b.device.type == "cuda" for b in blocks):
            torch.cuda.synchronize()
        timing["copy_wait"] = time.perf_counter() - t
        t = time.perf_counter()
        for b in blocks:
            b.storage.resize_(0)
        timing["release"] = time.perf_counter() - t
        self.last_timing = timing
        self._offloaded[category] = blocks
        return sum(b.nbytes for b in blocks)

    def onload(self, category: str) -> int:
        """Reallocate the storages of ``category`` on their devices and restore their bytes (zeros for
        ``keep_values=False``); returns the bytes restored. A category not offloaded is a no-op."""
        blocks = self._offloaded.pop(category, None)
        if not blocks:
            return 0
        timing = {"alloc": 0.0, "copy_issue": 0.0}
        for b in blocks:
            if b.storage.nbytes() != 0:
                raise OffloadStateError(
                    f"{category}: the storage of {b.first_name} was reallocated behind the offloader's back"
                )
            t = time.perf_counter()
            b.storage.resize_(b.nbytes)
            timing["alloc"] += time.perf_counter() - t
            t = time.perf_counter()
            if b.keep_values:
                b.storage.copy_(self._host[b.storage._cdata].untyped_storage(), non_blocking=b.device.type == "cuda")
            else:
                torch.empty(0, dtype=torch.uint8, device=b.device).set_(b.storage).zero_()
            timing["copy_issue"] += time.perf_counter() - t
        t = time.perf_counter()
        if any(b.device.type == "cuda" for b in blocks):
            torch.cuda.synchronize()
        timing["copy_wait"] = time.perf_counter() - t
        for b in blocks:  # copied in: the buffers are free for the next offload of any storage of their size
            host = self._host.pop(b.storage._cdata, None)
            if host is not None:
                self._free.setdefault((host.numel(), host.is_pinned()), []).append(host)
        self.last_timing = timing
        return sum(b.nbytes for b in blocks)


OFFLOAD_MODE_ENV = "RLJOB_OFFLOAD"  # "always": keep offloading even when the rollout fits beside the state
HEADROOM = 0.10  # of the device's memory, left free for fragmentation and a longer rollout than the first


def offload_still_needed(total_bytes: int, rollout_peak_bytes: int, offloaded_bytes: int,
                         headroom: float = HEADROOM) -> bool:
    """After the first rollout: whether the offloaded state must keep leaving the GPU.

    ``rollout_peak_bytes``: the rollout's peak allocation on this device, measured with the state
    offloaded (so it already holds everything that stayed); ``offloaded_bytes``: what the offload moved.
    The state can stay when both fit below ``(1 - headroom)`` of the device's memory."""
    return rollout_peak_bytes + offloaded_bytes > total_bytes * (1.0 - headroom)
