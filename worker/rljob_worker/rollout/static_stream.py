"""Rows that keep decoding while others wait for a tool: the static engine's continuous multi-turn generation.

The turn-batched agent loop (agent_loop.run_agent_loop) runs each turn of every trajectory in one engine call, so
a trajectory's second turn starts only after the longest first turn has ended, and re-prefills its whole
context. `RowStream` keeps every trajectory in one static-cache session instead: every few decode steps it
reports the rows whose turn ended (`poll`); a row whose tool has answered is resumed in place (`resume`): the
turn's last token and the tool response are written into the row's cache at fresh slots and the row decodes on
from there, while the other rows never stopped.

How a row continues without moving anything. All rows of a session write the same cache slot each step, but each
row has its own cache, positions (`_Session.pos`) and valid keys (`_Session.key_valid`), so a row's context need
not be contiguous. While a row waits for its tool, the decode steps write junk into its own slots; a resume writes
the turn's last token and the tool response into the last of those slots (computed in one forward over a copy of
the resumed rows' caches, then put in place), rebuilds the row's key mask from the slots it owns (its prompt, the
tokens it fed, the new tokens) and the row decodes on. Positions run on from the context's length, so the tokens
and log-probs are those a fresh prefill of the whole context would give (up to the arithmetic's reordering),
without re-reading the earlier turns. A response longer than the row's wait is placed when the wait has grown
enough, or at once by skipping every row ahead a few slots where the cache has room for every live row's budget
(skipped slots cost memory, not compute); a row whose next turn cannot fit is refused (`refused`) and the caller
finishes it with an engine call of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rljob_worker.rollout.base import SamplingParams, first_stop
from rljob_worker.rollout.hf_static_engine import HFStaticEngine, _round_up, bucket_for, kv_buckets


@dataclass
class _Row:
    valid: list[int]  # cache slots holding this row's context (its keys)
    length: int  # tokens of context so far (the next token's position is this)
    turn_start: int  # the count at which this turn's first token was recorded
    budget: int  # tokens this turn may sample
    live: bool = True
    turn_ids: list[int] = field(default_factory=list)  # the last ended turn's tokens (the last one never fed)


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
        self.slot, self.count = width, 1  # the next decode step writes `slot` and records token number `count`
        self.step_slot: list[int] = [-1]  # step_slot[c]: the slot written by the step that recorded token c
        self.rows = [_Row(list(range(width - len(p), width)), len(p), 0, b) for p, b in zip(prompts, budgets)]
        self.queued: list[tuple[int, list[int], int]] = []  # resumes waiting for room (module docstring)
        self.refused: list[int] = []  # rows whose next turn could not fit: the caller finishes them
        self.skipped = 0  # slots skipped to place responses longer than their rows' wait
        self.deferred = 0  # polls a queued resume waited for its row's wait to grow
        with torch.no_grad():
            engine._capture_buckets(s, self.sampler, {bucket_for(t, self.buckets) for t in range(width, s.length)})
            engine._start(s, prompts, width, params, self.gen)

    @property
    def live(self) -> bool:
        return any(r.live for r in self.rows)

    @property
    def busy(self) -> bool:
        """Rows are decoding or waiting to be resumed."""
        return self.live or bool(self.queued)

    def resume(self, items: list[tuple[int, list[int], int]]) -> None:
        """Continue rows after their turn: (row, new context tokens, budget of the next turn) each. Placed at the
        next poll where the cache allows (see the module's docstring), else refused (`refused`)."""
        for i, new, _ in items:
            r = self.rows[i]
            if r.live or not r.turn_ids or not new or any(q[0] == i for q in self.queued):
                raise ValueError(f"row {i} has no ended turn to continue, or nothing to continue it with")
        self.queued += items

    @torch.no_grad()
    def poll(self) -> list[TurnEnd]:
        """Place the queued resumes that fit, decode up to check_every steps while a row is live, and return the
        turns that ended (at EOS, a stop token, or their budget). Their rows stop until resumed."""
        e, s = self.engine, self.session
        self._place()
        for _ in range(self.check_every):
            if not self.live or self.slot >= s.length:  # the cache's end: _place keeps turns short of it
                break
            e._advance(s, bucket_for(self.slot, self.buckets), self.sampler, self.params, self.gen)
            self.step_slot.append(self.slot)
            self.slot += 1
            self.count += 1
        live = [i for i, r in enumerate(self.rows) if r.live]
        if not live:
            return []
        done = s.done[live].cpu().tolist()
        ended = [i for i, d in zip(live, done) if d or self.count - self.rows[i].turn_start >= self.rows[i].budget
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
            r.valid += self.step_slot[max(r.turn_start, 1):r.turn_start + n]  # the slots of the tokens it fed
            out.append(TurnEnd(i, row[:n], logprobs[k][r.turn_start - start:][:n], n > 0 and row[n - 1] in self.stops))
        return out

    # -- placing resumes
    def _fits(self, skip: int, budgets: list[int]) -> bool:
        """Whether every live row's rest of turn and each of ``budgets`` fit the cache after skipping ``skip``
        slots (a turn may run check_every - 1 steps past its budget before the poll that cuts it)."""
        rest = [r.budget - (self.count - r.turn_start) for r in self.rows if r.live]
        return self.slot + skip + max(rest + budgets, default=0) + self.check_every <= self.session.length

    def _place(self) -> None:
        """Resume the queued rows whose response fits their wait; the others too if a skip that makes room fits
        every live row's budget; refuse a row that cannot fit even with nothing else live."""
        if not self.queued:
            return
        need = {i: len(new) - (self.slot - (self.rows[i].valid[-1] + 1)) for i, new, _ in self.queued}
        now = [q for q in self.queued if need[q[0]] <= 0 and self._fits(0, [q[2]])]
        later = [q for q in self.queued if q not in now]
        skip = max(0, max((need[q[0]] for q in later), default=0))
        if later and self._fits(skip, [q[2] for q in now + later]):
            now, later = now + later, []
        else:
            skip = 0
        if not now and not self.live:  # nothing decodes, so nothing frees: fit whom we can, refuse the rest
            later.sort(key=lambda q: q[2])
            while later and not self._fits(max(0, max(need[q[0]] for q in later)), [q[2] for q in later]):
                self.refused.append(later.pop()[0])  # the largest budget first
            now, later = later, []
            skip = max(0, max((need[q[0]] for q in now), default=0))
        self.queued = later
        self.deferred += len(later)
        if now:
            self.slot += skip
            self.skipped += skip
            self.session.slot.add_(skip)  # every row skips these (the others' keys there stay invalid)
            self._write(now)

    def _write(self, items: list[tuple[int, list[int], int]]) -> None:
        """Write each row's turn's last token and its new tokens but the last at the row's slots just before the
        next one (one forward over a copy of the rows' caches), and hand the last new token to the next step."""
        e, s = self.engine, self.session
        at, width = self.slot, max(len(new) for _, new, _ in items)
        keys = at + width  # the copy's new tokens sit at slots at.. (right-padded), then move to their own slots
        ids = torch.full((len(items), width), e.pad, dtype=torch.long)
        pos = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros((len(items), width, keys), dtype=torch.bool)
        new_valid = torch.zeros((len(items), s.length), dtype=torch.bool)
        src_rows, src_slots, dst_rows, dst_slots = [], [], [], []
        for k, (i, new, _) in enumerate(items):
            r = self.rows[i]
            w = [r.turn_ids[-1], *new[:-1]]
            p = r.length + len(r.turn_ids) - 1  # the position of the turn's last token
            ids[k, :len(w)] = torch.tensor(w)
            pos[k, :len(w)] = torch.arange(p, p + len(w))
            mask[k, :, torch.tensor(r.valid, dtype=torch.long)] = True
            for t in range(width):  # new token t sees the new tokens up to itself (a padded one: itself alone)
                mask[k, t, at + (0 if t < len(w) else t):at + t + 1] = True
            own = list(range(at - len(w), at))  # the row's last waiting slots
            src_rows += [k] * len(w)
            src_slots += list(range(at, at + len(w)))
            dst_rows += [i] * len(w)
            dst_slots += own
            r.valid += own
            new_valid[k, torch.tensor(r.valid, dtype=torch.long)] = True
        dev = e.device
        rows = torch.tensor([i for i, _, _ in items], device=dev)
        ids, pos, mask = ids.to(dev), pos.to(dev), mask.to(dev)
        src_rows, src_slots = torch.tensor(src_rows, device=dev), torch.tensor(src_slots, device=dev)
        dst_rows, dst_slots = torch.tensor(dst_rows, device=dev), torch.tensor(dst_slots, device=dev)
        view = object.__new__(type(s))
        view.k, view.v = [], []
        for full, out in [(t, view.k) for t in s.k] + [(t, view.v) for t in s.v]:
            copy = full.new_zeros((len(items), full.shape[1], keys, full.shape[3]))
            copy[:, :, :at] = full[:, :, :at].index_select(0, rows)
            out.append(copy)
        e._forward(ids, pos, view, torch.arange(at, keys, device=dev), mask, keys)
        for full, copy in zip((*s.k, *s.v), (*view.k, *view.v)):
            full[dst_rows, :, dst_slots] = copy[src_rows, :, src_slots]
        s.key_valid[rows] = new_valid.to(dev)
        s.tok[rows] = torch.tensor([[new[-1]] for _, new, _ in items], device=dev)
        s.pos[rows] = torch.tensor([[self.rows[i].length + len(self.rows[i].turn_ids) + len(new) - 1]
                                    for i, new, _ in items], device=dev)
        s.done[rows] = False
        for i, new, budget in items:
            r = self.rows[i]
            r.length += len(r.turn_ids) + len(new)
            r.turn_start, r.budget, r.live, r.turn_ids = self.count, budget, True, []


class RowStreams:
    """The agent loop's way to open streams on a static engine (agent_loop.StreamFactory)."""

    def __init__(self, engine: HFStaticEngine, check_every: int | None = None):
        self.engine, self.max_rows, self.check_every = engine, engine.max_batch, check_every

    def __call__(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                 length_budget: int) -> RowStream:
        return RowStream(self.engine, prompts, params, budgets, length_budget, self.check_every)
