"""The static engine's continuous rows (rollout/static_stream.py) and the agent loop over them.

A row resumed in place (its turn's last token and the tool response written at fresh cache slots, the slots it
wrote while waiting dropped from its keys) must sample what a fresh prefill of its whole context samples: greedy
tokens equal to the HF engine's on the concatenated context, log-probs equal to a teacher-forced forward of it to
fp32's reordering bound. The agent loop must then build the same trajectories whether turns are batched or
streamed: the schedule changes when a turn runs, never what it sees.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.data.builtin_models import PAD, TOOLS_VOCAB, build_char_tokenizer
from rljob_worker.rollout.agent_loop import AgentConfig, ToolResponseRenderer, run_agent_loop
from rljob_worker.rollout.base import SamplingParams
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.hf_static_engine import HFStaticEngine
from rljob_worker.rollout.static_stream import RowStream, RowStreams
from rljob_worker.rollout.tool_parser import make_parser
from rljob_worker.rollout.tools import ToolBox, ToolConfig

sys.path.insert(0, str(Path(__file__).parent))
from sharp_models import one_torch_thread, sharp_builtin  # noqa: F401 - one_torch_thread: an autouse fixture
from test_rollout_static import _FakeGraph, _graphed_and_eager, _rescored
from tolerances import logprob_bound

TOK = build_char_tokenizer(tools=True)
PAD_ID = TOOLS_VOCAB.index(PAD)
NO_EOS = len(TOOLS_VOCAB) + 5  # never sampled: rows end at a stop or their budget
CPU = torch.device("cpu")
PROMPTS = [TOK(s, add_special_tokens=False)["input_ids"] for s in ["12+3=", "9=", "4444 8=", "0", "77+1=2 #", "31="]]
TOOL_REPLY = TOK("<tool_response>21", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """builtin://tiny-qwen2-tools with its 2-D weights redrawn at std 0.5 (prompt-dependent greedy rows)."""
    return sharp_builtin("tiny-qwen2-tools", tmp_path_factory, seed=1)


@pytest.fixture(scope="module")
def lp_tol(model_dir):
    """The reordering bound (tolerances.logprob_bound) from the largest logit over the prompts and 40 greedy tokens
    (with replies inside, the contexts stay in the same range)."""
    import json

    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = HFEngine(str(model_dir), **_kw()).generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=40))
    with torch.no_grad():
        top = max(model(torch.tensor([p + TOOL_REPLY + r])).logits.abs().max().item()
                  for p, r in zip(PROMPTS, out.response_ids))
    return logprob_bound(config, top, 1.0)


def _kw():
    return {"dtype": torch.float32, "device": CPU, "eos_token_id": NO_EOS, "pad_token_id": PAD_ID}


@pytest.fixture(scope="module")
def stop_token(model_dir):
    """A token most greedy rows produce mid-way: the stand-in for a tool call's end."""
    free = HFEngine(str(model_dir), **_kw()).generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=12))
    counts: dict[int, int] = {}
    for row in free.response_ids:
        for tok in set(row[1:]):
            counts[tok] = counts.get(tok, 0) + 1
    return max(counts, key=counts.get)


def _drive(stream: RowStream, reply: list[int], turns: int, budget: int) -> dict[int, list]:
    """Poll until every row is stopped for good; resume each row that ended at a stop (up to `turns` turns) with
    `reply`. Returns row -> its turns as (ids, logprobs, the context before the turn)."""
    seen: dict[int, list] = {i: [] for i in range(len(stream.rows))}
    context = {i: [] for i in seen}
    while stream.busy:
        resumes = []
        for end in stream.poll():
            seen[end.row].append((end.ids, end.logprobs, list(context[end.row])))
            context[end.row] += end.ids
            if end.finished and len(seen[end.row]) < turns:
                context[end.row] += reply
                resumes.append((end.row, reply, budget))
        stream.resume(resumes)
    return seen


