"""The new weights from the trainer pool to a separate rollout pool: the actor leader sends each version to
the rollout leader over the two groups of a :class:`~rljob_worker.runtime.pools.WeightsLink` (the tensors over
NCCL between GPUs, gloo on CPU; every header over gloo); the rollout leader hands it to the rest of its pool
when it next installs weights, so every rollout rank installs the same version.

One push is a stream of HF-named full tensors (the trainer's TP/PP shards already gathered by
``export_hf_weights``) packed into buckets: per bucket a header ``{"version", "meta": [(name, shape,
dtype)], "nbytes"}`` and one flat byte tensor holding them all (dtypes mixed, bit for bit), then ``{"version",
"done", "partial", "fingerprint"}``; ``{"stop"}`` ends the receiver. The rollout leader receives in a
thread of its own (:class:`WeightReceiver`), so the trainer's push never waits for a generation to finish:
a version waits in one slot until the generating thread takes it, and a newer version arriving first
replaces it (LoRA's partial pushes merge into it, name by name). The thread waits for a push on the gloo
header group (on the CPU): a GPU collective is posted only once the trainer is sending, never left waiting for
a peer on the rollout GPU, where it would hold up every synchronising call (a cache release, a new
communicator) until the trainer's next push, which itself waits for the rollout's batch.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from rljob_worker.rollout.weight_sync import DEFAULT_BUCKET_BYTES, NamedTensor, bucket_named_tensors
from rljob_worker.runtime.pools import WeightsLink

log = logging.getLogger(__name__)


# Each tensor starts at a multiple of this many bytes, so it can be viewed in place as its own dtype.
ALIGN_BYTES = 16


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def pack_bucket(bucket: list[NamedTensor]) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], torch.Tensor]:
    """(meta, flat): every tensor's bytes one after another (each padded to ALIGN_BYTES) in a uint8 tensor on
    the first tensor's device."""
    meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    pieces = []
    for _, t in bucket:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pieces.append(data)
        if _padded(data.numel()) != data.numel():
            pieces.append(data.new_zeros(_padded(data.numel()) - data.numel()))
    return meta, torch.cat(pieces)


def unpack_bucket(meta: list[tuple[str, tuple[int, ...], torch.dtype]], flat: torch.Tensor) -> list[NamedTensor]:
    """The tensors of :func:`pack_bucket`, as views of ``flat``."""
    out, offset = [], 0
    for name, shape, dtype in meta:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        out.append((name, flat[offset:offset + nbytes].view(dtype).reshape(shape)))
        offset += _padded(nbytes)
    return out


def fingerprint(named: Iterable[NamedTensor]) -> str:
    """sha256 over names and bytes, in name order: equal exactly when every tensor is bit-equal."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()


def broadcast_header(link: WeightsLink, obj: Any, is_root: bool) -> Any:
    """Rank 0's ``obj`` on both ends of ``link`` (over its gloo header group, on the CPU)."""
    return link.headers.broadcast_object(obj if is_root else None, src=0)


def push_weights(link: WeightsLink, stream: Iterable[NamedTensor], *, version: int, device: torch.device,
                 partial: bool = False, check: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """The actor leader's side of one push; ``check`` adds the fingerprint the receivers verify. Returns
    {gb, buckets}."""
    sent, buckets, named = 0, 0, []
    for bucket in bucket_named_tensors(stream, bucket_bytes):
        meta, flat = pack_bucket([(name, t.to(device)) for name, t in bucket])
        broadcast_header(link, {"version": version, "meta": meta, "nbytes": flat.numel()}, True)
        _broadcast(link.tensors, flat)
        sent, buckets = sent + flat.numel(), buckets + 1
        if check:
            named.extend((name, t.cpu().clone()) for name, t in unpack_bucket(meta, flat))
    broadcast_header(link, {"version": version, "done": True, "partial": partial,
                            "fingerprint": fingerprint(named) if check else None}, True)
    return {"gb": sent / 1e9, "buckets": float(buckets)}


def stop_receivers(link: WeightsLink) -> None:
    broadcast_header(link, {"stop": True}, True)


class WeightReceiver:
    """The rollout leader's receiving thread: the newest complete version waits in one slot until :meth:`take`."""

    def __init__(self, link: WeightsLink, device: torch.device):
        self.link, self.device = link, device
        self._cond = threading.Condition()
        self._slot: tuple[int, dict[str, torch.Tensor], bool, str | None] | None = None
        self.latest = -1  # the newest version fully received (staged or taken)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rljob-weight-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while self._receive_one():
                pass
        except BaseException as exc:  # noqa: BLE001 - reported to the generating thread by wait_for
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _receive_one(self) -> bool:
        tensors: dict[str, torch.Tensor] = {}
        while True:
            header = broadcast_header(self.link, None, False)
            if header.get("stop"):
                return False
            if header.get("done"):
                break
            flat = torch.empty(header["nbytes"], dtype=torch.uint8, device=self.device)
            _broadcast(self.link.tensors, flat)
            tensors.update(unpack_bucket(header["meta"], flat))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the generating thread reads them next
        with self._cond:
            partial, digest = header["partial"], header["fingerprint"]
            if self._slot is not None and partial:  # an untaken version: this one's tensors win, the rest stay
                tensors = {**self._slot[1], **tensors}
                partial, digest = self._slot[2], None
            self._slot = (header["version"], tensors, partial, digest)
            self.latest = header["version"]
            self._cond.notify_all()
        return True

    def wait_for(self, version: int, timeout_s: float | None = None) -> int:
        """Wait until ``version`` (or a newer one) has arrived; returns the newest version received."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.latest >= version or self._error is not None, timeout_s):
                raise TimeoutError(f"weight push: version {version} did not arrive in {timeout_s} s")
            if self._error is not None:
                raise RuntimeError(f"weight push: the receiver failed: {self._error}") from self._error
            return self.latest

    def take(self) -> tuple[int, dict[str, torch.Tensor], bool, str | None] | None:
        """(version, tensors by name, partial, fingerprint) of the staged version, or None; frees the slot."""
        with self._cond:
            slot, self._slot = self._slot, None
            return slot
