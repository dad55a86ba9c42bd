"""The actor pool and the critic pool as two torch.distributed worlds in one torchrun job.

With ``spec.critic.placement: split`` torchrun starts one world of ``nnodes x gpusPerNode`` processes; on
every node the local ranks ``[0, gpusPerNode - critic.gpus)`` are the actor pool (actor, reference model,
rollout engine) and the rest the critic pool. A shared critic with a megatron layout of its own
(``rljob_api.validation.critic_takes_turns``) gets ``2 x gpusPerNode`` processes per node: the first
``gpusPerNode`` are the actor pool, the rest the critic pool, and critic local rank ``gpusPerNode + i``
runs on GPU ``i`` beside actor local rank ``i``; the pools take turns (``colocated``). megatron-core keeps one parallel state per process,
built over the default process group, so each pool gets its **own default group** (over a PrefixStore of
the job's rendezvous store, with the pool rank and size) and megatron initialises per pool: the critic's
TP/PP/CP may differ from the actor's. One extra gloo group over all ranks (:class:`CrossPool`) carries
the commands and the small (N, T) tensors between the pools, on CPU.

Rank mapping (global rank g = node x (a + c) + local rank l; a = actor processes per node, c = critic
processes per node)::

    actor pool:  l < a,   pool rank = node x a + l
    critic pool: l >= a,  pool rank = node x c + (l - a)

Global rank 0 is the actor leader (pool rank 0), global rank ``a`` (node 0, local rank a) the critic leader.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rljob_worker.runtime.distributed import DistEnv

log = logging.getLogger(__name__)

ACTOR, CRITIC, ROLLOUT = "actor", "critic", "rollout"
# The critic pool waits on the cross-pool group for its next command through the actor's rollouts,
# validation and checkpoint uploads; a dead peer fails the job through torchrun, not through this timeout.
CROSS_POOL_TIMEOUT_S = 6 * 3600.0


@dataclass(frozen=True)
class PoolLayout:
    """Where the pools sit in the job (pure): ``actor_per_node`` + ``critic_per_node`` + ``rollout_per_node``
    processes per node, in that order of local ranks; each process has a GPU of its own, except that
    ``colocated`` critic processes share the actor's GPUs (one of each per GPU)."""

    nnodes: int
    actor_per_node: int
    critic_per_node: int = 0
    colocated: bool = False
    rollout_per_node: int = 0

    def __post_init__(self) -> None:
        if (self.nnodes < 1 or self.actor_per_node < 1 or min(self.critic_per_node, self.rollout_per_node) < 0
                or self.critic_per_node + self.rollout_per_node < 1):
            raise ValueError(f"a pool layout needs >= 1 node, >= 1 actor process per node and a second pool, got {self}")
        if self.colocated and (self.actor_per_node != self.critic_per_node or self.rollout_per_node):
            raise ValueError(f"colocated pools need one actor and one critic process per GPU, got {self}")

    @classmethod
    def from_spec(cls, spec) -> PoolLayout:
        from rljob_api.validation import (
            actor_gpus_per_node,
            critic_gpus_per_node,
            critic_in_own_pool,
            critic_takes_turns,
            rollout_gpus_per_node,
        )

        critic = critic_gpus_per_node(spec) if critic_in_own_pool(spec) else 0
        return cls(spec.nnodes, actor_gpus_per_node(spec), critic, critic_takes_turns(spec),
                   rollout_gpus_per_node(spec))

    @property
    def placement(self) -> str:
        """The spec field that asked for these pools, as the errors name it."""
        if self.rollout_per_node:
            return "spec.rollout.placement: separate"
        return f"spec.critic.placement: {'shared (taking turns)' if self.colocated else 'split'}"

    def cuda_index(self, local_rank: int) -> int:
        """The GPU of the process at torchrun ``local_rank``: its own, or the actor's beside it (colocated)."""
        return local_rank % self.actor_per_node if self.colocated else local_rank

    @property
    def per_node(self) -> int:
        return self.actor_per_node + self.critic_per_node + self.rollout_per_node

    @property
    def world_size(self) -> int:
        return self.nnodes * self.per_node

    @property
    def critic_leader(self) -> int:
        """Global rank of the critic pool's rank 0."""
        return self.actor_per_node

    @property
    def rollout_leader(self) -> int:
        """Global rank of the rollout pool's rank 0."""
        return self.actor_per_node + self.critic_per_node

    def role(self, global_rank: int) -> str:
        local = global_rank % self.per_node
        if local < self.actor_per_node:
            return ACTOR
        return CRITIC if local < self.actor_per_node + self.critic_per_node else ROLLOUT

    def pool_env(self, env: DistEnv) -> DistEnv:
        """``env`` (the torchrun world) seen from inside this process's pool: a world of the pool's ranks,
        with its own local rank, so ``env.rank`` is the pool rank. The CUDA device is
        :meth:`cuda_index` of the torchrun local rank."""
        if env.nproc_per_node != self.per_node or env.nnodes != self.nnodes:
            from rljob_worker.startup_errors import StartupError

            raise StartupError(f"{self.placement} needs torchrun to run {self.nnodes} x "
                               f"{self.per_node} processes, this process is one of {env.nnodes} x "
                               f"{env.nproc_per_node}; start it with `rljob run` or the operator's PyTorchJob")
        role = self.role(env.rank)
        if role == ACTOR:
            return dataclasses.replace(env, nproc_per_node=self.actor_per_node)
        if role == CRITIC:
            return dataclasses.replace(env, nproc_per_node=self.critic_per_node,
                                       local_rank=env.local_rank - self.actor_per_node)
        return dataclasses.replace(env, nproc_per_node=self.rollout_per_node,
                                   local_rank=env.local_rank - self.rollout_leader)

    def global_ranks(self, role: str) -> list[int]:
        return [g for g in range(self.world_size) if self.role(g) == role]