@pytest.mark.parametrize("sample_in_step", [False, True])
@pytest.mark.parametrize(("first", "length_budget", "reply_x", "check_every"),
                         [(12, 80, 2, 1), (12, 80, 2, 3), (40, 40, 4, 1)])
def test_a_resumed_row_samples_what_a_prefill_of_its_whole_context_samples(model_dir, stop_token, lp_tol,
                                                                           sample_in_step, first, length_budget,
                                                                           reply_x, check_every):
    """Rows stop at different steps and resume while the others decode; every later turn's greedy tokens are the
    HF engine's on prompt + earlier turns + replies, its log-probs a teacher-forced forward's. The reply is longer
    than a row's wait: with room in the cache the rows skip ahead to place it; where a skip would cut a live row's
turn short, it waits for its own wait to grow."""
    engine = HFStaticEngine(str(model_dir), sample_in_step=sample_in_step, **_kw())
    params = SamplingParams(n=1, temperature=0, max_new_tokens=first, stop_token_ids=(stop_token,))
    stream = RowStream(engine, PROMPTS, params, [first] * len(PROMPTS), length_budget, check_every)
    turns = _drive(stream, TOOL_REPLY * reply_x, turns=3, budget=6)
    ref = HFEngine(str(model_dir), **_kw())
    resumed = 0
    for i, row_turns in turns.items():
        for k, (ids, lps, before) in enumerate(row_turns):
            context = PROMPTS[i] + before
            want = ref.generate([context], dataclasses.replace(params, max_new_tokens=first if k == 0 else 6))
            assert ids == want.response_ids[0], f"row {i} turn {k}"
            rescored = _rescored(model_dir, [context], want, 1.0)[0]
            assert lps == pytest.approx(rescored, abs=lp_tol)
            resumed += k > 0
    assert resumed >= 3  # the stop token is common: several rows went on after a reply
    ends = [len(t[0][0]) for t in turns.values()]
    assert len(set(ends)) > 1  # first turns ended at different steps: rows resumed while others decoded


def test_a_next_turn_that_cannot_fit_the_cache_is_refused_and_the_row_stays_stopped(model_dir, stop_token):
    engine = HFStaticEngine(str(model_dir), **_kw())
    params = SamplingParams(n=1, temperature=0, max_new_tokens=12, stop_token_ids=(stop_token,))
    stream = RowStream(engine, PROMPTS, params, [12] * len(PROMPTS), 14)
    ended = []
    while stream.live and not ended:
        ended = [e for e in stream.poll() if e.finished]
    assert ended, "no row reached the stop token"
    row = ended[0].row
    stream.resume([(row, TOOL_REPLY, stream.session.length)])
    while stream.busy:
        stream.poll()
    assert stream.refused == [row] and not stream.rows[row].live
    with pytest.raises(ValueError, match="no ended turn"):
        stream.resume([(row, [], 1)])


# --------------------------------------------------------------------------- the agent loop over streams


def _loop(model_dir, stop_token, engine, streamed: bool, max_turns=4, budget=96, n=2, check_every=None,
          length_budget=None):
    tools = ToolBox([ToolConfig(name="secret", function="rljob_worker.data.synthetic:secret_tool")])
    try:
        return run_agent_loop(
            engine.generate, PROMPTS, SamplingParams(n=n, temperature=0, max_new_tokens=budget),
            parser=make_parser("bare", ["secret"]), tools=tools, renderer=ToolResponseRenderer(TOK),
            decode=lambda ids, skip: TOK.decode(ids, skip_special_tokens=skip), call_end_id=stop_token,
            eos_id=NO_EOS, config=AgentConfig(max_turns=max_turns, max_response_length=budget),
            contexts=[{"ground_truth": str(i % 4)} for i in range(len(PROMPTS))],
            open_stream=RowStreams(engine, check_every, length_budget) if streamed else None)
    finally:
        tools.close()


