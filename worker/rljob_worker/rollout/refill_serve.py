"""The rollout pool's serve loop with refilling rows (``rollout.partial`` on the static engine).

`RolloutPool` answers one request after another; with partial rollouts on the static engine it runs this loop
instead: every request's responses go into one `RefillingRows` session as soon as the request has arrived and its
``min_version`` is installed, so the rows that the tail of one batch leaves idle decode the next batches the
trainer has asked for (``rollout.mode`` bounds how many: ``maxStaleness``). Between runs of ``RUN_STEPS`` decode
steps (or a quarter of ``data.maxResponseLength``, the chunk of the batch-at-a-time loop, where that is fewer) the loop takes the requests that arrived (a receiving thread on the rollout leader holds them, so decoding
never waits for the trainer), installs the newest pushed weights, and answers each request once all of its
responses have ended, with the version of every token (a request's ``version`` is its oldest token's).

Every pool rank runs this loop in lockstep (commands and weights are broadcast, finished shares gathered each
round); each replica decodes its share of every request's prompt groups, as the batch-at-a-time loop does. The
sampler's seed is drawn once per session from the first request's seed (offset per replica), not per request.
A reply's ``seconds`` run from the request's arrival to its answer: requests overlap, so their seconds do too
(the trainer's rollout throughput metric is then per batch in flight, not per rollout GPU).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import torch.distributed as dist

from rljob_worker.rollout.base import RolloutOutput, SamplingParams
from rljob_worker.rollout.partial import chunk_tokens
from rljob_worker.rollout.static_refill import RefillingRows, sampler_of
from rljob_worker.rollout.synthetic_lengths import law_from_env
from rljob_worker.runtime.distributed import broadcast_object

log = logging.getLogger("rljob.rollout_pool")

RUN_STEPS = 64  # decode steps between two looks at the inbox and the pushed weights, at most (and a chunk's)


@dataclasses.dataclass
class _Request:
    id: int
    params: SamplingParams
    min_version: int
    prompts: list[list[int]]  # this replica's share (whole prompt groups)
    start: float = 0.0
    results: dict[int, Any] = dataclasses.field(default_factory=dict)  # response index -> Finished

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def done(self) -> bool:
        return len(self.results) == self.rows


class _Inbox(threading.Thread):
    """The rollout leader's receiving thread: commands from the actor leader, queued in order (a gloo recv blocks
    its thread, and the decode loop must not wait on the trainer)."""

    def __init__(self, link):
        super().__init__(name="rljob-rollout-inbox", daemon=True)
        self.link, self.commands = link, queue.Queue()

    def run(self) -> None:
        while True:
            try:
                command = self.link.recv_object(0)
            except RuntimeError as exc:  # the job is gone without a stop: the loop exits on this
                command = {"op": "stop", "lost": str(exc).split("] ", 1)[-1][:60]}
            self.commands.put(command)
            if command["op"] == "stop":
                return

    def take(self, block: bool) -> list[dict[str, Any]]:
        out = [self.commands.get()] if block else []
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out


class RefillServe:
    """The refilling serve loop of one pool rank (module docstring), over `RolloutPool`'s engine, weights and
    reply channel."""

    def __init__(self, pool):
        self.pool = pool
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        data = pool.spec.data
        self.prompt_budget, self.response_budget = data.max_prompt_length, data.max_response_length
        self.run_steps = min(RUN_STEPS, chunk_tokens(data.max_response_length))
        self.rows: RefillingRows | None = None
        self.waiting: list[_Request] = []  # arrived, not yet admitted (their min_version not installed, or a new sampler)
        self.active: dict[int, _Request] = {}  # admitted, not yet answered on this replica
        self.shares: dict[int, dict[int, Any]] = {}  # leader: request id -> replica -> its finished share
        self.meta: dict[int, tuple] = {}  # leader: request id -> (params, prompt count, start time, idle_s)
        self.inbox = _Inbox(pool.link) if pool.is_leader else None
        self.law = law_from_env()  # benchmarks only (rollout/synthetic_lengths.py)

    def run(self) -> int:
        if self.inbox is not None:
            self.inbox.start()
        stopping, busy, idle_since = False, False, time.perf_counter()
        while True:
            commands = self.inbox.take(block=not busy and not stopping) if self.inbox is not None else None
            idle_s = time.perf_counter() - idle_since
            commands = broadcast_object(commands)
            for command in commands:
                if command["op"] == "stop":
                    stopping = True
                    if command.get("lost"):
                        log.warning("rollout pool: the job stopped without a stop command (%s); exiting", command["lost"])
                        return 0
                elif command["op"] == "generate":
                    self._arrive(command, idle_s)
            if stopping and not busy:
                self.pool._drain_replies(0)
                if self.pool.receiver is not None:
                    self.pool.receiver.join(timeout=60)
                return 0
            head = self.waiting[0].min_version if self.waiting else -1
            live = self.rows is not None and self.rows.busy
            self.pool._install(head if not live and head > self.pool.version else self.pool.version)
            self._admit()
            finished = self.rows.run(self.run_steps, self.pool.version) if self.rows is not None and self.rows.busy else []
            for f in finished:
                self.active[f.key[0]].results[f.key[1]] = f
            mine = {rid: self._share(r) for rid, r in self.active.items() if r.done}
            for rid in mine:
                del self.active[rid]
            busy = self._exchange(mine, bool(self.active or self.waiting))
            idle_since = time.perf_counter()

    def _arrive(self, command: dict[str, Any], idle_s: float) -> None:
        from rljob_worker.rollout.every_rank import prompt_shares

        params = command["params"]
        share = prompt_shares(len(command["prompt_ids"]), self.world)[self.rank]
        self.waiting.append(_Request(command["id"], params, command["min_version"], command["prompt_ids"][share]))
        if self.pool.is_leader:
            self.shares[command["id"]] = {}
            self.meta[command["id"]] = (params, len(command["prompt_ids"]), time.perf_counter(), idle_s)

    def _admit(self) -> None:
        """Queue the arrived requests whose min_version is installed, in order, into the session; a request with
        another sampler or longer prompts / responses than the session holds waits until it has drained."""
        while self.waiting and self.waiting[0].min_version <= self.pool.version:
            request = self.waiting[0]
            if not self._fits(request):
                if self.rows is not None and self.rows.busy:
                    return
                self._new_session(request)
            self.waiting.pop(0)
            request.start = time.perf_counter()
            self.active[request.id] = request
            cap = request.params.max_new_tokens
            for i, prompt in enumerate(request.prompts):
                for j in range(request.params.n):
                    budget = cap if self.law is None else self.law.budget(prompt, j, request.params.seed, cap)
                    self.rows.add((request.id, i * request.params.n + j), prompt, budget)

    def _fits(self, request: _Request) -> bool:
        rows = self.rows
        return rows is not None and sampler_of(rows.params) == sampler_of(request.params) and all(
            rows.fits(p, request.params.max_new_tokens) for p in request.prompts)

    def _new_session(self, request: _Request) -> None:
        from rljob_worker.rollout.every_rank import replica_seed

        self.rows = None
        self.pool.engine.release_cache()
        params = request.params
        seed = replica_seed(params.seed, slice(self.rank, self.rank + 1), 1_000_003)
        self.rows = RefillingRows(
            self.pool.engine, dataclasses.replace(params, seed=seed),
            prompt_budget=max(self.prompt_budget, *map(len, request.prompts), 1),
            response_budget=max(self.response_budget, params.max_new_tokens))
        log.info("rollout pool: refilling rows, %d rows, a ring of %d slots", self.rows.capacity, self.rows.ring)

    def _share(self, request: _Request) -> dict[str, Any]:
        ordered = [request.results[k] for k in range(request.rows)]
        cap = request.params.max_new_tokens
        # a response ended by the synthetic law ended "as if by EOS" (rollout/synthetic_lengths.py)
        finished = [f.finished or (self.law is not None and len(f.ids) < cap) for f in ordered]
        return {"out": RolloutOutput([f.ids for f in ordered], [f.logprobs for f in ordered], finished),
                "versions": [f.versions for f in ordered], "seconds": time.perf_counter() - request.start}

    def _exchange(self, mine: dict[int, Any], busy: bool) -> bool:
        """Finished shares to the leader, which answers every request whose shares are all in; returns whether any
        replica still has work (the leader then does not block on its inbox)."""
        pieces = [(mine, busy)]
        if self.world > 1:
            pieces = [None] * self.world
            dist.all_gather_object(pieces, (mine, busy))
        if self.pool.is_leader:
            for replica, (shares, _) in enumerate(pieces):
                for rid, share in shares.items():
                    self.shares[rid][replica] = share
            for rid in sorted(rid for rid, got in self.shares.items() if len(got) == self.world):
                self._answer(rid)
        return any(b for _, b in pieces)

    def _answer(self, rid: int) -> None:
        from rljob_worker.rollout.every_rank import gather_in_batch_order, prompt_shares

        params, prompts, arrived, idle_s = self.meta.pop(rid)
        got = self.shares.pop(rid)
        pieces = [got[r] for r in range(self.world)]
        out = gather_in_batch_order([p["out"] if p["out"].response_ids else None for p in pieces],
                                    prompt_shares(prompts, self.world), params.n)
        versions = [v for p in pieces for v in p["versions"]]
        oldest = min((min(v) for v in versions if v), default=self.pool.version)
        self.pool._reply({"id": rid, "out": out, "version": oldest, "seconds": time.perf_counter() - arrived,
                          "idle_s": idle_s, "verified": self.pool.check and self.pool.version > 0,
                          "token_versions": versions})
