"""A rollout pool of its own (``spec.rollout.placement: separate``): the rollout side's serve loop and the
actor side's handle on it.

The rollout pool's ranks (rollout.gpus of every node, :mod:`rljob_worker.runtime.pools`) each hold an hf
engine with the whole model and never train. The actor leader sends them requests over the rollout link
(point-to-point on gloo, so sending never waits): the rollout leader receives each, hands it to its pool,
every rollout rank samples its share of the prompt groups, and the leader sends the whole batch back, in
request order. Requests queue up, so the pool can generate batches ahead of the trainer
(``rollout.mode``); the trainer takes each answer when it needs it::

    actor leader -> rollout leader   {"op": "build", ...}          reply {"error"}
    actor leader -> rollout leader   {"op": "generate", "id", "prompt_ids", "params", "min_version"}
                                      reply {"id", "out", "version", "seconds", "idle_s", "verified",
                                             "token_versions"}
    actor leader -> rollout leader   {"op": "stop"}

Weights (:mod:`rljob_worker.rollout.weight_push`) travel beside the requests: after each optimizer step the
actor leader pushes version ``step`` to the rollout leader's receiving thread. Before generating a request,
the rollout leader waits for at least its ``min_version``, takes the newest version received and broadcasts
it to its pool, so all replicas sample with the same weights; the reply names that version, which every
sample of the batch carries (the trainer's staleness is its own version minus this one). With partial
rollouts (rollout/partial.py) later chunks of the batch may run under newer weights: the reply also carries
each token's version, and ``version`` stays the oldest.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from rljob_worker.rollout.base import RolloutOutput, SamplingParams
from rljob_worker.rollout.weight_push import (
    WeightReceiver,
    fingerprint,
    pack_bucket,
    push_weights,
    stop_receivers,
    unpack_bucket,
)
from rljob_worker.rollout.weight_sync import bucket_named_tensors
from rljob_worker.runtime.distributed import broadcast_object  # over the default group: this pool's
from rljob_worker.runtime.pools import Pools

log = logging.getLogger("rljob.rollout_pool")

# RLJOB_CHECK_WEIGHT_PUSH=1: each push carries a fingerprint of the trainer's tensors; the rollout leader
# checks what arrived against it and every rollout rank checks its engine's weights against what arrived.
CHECK_ENV = "RLJOB_CHECK_WEIGHT_PUSH"
MAX_REPLIES_IN_FLIGHT = 4


class RolloutPoolError(RuntimeError):
    """The rollout pool could not do what the actor leader asked (its message says what)."""


@dataclasses.dataclass
class Reply:
    """One generated batch: ``out`` (N responses), the policy ``version`` that generated every token of it,
    the rollout's seconds generating and idle before it, and whether the installed weights were checked."""

    id: int
    out: RolloutOutput
    version: int
    seconds: float
    idle_s: float
    verified: bool
    token_versions: list[list[int]] | None = None  # partial rollouts: the version of every token (N rows)

    def sample_versions(self) -> list[int]:
        """The oldest version behind each response (its first token's; ``version`` for an empty one)."""
        if self.token_versions is None:
            return [self.version] * len(self.out.response_ids)
        return [min(v, default=self.version) for v in self.token_versions]


