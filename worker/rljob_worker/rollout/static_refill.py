"""Rows that never wait for a batch's longest response: continuous batching on the static engine, for a separate
rollout pool with ``rollout.partial``.

Batch-at-a-time generation (colocated sync, or a pool answering one request after another) decodes until the
longest response of the batch ends; with long-tailed lengths most rows sit finished for most of those steps, and a
static-cache decode step costs the same with one live row as with all of them. `RefillingRows` keeps one session
running instead: every ``check_every`` steps it takes out the rows that ended (EOS, a stop token, or their own
budget) and refills them with waiting prompts, so every row decodes for someone.

How a row is refilled. Every row has its own cache row, and a decode step writes all rows at one shared slot.
The cache is a ring of L slots: the slot (and the recorded-token index) wrap to 0 after L - 1; attention reads a
row's keys by its key mask, not by their order (RoPE is in the keys), so a row's context may sit anywhere in its
ring. A new prompt is prefilled in one eager forward of the refilled rows only, into the W slots just before the
next step's slot, at positions 0..W-1; the row's other slots are masked out, its first token is sampled from the
prefill and recorded at the last recorded index, and the next step continues it at position len(prompt), as a
fresh call would. A row lives at most W + budget + check_every steps <= L, so the ring never overwrites a slot a
live row still reads. Until the ring first wraps a step reads only the filled key buckets; afterwards all L.

Weights change between `run` calls (the pool loads a pushed version at a chunk boundary). A response that spans
a change keeps its cache: the keys of its earlier tokens stay those the older weights computed (no re-prefill,
as PipelineRL's in-flight updates), every token is tagged with the version that sampled it, and its recorded
log-prob is the probability it was really drawn with, so the trainer's truncated importance sampling
(``rolloutCorrection``) weighs it correctly and staleness is bounded by a response's oldest token.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch

from rljob_worker.rollout.base import SamplingParams, first_stop
from rljob_worker.rollout.hf_static_engine import HFStaticEngine, _round_up, _Session, bucket_for, kv_buckets
from rljob_worker.rollout.sampling import greedy_pick, race_sample, sample_next


@dataclass(frozen=True)
class Finished:
    """One response: ``key`` as given to `add`, its tokens and log-probs, whether it ended at EOS or a stop token
    (else at its budget), and the policy version of every token."""

    key: Any
    ids: list[int]
    logprobs: list[float]
    finished: bool
    versions: list[int]


@dataclass
class _Live:
    key: Any
    start: int  # the absolute token index of its first token
    budget: int
    versions: list[tuple[int, int]] = field(default_factory=list)  # (from absolute token index, version)


def sampler_of(params: SamplingParams) -> tuple:
    """What a session's sampling depends on: requests that agree on it can share one `RefillingRows`."""
    return (params.temperature, params.top_k, params.top_p, tuple(params.stop_token_ids))