class CrossPool:
    """The gloo group over every rank of the job: objects (commands, CPU tensors) broadcast from one rank
    (global rank numbers) to all. Every rank must make the same calls in the same order."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.group.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``src``'s ``obj`` on every rank (pickled; tensors travel on the CPU)."""
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, src)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> PendingSend:
        """Start sending ``obj`` to group rank ``dst`` (matched by its :meth:`recv_object` with the same tag);
        returns at once. Messages of one tag arrive in the order sent."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        return PendingSend([self.group.send([size], dst, tag), self.group.send([data], dst, tag)], (size, data))

    def recv_object(self, src: int, tag: int = 0) -> Any:
        """The next object group rank ``src`` sent with ``tag`` (waits for it)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, tag).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.recv([data], src, tag).wait()
        return pickle.loads(data.numpy().tobytes())


@dataclass
class PendingSend:
    """A :meth:`CrossPool.send_object` in flight: its buffers live until :meth:`wait` returns."""

    works: list
    buffers: tuple

    def wait(self) -> None:
        for work in self.works:
            work.wait()


@dataclass(frozen=True)
class WeightsLink:
    """The weight push between the actor leader (rank 0) and the rollout leader: ``tensors`` carries the
    buckets (NCCL between GPUs, so the trainer's tensors never leave the device; gloo on CPU), ``headers``
    (gloo, on the CPU) everything else. The rollout leader's receiving thread waits on ``headers``: a GPU
    collective waiting for its peer would hold up every synchronising call on the rollout GPU until the next
    push (a cache release, a new communicator), and the next push waits for the rollout's batch."""

    tensors: Any
    headers: CrossPool


@dataclass
class Pools:
    """This process's pool: its role, the pool-local env (``pool_env.rank`` = pool rank), the layout and
    the cross-pool group."""

    role: str
    env: DistEnv
    world_env: DistEnv
    layout: PoolLayout
    cross: CrossPool | None  # actor + critic ranks (group rank = global rank), with a critic pool
    rollout_link: CrossPool | None = None  # actor + rollout ranks (see rollout_group_ranks), with a rollout pool
    weights_link: WeightsLink | None = None  # actor leader + rollout leader: the weight push

    @property
    def is_critic(self) -> bool:
        return self.role == CRITIC

    @property
    def is_rollout(self) -> bool:
        return self.role == ROLLOUT

    @property
    def cuda_index(self) -> int:
        return self.layout.cuda_index(self.world_env.local_rank)

    def actor_torchrun_environ(self) -> dict[str, str]:
        """torchrun's variables as the actor pool's world (an actor rank's LOCAL_RANK is already its pool
        local rank), for what reads them after start-up: vLLM's external launcher builds its groups from
        RANK / WORLD_SIZE over the default process group, which is the pool's."""
        e = self.env
        return {"RANK": str(e.rank), "WORLD_SIZE": str(e.world_size), "LOCAL_WORLD_SIZE": str(e.nproc_per_node)}