class RolloutPoolClient:
    """The actor pool's handle on the rollout pool. Only the actor leader (global rank 0) talks to it; the
    other actor ranks take part in :meth:`push` only (they iterate the collective weight export)."""

    def __init__(self, pools: Pools, device: torch.device):
        from rljob_worker.runtime.pools import rollout_group_ranks

        self.link, self.device = pools.rollout_link, device
        self.is_leader = pools.world_env.rank == 0
        self.leader = rollout_group_ranks(pools.layout).index(pools.layout.rollout_leader)
        self.weights_link = pools.weights_link
        self.check = os.environ.get(CHECK_ENV) == "1"
        self._next_id = 0
        self._answers: dict[int, Reply] = {}
        self._outstanding: list[int] = []  # ids sent and not yet received, in order
        # gloo's send completes only once the peer receives, and the rollout leader may be finishing an earlier
        # answer: a request's send is waited for when its answer arrives (by then it was surely received)
        self._sends: dict[int, Any] = {}
        self._stopped = False

    def build(self, **engine_args: Any) -> str:
        """The rollout ranks build their engines (``make_engine`` arguments); returns when they are ready, with what
        they run in words (the actor leader's; "" elsewhere)."""
        if not self.is_leader:
            return ""
        self.link.send_object({"op": "build", "engine_args": engine_args}, self.leader).wait()
        reply = self.link.recv_object(self.leader)
        if reply["error"]:
            raise RolloutPoolError(f"rollout pool: {reply['error']}")
        return reply.get("engine", "")

    def submit(self, prompt_ids: list[list[int]], params: SamplingParams, min_version: int) -> int:
        """Queue a request (actor leader); returns its id at once."""
        rid, self._next_id = self._next_id, self._next_id + 1
        self._sends[rid] = self.link.send_object({"op": "generate", "id": rid, "prompt_ids": prompt_ids,
                                                  "params": params, "min_version": min_version}, self.leader)
        self._outstanding.append(rid)
        return rid

    def result(self, rid: int) -> Reply:
        """The answer to request ``rid`` (actor leader): answers come in request order; earlier ones are kept."""
        while rid not in self._answers:
            reply = self.link.recv_object(self.leader)
            if "error" in reply:
                raise RolloutPoolError(f"rollout pool: {reply['error']}")
            self._outstanding.remove(reply["id"])
            self._sends.pop(reply["id"]).wait()
            self._answers[reply["id"]] = Reply(**reply)
        return self._answers.pop(rid)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], version: int, partial: bool = False) -> dict[str, float]:
        """Send weights ``version``: every actor rank iterates ``stream`` (a collective export); the actor leader
        sends it. Returns {seconds, gb} on the leader."""
        if not self.is_leader:
            for _ in stream:
                pass
            return {}
        start = time.perf_counter()
        sent = push_weights(self.weights_link, stream, version=version, device=self.device, partial=partial,
                            check=self.check)
        return {"seconds": time.perf_counter() - start, "gb": sent["gb"]}

    def stop(self) -> None:
        """Answers still coming are awaited (a request is never cut off mid-batch), then the pool stops."""
        if self._stopped or not self.is_leader:
            self._stopped = True
            return
        self._stopped = True
        for rid in list(self._outstanding):
            self.result(rid)
        self.link.send_object({"op": "stop"}, self.leader).wait()
        stop_receivers(self.weights_link)


