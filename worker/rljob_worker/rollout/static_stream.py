"""Rows that keep decoding while others wait for a tool: the static engine's continuous multi-turn generation.

The turn-batched agent loop (agent_loop.run_agent_loop) runs each turn of every trajectory in one engine call, so
a trajectory's second turn starts only after the longest first turn of the step has ended, and re-prefills its
whole context. `RowStream` keeps every trajectory in one static-cache session instead: every few decode steps it
reports the rows whose turn ended (`poll`); a row whose tool has answered is resumed in place (`resume`) while the
other rows never stopped.

How a row continues. The tool response is fed to the row through the decode steps themselves: its tokens are
written into the row's recorded tokens ahead of the step counter and marked forced (`_Session.forced`), so each
step feeds the row one of them (its K/V written at that step's slot, at the row's own next position) and records
it instead of a sample; the first sample after the last one opens the next turn. No extra forward runs (a separate
prefill of the new tokens costs a few ms of kernel launches per resume on a GPU, more than the decode steps it
would save at tool-response lengths), and the other rows' decoding is unchanged. The slots the row's steps wrote
while it waited are dropped from its keys. Positions run on from the context's length, so the tokens and log-probs
are those a fresh prefill of the whole context would give (up to the arithmetic's reordering). A resume whose
response and next turn cannot fit the session's cache is refused (`refused`): the caller finishes the row with an
engine call of its own. A turn is cut at its budget at the first poll after it reached it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rljob_worker.rollout.base import SamplingParams, first_stop
from rljob_worker.rollout.hf_static_engine import HFStaticEngine, _round_up, bucket_for, kv_buckets


@dataclass
class _Row:
    length: int  # tokens of context so far (the next token's position is this)
    turn_start: int  # the count at which this turn's first sampled token is recorded
    budget: int  # tokens this turn may sample
    live: bool = True
    turn_ids: list[int] = field(default_factory=list)  # the last ended turn's tokens


@dataclass(frozen=True)
class TurnEnd:
    row: int
    ids: list[int]
    logprobs: list[float]
    finished: bool  # ended at EOS or a stop token (else cut at its budget)


class RowStream:
    """``len(prompts)`` rows (<= the engine's max_batch) decoding in one session of ``length_budget`` tokens
    beyond the longest prompt. The first turn of row i samples up to ``budgets[i]`` tokens."""

    def __init__(self, engine: HFStaticEngine, prompts: list[list[int]], params: SamplingParams,
                 budgets: list[int], length_budget: int, check_every: int | None = None):
        if params.n != 1:
            raise ValueError("RowStream takes one row per sample (expand the prompts)")
        if not 0 < len(prompts) <= engine.max_batch:
            raise ValueError(f"RowStream takes 1..{engine.max_batch} rows, got {len(prompts)}")
        if max(budgets) > length_budget:
            raise ValueError(f"RowStream: a first turn of {max(budgets)} tokens does not fit {length_budget}")
        engine._check_stops(params)
        self.engine, self.params = engine, params
        self.check_every = check_every or (2 if engine.device.type == "cuda" else 1)  # a poll costs one sync
        self.sampler = engine._mode(params, engine.vocab)
        self.stops = {engine.eos, *params.stop_token_ids}
        width = _round_up(max(len(p) for p in prompts), 16)
        length = _round_up(width + length_budget + self.check_every, engine.length_multiple)
        self.session = s = engine._session_for(len(prompts), length)
        self.buckets = kv_buckets(s.length, engine.max_graphs)
        self.gen = None if params.seed is None else torch.Generator(device=engine.device).manual_seed(params.seed)
        self.width, self.count = width, 1  # the next decode step records token number `count`
        self.rows = [_Row(len(p), 0, b) for p, b in zip(prompts, budgets)]
        self.queued: list[tuple[int, list[int], int]] = []  # resumes to place at the next poll
        self.refused: list[int] = []  # rows whose next turn could not fit: the caller finishes them
        with torch.no_grad():
            engine._capture_buckets(s, self.sampler, {bucket_for(t, self.buckets) for t in range(width, s.length)})
            engine._start(s, prompts, width, params, self.gen)

    @property
    def slot(self) -> int:
        """The cache slot the next decode step writes: the step that records token c writes slot width + c - 1."""
        return self.width + self.count - 1

    @property
    def live(self) -> bool:
        return any(r.live for r in self.rows)

    @property
    def busy(self) -> bool:
        """Rows are decoding or waiting to be resumed."""
        return self.live or bool(self.queued)

    def resume(self, items: list[tuple[int, list[int], int]]) -> None:
        """Continue rows after their turn: (row, new context tokens, budget of the next turn) each, placed at the
        next poll (or refused there when they cannot fit the cache)."""
        for i, new, _ in items:
            r = self.rows[i]
            if r.live or not r.turn_ids or not new or any(q[0] == i for q in self.queued):
                raise ValueError(f"row {i} has no ended turn to continue, or nothing to continue it with")
        self.queued += items

    @torch.no_grad()
    def poll(self) -> list[TurnEnd]:
        """Place the queued resumes, decode up to check_every steps while a row is live, and return the turns that
        ended (at EOS, a stop token, or their budget). Their rows stop until resumed."""
        e, s = self.engine, self.session
        if self.queued:
            self._place(self.queued)
            self.queued = []
        for _ in range(self.check_every):
            if not self.live or self.slot >= s.length:  # the cache's end: _place keeps turns short of it
                break
            e._advance(s, bucket_for(self.slot, self.buckets), self.sampler, self.params, self.gen)
            self.count += 1
        live = [i for i, r in enumerate(self.rows) if r.live]
        if not live:
            return []
        done = s.done.cpu().tolist()
        ended = [i for i in live if done[i] or self.count - self.rows[i].turn_start >= self.rows[i].budget
                 or self.slot >= s.length]
        if not ended:
            return []
        start = min(self.rows[i].turn_start for i in ended)
        index = torch.tensor(ended, device=s.done.device)
        tokens = s.tokens[index, start:self.count].cpu().tolist()
        logprobs = s.logprobs[index, start:self.count].cpu().tolist()
        s.done[index] = True  # rows cut at their budget stop sampling
        out = []
        for k, i in enumerate(ended):
            r = self.rows[i]
            row = tokens[k][r.turn_start - start:][:r.budget]
            n = first_stop(row, self.stops)
            r.live, r.turn_ids = False, row[:n]
            out.append(TurnEnd(i, row[:n], logprobs[k][r.turn_start - start:][:n], n > 0 and row[n - 1] in self.stops))
        return out

    def _place(self, items: list[tuple[int, list[int], int]]) -> None:
        """Feed each row its new tokens through the next decode steps (module docstring); refuse the rows whose
        new tokens and next turn would not fit the cache."""
        e, s = self.engine, self.session
        rows, toks, pos, given_rows, given_at, given, junk_rows, junk_at = [], [], [], [], [], [], [], []
        for i, new, budget in items:
            r = self.rows[i]
            last = r.turn_start + len(r.turn_ids) - 1  # the count of the turn's last token
            fed = self.count - 1 > last  # a step after it fed it (its K/V are in the cache)
            feed = new if fed else [r.turn_ids[-1], *new]
            if self.slot + len(feed) - 1 + budget + self.check_every > s.length:
                self.refused.append(i)
                continue
            position = r.length + len(r.turn_ids) - len(feed) + len(new)  # of feed[0]
            rows.append(i)
            toks.append(feed[0])
            pos.append(position)
            at = range(self.count, self.count + len(feed) - 1)  # the counts whose token is given
            given_rows += [i] * len(at)
            given_at += list(at)
            given += feed[1:]
            # the slots its steps wrote after feeding the turn's last token (that one was fed at width + last)
            waited = range(self.width + last + 1, self.slot) if fed else range(0)
            junk_rows += [i] * len(waited)
            junk_at += waited
            r.length += len(r.turn_ids) + len(new)
            r.turn_start, r.budget, r.live, r.turn_ids = self.count + len(feed) - 1, budget, True, []
        if not rows:
            return
        dev = e.device

        def t(values):
            return torch.tensor(values, dtype=torch.long, device=dev)

        index = t(rows)
        s.tok[index] = t(toks)[:, None]
        s.pos[index] = t(pos)[:, None]
        if given:
            s.tokens[t(given_rows), t(given_at)] = t(given)
            s.forced[t(given_rows), t(given_at)] = True
        if junk_at:
            s.key_valid[t(junk_rows), t(junk_at)] = False
        s.done[index] = False


class RowStreams:
    """The agent loop's way to open streams on a static engine (agent_loop.StreamFactory)."""

    def __init__(self, engine: HFStaticEngine, check_every: int | None = None, length_budget: int | None = None):
        """``length_budget``: the sessions' tokens beyond the prompt, instead of the loop's (tests)."""
        self.engine, self.max_rows, self.check_every, self.length_budget = (
            engine, engine.max_batch, check_every, length_budget)

    def __call__(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                 length_budget: int) -> RowStream:
        return RowStream(self.engine, prompts, params, budgets, self.length_budget or length_budget,
                         self.check_every)