@pytest.mark.parametrize(("graphed", "check_every"), [(False, 1), (False, 2), (True, 2)])
def test_the_agent_loop_builds_the_same_trajectories_streamed_or_turn_batched(model_dir, stop_token, lp_tol,
                                                                              monkeypatch, graphed, check_every):
    """Greedy trajectories of 1 to 4 turns (replies, cuts at the budget, calls at maxTurns): token for token the
    same, the same loss masks, turns and flags, log-probs to the reordering bound; with stand-in CUDA graphs the
    stream replays the decode step captured before its prefill."""
    if graphed:
        engine, _ = _graphed_and_eager(model_dir, monkeypatch)
        engine.eos = NO_EOS
    else:
        engine = HFStaticEngine(str(model_dir), **_kw())
    turns, captures = set(), engine.graph_captures
    for budget in (32, 96):  # mostly cut in the first turn; mostly 2-3 turns
        batched, m_batched = _loop(model_dir, stop_token, HFEngine(str(model_dir), **_kw()), False, budget=budget)
        streamed, m_streamed = _loop(model_dir, stop_token, engine, True, budget=budget, check_every=check_every)
        for a, b in zip(batched, streamed, strict=True):
            assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
            assert (len(a.turns), a.cut, a.finished) == (len(b.turns), b.cut, b.finished)
            assert a.logprobs == pytest.approx(b.logprobs, abs=lp_tol)
        for key in ("tool/calls", "tool/turns_mean", "tool/cut_share", "tool/model_tokens"):
            assert m_streamed[key] == m_batched[key]
        turns |= {len(t.turns) for t in streamed}
    assert turns >= {1, 2, 3}
    if graphed:
        assert engine.graph_captures > captures and _FakeGraph.active is None


def test_an_agent_stream_larger_than_the_engine_batch_runs_in_groups(model_dir, stop_token, lp_tol):
    engine = HFStaticEngine(str(model_dir), max_batch=5, **_kw())
    batched, _ = _loop(model_dir, stop_token, HFEngine(str(model_dir), **_kw()), streamed=False, n=3)
    streamed, _ = _loop(model_dir, stop_token, engine, streamed=True, n=3)
    assert [t.response_ids for t in streamed] == [t.response_ids for t in batched]


def test_trajectories_a_short_stream_refuses_are_finished_turn_batched(model_dir, stop_token, monkeypatch):
    """A session with little room for waiting (polled every 8 steps, so a row waits up to 8 steps a turn, and only
    the length's rounding beyond the budget) refuses late resumes; the loop finishes those trajectories with
    engine calls of its own, and they are the ones a turn-batched loop builds."""
    refused = []
    real_place = RowStream._place

    def place(self, items):
        real_place(self, items)
        refused.extend(self.refused)

    monkeypatch.setattr(RowStream, "_place", place)
    engine = HFStaticEngine(str(model_dir), **_kw())
    batched, _ = _loop(model_dir, stop_token, HFEngine(str(model_dir), **_kw()), False)
    streamed, _ = _loop(model_dir, stop_token, engine, True, check_every=8, length_budget=96)
    assert refused, "the short session refused no resume"
    assert [t.response_ids for t in streamed] == [t.response_ids for t in batched]
    assert [t.loss_mask for t in streamed] == [t.loss_mask for t in batched]


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_streamed_agent_loop_equals_turn_batched_through_real_graphs(model_dir, stop_token, compiled):
    """On a GPU the stream replays real CUDA graphs (compiled or not) between resumes that rewrite the buffers the
    graphs read: the trajectories are the turn-batched HF engine's, token for token."""
    cuda = {**_kw(), "device": torch.device("cuda")}
    engine = HFStaticEngine(str(model_dir), compile_decode=compiled, max_graphs=8, **cuda)
    assert engine.use_cuda_graph
    for budget in (32, 96):
        batched, _ = _loop(model_dir, stop_token, HFEngine(str(model_dir), **cuda), False, budget=budget)
        streamed, _ = _loop(model_dir, stop_token, engine, True, budget=budget)
        assert [t.response_ids for t in streamed] == [t.response_ids for t in batched]
        assert [t.loss_mask for t in streamed] == [t.loss_mask for t in batched]
    assert engine.graph_captures > 0
