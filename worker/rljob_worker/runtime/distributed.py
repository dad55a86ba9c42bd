"""Where this process sits in the job, and the torch.distributed process group.

A worker pod of the PyTorchJob runs ``torchrun`` (one process per GPU). The variables come from two
places, and only some of them can be trusted:

- torchrun sets, per process: ``LOCAL_RANK``, ``RANK`` (global), ``GROUP_RANK`` (node index),
  ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE`` (global process count), ``MASTER_ADDR``, ``MASTER_PORT``.
- the Kubeflow training-operator sets, per pod: ``PET_NNODES``, ``PET_NODE_RANK``,
  ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` and (only when a Master replica
  exists) ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` = node index and ``WORLD_SIZE`` = pod count.

torchrun's values win when present. Outside torchrun the pod-level ``WORLD_SIZE`` is the number of
pods, not of processes, so it is never used as the world size; ``RANK`` is read as the node index.
Global rank = node_rank x nproc_per_node + local_rank.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DistEnv:
    """The position of one worker process in the job."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 1
    local_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(
                f"nnodes ({self.nnodes}) and nproc_per_node ({self.nproc_per_node}) must be >= 1"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is outside [0, nnodes={self.nnodes})")
        if not 0 <= self.local_rank < self.nproc_per_node:
            raise ValueError(
                f"local_rank={self.local_rank} is outside [0, nproc_per_node={self.nproc_per_node})"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def rank(self) -> int:
        return self.node_rank * self.nproc_per_node + self.local_rank


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` set to an integer; ``None`` if none is (e.g. PET_NPROC_PER_NODE=auto)."""
    for name in names:
        value = environ.get(name, "").strip()
        if not value:
            continue
        if ":" in value:  # elastic "min:max" form of PET_NNODES: a fixed-size job uses max
            value = value.rsplit(":", 1)[1]
        try:
            return int(value)
        except ValueError:
            continue
    return None


def dist_env_from_environ(environ: Mapping[str, str]) -> DistEnv:
    """Read the process position from torchrun / training-operator variables (pure).

    With nothing set this is a single process: world 1, master 127.0.0.1:29500.
    """
    under_torchrun = "LOCAL_RANK" in environ and (
        "LOCAL_WORLD_SIZE" in environ or "TORCHELASTIC_RUN_ID" in environ
    )
    master_addr = environ.get("MASTER_ADDR") or environ.get("PET_MASTER_ADDR") or DEFAULT_MASTER_ADDR
    master_port = _int(environ, "MASTER_PORT", "PET_MASTER_PORT") or DEFAULT_MASTER_PORT
    if under_torchrun:
        local_rank = _int(environ, "LOCAL_RANK") or 0
        nproc = _int(environ, "LOCAL_WORLD_SIZE", "PET_NPROC_PER_NODE") or 1
        world = _int(environ, "WORLD_SIZE")  # torchrun's WORLD_SIZE is the global process count
        nnodes = world // nproc if world else (_int(environ, "PET_NNODES") or 1)
        node_rank = _int(environ, "GROUP_RANK")
        if node_rank is None:
            global_rank = _int(environ, "RANK")
            node_rank = (
                global_rank // nproc if global_rank is not None else (_int(environ, "PET_NODE_RANK") or 0)
            )
    else:
        local_rank = 0
        nproc = _int(environ, "PET_NPROC_PER_NODE") or 1
        nnodes = _int(environ, "PET_NNODES") or 1
        # The operator's RANK is the node (pod) index; its WORLD_SIZE is the pod count: not used.
        node_rank = _int(environ, "PET_NODE_RANK", "RANK") or 0
    return DistEnv(
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        local_rank=local_rank,
        master_addr=master_addr,
        master_port=master_port,
    )


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(env: DistEnv, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Create the default process group (gloo on CPU, nccl on GPU). Idempotent.

    On GPU the current CUDA device becomes ``env.local_rank``. A single-process world uses an
    in-memory store, so no port is needed.
    """
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {env.rank} of {env.world_size}"
            )
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    # tcp:// also works under torchrun: torch connects to the agent's store as a client when
    # TORCHELASTIC_USE_AGENT_STORE is set.
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def destroy_distributed() -> None:
    """Tear down megatron's model-parallel groups (if any) and the default process group."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def init_from_environ(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """``dist_env_from_environ(os.environ)`` followed by ``init_distributed``; returns the env."""
    env = dist_env_from_environ(os.environ)
    init_distributed(env, backend=backend, timeout_s=timeout_s)
    return env


def barrier() -> None:
    """Wait for every rank; a no-op in a single-process world."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (pickled); returns `obj` itself in a single-process world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_grads(params: list[torch.nn.Parameter], group, divisor: float = 1.0) -> None:
    """Sum the ``.grad`` of ``params`` over ``group`` (skipped when it has one rank) in one flat
    all-reduce, then divide by ``divisor``: the CPU path's stand-in for megatron's gradient buffers."""
    grads = [p.grad for p in params if p.grad is not None]
    reduce = group is not None and dist.get_world_size(group) > 1
    if not grads or (not reduce and divisor == 1):
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    if reduce:
        dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat /= divisor
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def all_gather_rows(tensor: torch.Tensor, group, device: torch.device | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (same shape on each) along dim 0, in rank order of ``group``;
    ``tensor`` itself when the group has one rank. ``device``: where the collective runs (the GPU for
    NCCL); the result comes back on ``tensor``'s device."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    local = tensor.to(device) if device is not None else tensor
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts).to(tensor.device)