class RefillingRows:
    """Prompts queued with `add` decode in the rows of one session (the engine's max_batch, fewer where the GPU's free
    memory holds fewer, or a larger session it kept) as rows free up; `run` decodes and returns the responses that
    ended. Prompts up to ``prompt_budget`` tokens and responses up to ``response_budget`` fit."""

    def __init__(self, engine: HFStaticEngine, params: SamplingParams, prompt_budget: int, response_budget: int,
                 check_every: int | None = None):
        engine._check_stops(params)
        self.engine, self.params = engine, params
        self.check_every = check_every or (16 if engine.device.type == "cuda" else 1)  # a poll costs one sync
        self.sampler = engine._mode(params, engine.vocab)
        self.stops = {engine.eos, *params.stop_token_ids}
        self.width = _round_up(max(1, prompt_budget), 16)
        self.response_budget = response_budget
        length = _round_up(self.width + response_budget + self.check_every, engine.length_multiple)
        self.session = s = engine._session_for(rows_that_fit(engine, length), length)
        self.ring = s.length
        self.buckets = kv_buckets(s.length, engine.max_graphs)
        self.gen = None if params.seed is None else torch.Generator(device=engine.device).manual_seed(params.seed)
        self.rows: list[_Live | None] = [None] * s.batch
        self.waiting: collections.deque[tuple[Any, list[int], int]] = collections.deque()
        self.count = 1  # tokens recorded per row so far, before wrapping: the next step records index count
        self.version = 0
        with torch.no_grad():  # the step compiles first (before any prompt), then the graphs are captured once
            engine._capture_buckets(s, self.sampler, set(self.buckets))
            self._reset()

    @property
    def slot_abs(self) -> int:
        """The slot the next step writes, before wrapping: the step recording token c writes width + c - 1 (the
        first prompts fill the slots below width)."""
        return self.width + self.count - 1

    @property
    def capacity(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    def fits(self, prompt: list[int], budget: int) -> bool:
        return len(prompt) <= self.width and 0 < budget <= self.response_budget

    def add(self, key: Any, prompt: list[int], budget: int) -> None:
        """Queue one response of up to ``budget`` tokens to ``prompt``; it starts when a row frees up."""
        if not prompt or not self.fits(prompt, budget):
            raise ValueError(f"a prompt of {len(prompt)} tokens and a budget of {budget} do not fit this session "
                             f"(<= {self.width} and <= {self.response_budget})")
        self.waiting.append((key, list(prompt), budget))

    @torch.no_grad()
    def run(self, max_steps: int, version: int) -> list[Finished]:
        """Decode up to ``max_steps`` steps (whole polls) under weights ``version``, refilling freed rows at every
        poll; stops early when nothing is live or waiting. Returns the responses that ended."""
        e, s = self.engine, self.session
        self.version = version
        for r in self.rows:
            if r is not None and r.versions[-1][1] != version:
                r.versions.append((self.count, version))
        out = self._harvest()
        self._refill()
        steps = 0
        while steps < max_steps and self.live:
            for _ in range(self.check_every):
                if self.slot_abs % self.ring == 0:
                    s.slot.zero_()
                if self.count % self.ring == 0:
                    s.count.zero_()
                keys = self.ring if self.slot_abs >= self.ring else bucket_for(self.slot_abs, self.buckets)
                e._advance(s, keys, self.sampler, self.params, self.gen)
                self.count += 1
            steps += self.check_every
            out += self._harvest()
            self._refill()
        return out

    def _reset(self) -> None:
        """Every row empty and finished; counters at the first slot after the prompt slots."""
        e, s, p = self.engine, self.session, self.params
        s.key_valid.zero_()
        s.tokens.fill_(e.pad)
        s.logprobs.zero_()
        s.forced.zero_()
        s.done.fill_(True)
        s.tok.fill_(e.pad)
        s.pos.zero_()
        s.slot.fill_(self.slot_abs)
        s.count.fill_(self.count)
        s.stops.fill_(e.eos)
        s.stops[1:1 + len(p.stop_token_ids)] = torch.tensor(p.stop_token_ids, dtype=torch.long)
        s.temperature.fill_(p.temperature if p.temperature > 0 else 1.0)
        if e.sample_in_step and self.sampler[0] != "greedy":
            s.gen.manual_seed(e._chunk_seed(self.gen))

    def _harvest(self) -> list[Finished]:
        """Take out the rows whose response ended (EOS / stop token, or its budget reached)."""
        s = self.session
        live = [i for i, r in enumerate(self.rows) if r is not None]
        if not live:
            return []
        done = s.done.cpu().tolist()
        ended = [i for i in live if done[i] or self.count - self.rows[i].start >= self.rows[i].budget]
        if not ended:
            return []
        index = torch.tensor(ended, device=s.done.device)
        tokens, logprobs = s.tokens[index].cpu(), s.logprobs[index].cpu()
        s.done[index] = True  # a row cut at its budget stops sampling until refilled
        out = []
        for k, i in enumerate(ended):
            r = self.rows[i]
            at = [(r.start + j) % self.ring for j in range(min(self.count - r.start, r.budget))]
            row = tokens[k, at].tolist()
            n = first_stop(row, self.stops)
            out.append(Finished(r.key, row[:n], logprobs[k, at[:n]].tolist(), n > 0 and row[n - 1] in self.stops,
                                _token_versions(r.versions, r.start, n)))
            self.rows[i] = None
        return out

    def _refill(self) -> None:
        """Prefill waiting prompts into the free rows (module docstring) and record each one's first token."""
        free = [i for i, r in enumerate(self.rows) if r is None]
        take = min(len(free), len(self.waiting))
        if not take:
            return
        e, s = self.engine, self.session
        dev = e.device
        new = [self.waiting.popleft() for _ in range(take)]
        rows = torch.tensor(free[:take], device=dev)
        width = _round_up(max(len(p) for _, p, _ in new), 16)
        slots = (torch.arange(width, device=dev) + self.slot_abs - width) % self.ring
        ids, positions, valid = e._left_padded([p for _, p, _ in new], width)  # as a fresh call
        key_mask = e._prefill_mask(valid)
        ar = torch.arange(width, device=dev)
        scratch = object.__new__(_Session)  # the new rows' prompt keys, then scattered into their ring slots
        scratch.k = [torch.empty((take, e.kv_heads, width, e.head_dim), dtype=e.dtype, device=dev) for _ in s.k]
        scratch.v = [torch.empty_like(t) for t in scratch.k]
        step = e.prefill_rows(width)
        logits = torch.cat([e._forward(ids[lo:lo + step], positions[lo:lo + step], scratch.rows(lo, lo + step),
                                       ar, key_mask[lo:lo + step]) for lo in range(0, take, step)])
        for cache, fresh in ((s.k, scratch.k), (s.v, scratch.v)):
            for layer, t in zip(cache, fresh):
                layer[rows[:, None], :, slots[None, :]] = t.permute(0, 2, 1, 3)
        s.key_valid[rows] = False
        s.key_valid[rows[:, None], slots[None, :]] = valid
        tok, lp = self._pick(logits)
        at = (self.count - 1) % self.ring  # the index the last step recorded at: the new rows' first token
        s.tokens[rows, at] = tok
        s.logprobs[rows, at] = lp.float()
        s.tok[rows] = tok[:, None]
        s.pos[rows] = positions[:, -1:] + 1
        s.done[rows] = (tok[:, None] == s.stops[None, :]).any(dim=-1)
        for i, (key, _, budget) in zip(free, new):
            self.rows[i] = _Live(key, self.count - 1, budget, [(self.count - 1, self.version)])

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first tokens of refilled rows: the decode step's sampler (its generator's stream), or on an eager
        CPU engine `sample_next` with the call's generator."""
        e, s, p = self.engine, self.session, self.params
        mode, top_k, top_p = self.sampler
        if mode == "greedy":
            return greedy_pick(logits)
        if not e.sample_in_step:
            return sample_next(logits, p.temperature, p.top_k, p.top_p, self.gen)
        uniform = torch.rand(logits.shape, generator=s.gen, device=logits.device)
        return race_sample(logits, s.temperature, uniform, top_k, top_p)