def _rendezvous_store(env: DistEnv, timeout: datetime.timedelta):
    """The job's store: under torchrun the agent hosts it (TORCHELASTIC_USE_AGENT_STORE) and the workers
    connect as clients; without torchrun global rank 0 hosts it. torch's tcp:// rendezvous does both."""
    url = f"tcp://{env.master_addr}:{env.master_port}"
    store, _, _ = next(dist.rendezvous(url, rank=env.rank, world_size=env.world_size, timeout=timeout))
    return store


def init_pools(env: DistEnv, layout: PoolLayout, backend: str | None = None,
               timeout_s: float = CROSS_POOL_TIMEOUT_S) -> Pools:
    """Default process group = this process's pool (over a PrefixStore per pool), plus the cross-pool gloo
    group over all ``layout.world_size`` ranks. On GPU the CUDA device is the torchrun local rank."""
    from rljob_worker.runtime.distributed import DEFAULT_TIMEOUT_S, default_backend

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised: the pools must be set up first")
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(layout.cuda_index(env.local_rank))
    pool_env = layout.pool_env(env)
    role = layout.role(env.rank)
    store = _rendezvous_store(env, datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    dist.init_process_group(backend, store=dist.PrefixStore(f"rljob_pool_{role}", store), rank=pool_env.rank,
                            world_size=pool_env.world_size, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)
    cross = rollout_link = weights_link = None
    if layout.critic_per_node:
        members = sorted(layout.global_ranks(ACTOR) + layout.global_ranks(CRITIC))
        if env.rank in members:  # with only these two pools: every rank, and the group rank is the global rank
            group = dist.ProcessGroupGloo(dist.PrefixStore("rljob_xpool", store), members.index(env.rank),
                                          len(members), timeout)
            cross = CrossPool(group, members.index(env.rank), len(members))
    if layout.rollout_per_node:
        members = rollout_group_ranks(layout)
        if env.rank in members:
            group = dist.ProcessGroupGloo(dist.PrefixStore("rljob_rollout_link", store), members.index(env.rank),
                                          len(members), timeout)
            rollout_link = CrossPool(group, members.index(env.rank), len(members))
        pushers = [0, layout.rollout_leader]  # the rollout leader hands each version on inside its pool
        if env.rank in pushers:
            rank = pushers.index(env.rank)
            weights_link = WeightsLink(
                tensors=_weights_group(dist.PrefixStore("rljob_weights", store), rank, len(pushers), backend, timeout),
                headers=CrossPool(dist.ProcessGroupGloo(dist.PrefixStore("rljob_weights_headers", store), rank,
                                                        len(pushers), timeout), rank, len(pushers)))
    log.info("%s: global rank %d is %s pool rank %d of %d", layout.placement, env.rank, role,
             pool_env.rank, pool_env.world_size)
    return Pools(role=role, env=pool_env, world_env=env, layout=layout, cross=cross, rollout_link=rollout_link,
                 weights_link=weights_link)


def rollout_group_ranks(layout: PoolLayout) -> list[int]:
    """Global ranks of the rollout link, in group-rank order: the actor pool's, then the rollout pool's (so the
    actor leader is group rank 0 and the rollout leader group rank ``nnodes x actor_per_node``)."""
    return layout.global_ranks(ACTOR) + layout.global_ranks(ROLLOUT)


def _weights_group(store, rank: int, size: int, backend: str, timeout: datetime.timedelta):
    """The group the new weights travel in: NCCL between GPUs (the trainer's tensors never leave the device),
    gloo on CPU. Rank 0 is the actor leader."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