class RolloutPool:
    """The serve loop of one rollout-pool rank (see the module docstring)."""

    def __init__(self, spec, pools: Pools):
        self.spec, self.pools = spec, pools
        self.is_leader = pools.env.rank == 0  # pool rank 0 is the rollout leader
        self.link = pools.rollout_link
        self.engine = None
        self.version = -1  # the weights the engine holds (0: the model as loaded)
        self.receiver: WeightReceiver | None = None
        self.check = os.environ.get(CHECK_ENV) == "1"
        # answers in flight: the actor leader takes each only when its step needs it, so a send is not waited
        # for at once (the next request may already be here); the oldest are, beyond a few
        self._replies: collections.deque = collections.deque()

    def run(self) -> int:
        """Serve requests until ``stop``; the process exit code."""
        signal.signal(signal.SIGTERM, self._note_stop_signal)
        self.device = (torch.device("cuda", self.pools.cuda_index) if torch.cuda.is_available()
                       else torch.device("cpu"))
        idle_since = time.perf_counter()
        while True:
            try:
                command = self.link.recv_object(0) if self.is_leader else None
            except RuntimeError as exc:  # gloo: a peer is gone; the rank that failed reports why, not this one
                log.warning("rollout pool: the job stopped without a stop command (%s); exiting",
                            str(exc).split("] ", 1)[-1][:60])
                return 0
            command = broadcast_object(command)
            if command["op"] == "stop":
                self._drain_replies(0)
                if self.receiver is not None:
                    self.receiver.join(timeout=60)
                return 0
            if command["op"] == "build":
                self._build(command)
                if self._refills():
                    from rljob_worker.rollout.refill_serve import RefillServe

                    return RefillServe(self).run()
            else:
                idle_s = time.perf_counter() - idle_since
                self._generate(command, idle_s)
            idle_since = time.perf_counter()

    def _refills(self) -> bool:
        """Partial rollouts on the static engine run the refilling loop (rollout/refill_serve.py); other engines
        keep the chunked batch-at-a-time loop (rollout/partial.py)."""
        from rljob_worker.rollout.hf_static_engine import HFStaticEngine

        return bool(self.spec.rollout.partial) and isinstance(self.engine, HFStaticEngine)

    def _note_stop_signal(self, signum, _frame) -> None:
        log.warning("rollout pool: signal %d noted; the actor side decides when to save and stop", signum)

    def _reply(self, obj: dict[str, Any], wait: bool = False) -> None:
        if self.is_leader:
            self._replies.append(self.link.send_object(obj, 0))
            self._drain_replies(0 if wait else MAX_REPLIES_IN_FLIGHT)

    def _drain_replies(self, keep: int) -> None:
        while len(self._replies) > keep:
            self._replies.popleft().wait()

    def _build(self, command: dict[str, Any]) -> None:
        from rljob_worker.rollout.factory import make_engine

        try:
            if self.device.type == "cpu":
                from rljob_worker.megatron.cpu_compat import apply_cpu_patches

                apply_cpu_patches()
            self.engine = make_engine(device=self.device, **command["engine_args"])
            self.version = 0
            if self.is_leader:
                self.receiver = WeightReceiver(self.pools.weights_link, self.device)
                self.receiver.start()
        except Exception as exc:
            self._reply({"error": f"{type(exc).__name__}: {exc}"}, wait=True)
            raise
        log.info("rollout pool: %s ready on %s (pool rank %d of %d)", type(self.engine).__name__, self.device,
                 self.pools.env.rank, self.pools.env.world_size)
        loop = ("refilling rows (rows freed by a batch's short responses decode the next batches)" if self._refills()
                else "chunked batches" if self.spec.rollout.partial else "one batch at a time")
        self._reply({"error": None, "engine": f"{type(self.engine).__name__}, {loop}"}, wait=True)

    def _install(self, min_version: int) -> None:
        """The newest weights (at least ``min_version``) on every rollout rank; with RLJOB_CHECK_WEIGHT_PUSH each
        pushed version is checked bit-equal on arrival and once installed (a mismatch fails the job)."""
        staged = None
        if self.is_leader and min_version > self.version:
            self.receiver.wait_for(min_version)
        if self.is_leader:
            staged = self.receiver.take()
            if staged is not None and self.check and staged[3] is not None and fingerprint(staged[1].items()) != staged[3]:
                raise RolloutPoolError(f"weight push: version {staged[0]} arrived different from the trainer's")
        header = broadcast_object(None if staged is None else {"version": staged[0], "partial": staged[2]})
        if header is None:
            return
        tensors = _broadcast_tensors(staged[1] if self.is_leader else None, self.device)
        self.engine.update_weights(iter(tensors.items()), partial=header["partial"])
        self.version = header["version"]
        if self.check:
            held = dict(self.engine.model.named_parameters())
            wrong = [name for name, t in tensors.items() if name in held and not torch.equal(held[name].detach(), t)]
            if wrong:
                raise RolloutPoolError(f"weight push: version {self.version} installed different from what arrived: "
                                       f"{wrong[:3]}")

    def _generate(self, command: dict[str, Any], idle_s: float) -> None:
        from rljob_worker.rollout.every_rank import sample_share_and_gather

        self._install(command["min_version"])
        start, first_version = time.perf_counter(), self.version
        token_versions = None
        if self.spec.rollout.partial:
            out, token_versions = self._generate_partial(command["prompt_ids"], command["params"])
        else:
            out = sample_share_and_gather(self.engine, command["prompt_ids"], command["params"],
                                          rank=dist.get_rank(), world_size=dist.get_world_size())
        self.engine.release_cache()
        verified = self.check and self.version > 0  # every pushed version installed so far was checked
        self._reply({"id": command["id"], "out": out, "version": first_version, "seconds": time.perf_counter() - start,
                     "idle_s": idle_s, "verified": verified, "token_versions": token_versions})

    def _generate_partial(self, prompt_ids: list[list[int]], params: SamplingParams):
        """This replica's share in chunks, newer weights loaded between them (rollout/partial.py); every replica
        goes through the same chunks (the loads are collective), then the shares are gathered in batch order.
        Returns (RolloutOutput, token versions per response)."""
        from rljob_worker.rollout.every_rank import gather_in_batch_order, prompt_shares, replica_seed
        from rljob_worker.rollout.partial import chunk_tokens, generate_partial

        world = dist.get_world_size() if dist.is_initialized() else 1
        shares = prompt_shares(len(prompt_ids), world)
        share = shares[dist.get_rank() if dist.is_initialized() else 0]
        params = dataclasses.replace(params, seed=replica_seed(params.seed, share, params.n))

        def refresh() -> int:
            self._install(self.version)  # whatever arrived since; never waits for a push
            return self.version

        mine = generate_partial(self.engine.generate, refresh, prompt_ids[share], params, self.version,
                                chunk_tokens(params.max_new_tokens))
        pieces: list[Any] = [mine]
        if world > 1:
            pieces = [None] * world
            dist.all_gather_object(pieces, mine)
        out = gather_in_batch_order([p.out if p.out.response_ids else None for p in pieces], shares, params.n)
        return out, [v for p in pieces for v in p.token_versions]


def _broadcast_tensors(tensors: dict[str, torch.Tensor] | None, device: torch.device) -> dict[str, torch.Tensor]:
    """Pool rank 0's tensors (None elsewhere) on every rank of this pool, bucket by bucket, bit for bit."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensors
    buckets = list(bucket_named_tensors(iter(tensors.items()))) if tensors is not None else []
    out: dict[str, torch.Tensor] = {}
    for index in range(broadcast_object(len(buckets) if tensors is not None else None)):
        meta, flat = pack_bucket(buckets[index]) if tensors is not None else (None, None)
        meta, nbytes = broadcast_object((meta, flat.numel()) if tensors is not None else None)
        if flat is None:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0)
        if tensors is None:
            out.update((name, t.clone()) for name, t in unpack_bucket(meta, flat))
    return tensors if tensors is not None else out