def session_bytes_per_row(engine: HFStaticEngine, length: int) -> int:
    """Device bytes one row of a session of ``length`` slots holds: its K and V in every layer, its recorded tokens,
    log-probs and masks, its sampler noise."""
    kv = 2 * engine.cfg.num_hidden_layers * engine.kv_heads * engine.head_dim * engine.dtype.itemsize
    return length * (kv + 8 + 4 + 3) + (engine.vocab * 4 if engine.sample_in_step else 0)


def rows_that_fit(engine: HFStaticEngine, length: int, free_bytes: int | None = None) -> int:
    """The session's rows: the engine's max_batch, fewer where the device's free memory (less room for a prefill
    and 1 GiB) cannot hold that many rows of ``length`` slots (a 7B model at 1k + 4k tokens takes 0.3 GB a row).
    A CPU is not limited here."""
    if free_bytes is None:
        if engine.device.type != "cuda":
            return engine.max_batch
        free_bytes = torch.cuda.mem_get_info(engine.device)[0]
    room = free_bytes - engine.prefill_bytes - 2**30
    fit = room // session_bytes_per_row(engine, length)
    if fit < 1:
        raise RuntimeError(f"refilling rows: not one row of {length} slots fits the {free_bytes / 2**30:.1f} GiB free "
                           "on the rollout GPU; lower data.maxPromptLength + data.maxResponseLength")
    return int(min(engine.max_batch, fit))


def _token_versions(segments: list[tuple[int, int]], start: int, n: int) -> list[int]:
    """The versions of tokens start..start+n-1 from (first token index, version) segments in order."""
    ends = [first for first, _ in segments[1:]] + [start + n]
    return [v for (first, v), end in zip(segments, ends) for _ in range(max(0, min(end, start + n) - max(first, start)))]
