"""Rows that keep decoding while others wait for a tool: the static engine's continuous multi-turn generation.

The turn-batched agent loop (agent_loop.run_agent_loop) runs each turn of every trajectory in one engine call, so
a trajectory's second turn starts only after the longest first turn has ended, and re-prefills its whole
context. `RowStream` keeps every trajectory in one static-cache session instead: every few decode steps it
reports the rows whose turn ended (`poll`); a row whose tool has answered is resumed in place (`resume`): the
turn's last token and the tool response are written into the row's cache at fresh slots and the row decodes on
from there, while the other rows never stopped.

How a row continues without moving anything. All rows of a session write the same cache slot each step, and a
row's own positions (`_Session.pos`) and valid keys (`_Session.key_valid`) are per row, so a row's context need
not be contiguous in the cache. A resume therefore writes the new tokens at the next free slots, skips every row
past them (slots cost memory, not compute: attention reads the filled key buckets), and rebuilds the resumed row's
key mask from the slots it owns (its prompt, the tokens it fed, the new tokens), dropping the slots it wrote while
it waited. Positions run on from the context's length, so the tokens and log-probs are those a fresh prefill of
the whole context would give (up to the arithmetic's reordering), without re-reading the earlier turns.

The caller owns the budgets: `resume` refuses a row whose next turn would not fit the session's cache (the caller
then finishes it with an engine call of its own), and a turn is cut at its budget at the first poll after it.
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
        with torch.no_grad():
            engine._capture_buckets(s, self.sampler, {bucket_for(t, self.buckets) for t in range(width, s.length)})
            engine._start(s, prompts, width, params, self.gen)

    @property
    def live(self) -> bool:
        return any(r.live for r in self.rows)

    def room(self) -> int:
        """Slots a resume could fill now with new context and a sampled turn (the cache's free slots, less the
        steps a turn may run past its budget before the poll that cuts it)."""
        return self.session.length - self.slot - self.check_every

    @torch.no_grad()
    def poll(self) -> list[TurnEnd]:
        """Decode up to check_every steps while a row is live; return the turns that ended (at EOS, a stop token,
        or their budget). Their rows stop until resumed."""
        e, s = self.engine, self.session
        for _ in range(self.check_every):
            if not self.live or self.slot >= s.length:
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
            out.append(TurnEnd(i, row[:n], logprobs[k][r.turn_start - start:][:n], n > 0 and row[n - 1] in self.stops))
        return out

    @torch.no_grad()
    def resume(self, items: list[tuple[int, list[int], int]]) -> list[int]:
        """Continue rows after their turn: (row, new context tokens, budget of the next turn) each. The turn's
        last sampled token and the new tokens but the last are written at the next free slots (one forward for
        all rows), the last new token is fed by the next decode step. Returns the rows refused because their
        next turn does not fit the session's cache (they stay stopped; the caller finishes them elsewhere)."""
        for i, new, _ in items:
            if self.rows[i].live or not self.rows[i].turn_ids or not new:
                raise ValueError(f"row {i} has no ended turn to continue, or nothing to continue it with")
        width = max((len(new) for _, new, _ in items), default=0)
        refused = [i for i, _, budget in items if width + budget > self.room()]
        items = [item for item in items if item[0] not in refused]
        if items:
            self._resume(items)
        return refused

    def _resume(self, items: list[tuple[int, list[int], int]]) -> None:
        e, s = self.engine, self.session
        writes = []
        for i, new, _ in items:
            r = self.rows[i]
            first = max(r.turn_start, 1)  # tokens fed by steps (the first turn's first one came from the prefill)
            r.valid += self.step_slot[first:r.turn_start + len(r.turn_ids)]
            writes.append((i, [r.turn_ids[-1], *new[:-1]], r.length + len(r.turn_ids) - 1))
        width = max(len(w) for _, w, _ in writes)
        at = self.slot
        ids = torch.full((len(writes), width), e.pad, dtype=torch.long)
        pos = torch.zeros((len(writes), width), dtype=torch.long)
        keys = at + width
        mask = torch.zeros((len(writes), width, keys), dtype=torch.bool)
        new_valid = torch.zeros((len(writes), s.length), dtype=torch.bool)
        for k, (i, w, p) in enumerate(writes):
            r = self.rows[i]
            ids[k, :len(w)] = torch.tensor(w)
            pos[k, :len(w)] = torch.arange(p, p + len(w))
            own = torch.tensor(r.valid, dtype=torch.long)
            mask[k, :, own] = True
            for t in range(width):  # new token t sees the new tokens up to itself (a padded one: itself alone)
                if t < len(w):
                    mask[k, t, at:at + t + 1] = True
                else:
                    mask[k, t, at + t] = True
            r.valid += list(range(at, at + len(w)))
            new_valid[k, torch.tensor(r.valid, dtype=torch.long)] = True
        rows = torch.tensor([i for i, _, _ in writes], device=e.device)
        ids, pos, mask = ids.to(e.device), pos.to(e.device), mask.to(e.device)
        chunk = max(1, int(e.prefill_bytes // (3.5 * e.heads * width * keys * 4
                                               + 3 * width * e.cfg.intermediate_size * e.dtype.itemsize)))
        for lo in range(0, len(writes), chunk):  # the rows' caches up to the new slots: gathered, written, put back
            part = rows[lo:lo + chunk]
            view = object.__new__(type(s))
            view.k = [t[:, :, :keys].index_select(0, part) for t in s.k]
            view.v = [t[:, :, :keys].index_select(0, part) for t in s.v]
            e._forward(ids[lo:lo + chunk], pos[lo:lo + chunk], view, s.slots[at:keys], mask[lo:lo + chunk], keys)
            for full, gathered in zip((*s.k, *s.v), (*view.k, *view.v)):
                full[part, :, at:keys] = gathered[:, :, at:keys]
        s.key_valid[rows] = new_valid.to(e.device)
        last = torch.tensor([[new[-1]] for _, new, _ in items], device=e.device)
        s.tok[rows] = last
        s.pos[rows] = torch.tensor([[p + len(w)] for _, w, p in writes], device=e.device)
        s.done[rows] = False
        s.slot.add_(width)  # every row skips the written slots (the others' keys there stay invalid)
        self.slot += width
        for (i, new, budget), (_, w, _) in zip(items, writes):
            r = self.rows[i]
            r.length += len(r.turn_ids) + len(new)
            r.turn_start, r.budget, r.live, r.turn_ids = self.count, budget, True, []


class RowStreams:
    """The agent loop's way to open streams on a static engine (agent_loop.StreamFactory)."""

    def __init__(self, engine: HFStaticEngine):
        self.engine, self.max_rows = engine, engine.max_batch

    def __call__(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                 length_budget: int) -> RowStream:
        return RowStream(self.engine, prompts, params, budgets, length_budget)
