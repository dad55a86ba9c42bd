"""Continuous batching on the static engine (rollout/static_refill.py).

A refilled row must sample what a fresh call on its prompt samples, wherever its context sits in the ring cache and
whatever the previous occupants of its row and slots left there: greedy tokens equal to the HF engine's on the
prompt alone, log-probs equal to a teacher-forced forward to fp32's reordering bound. The sessions here are small
(2-3 rows, a ring of 48 slots) and the queues long, so every test's rows are refilled many times and the ring
wraps several times.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.data.builtin_models import PAD, TOOLS_VOCAB
from rljob_worker.rollout.base import SamplingParams
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.hf_static_engine import HFStaticEngine
from rljob_worker.rollout.static_refill import RefillingRows

sys.path.insert(0, str(Path(__file__).parent))
from sharp_models import one_torch_thread, sharp_builtin  # noqa: F401 - one_torch_thread: an autouse fixture
from test_rollout_static import _graphed_and_eager, _rescored
from tolerances import logprob_bound

PAD_ID = TOOLS_VOCAB.index(PAD)
NO_EOS = len(TOOLS_VOCAB) + 5  # never sampled: rows end at a stop or their budget
CPU = torch.device("cpu")
PROMPTS = [[3, 5, 7], [9], [4, 4, 4, 4, 8, 2], [11, 2], [7, 7, 1, 2, 9, 13, 6], [12]]
BUDGETS = [20, 3, 11, 17, 1, 8]  # one response each, cycled over the queue


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return sharp_builtin("tiny-qwen2-tools", tmp_path_factory, seed=3)


@pytest.fixture(scope="module")
def lp_tol(model_dir):
    """The reordering bound from the largest logit over the prompts and 20 greedy tokens."""
    import json

    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = HFEngine(str(model_dir), **_kw()).generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=20))
    with torch.no_grad():
        top = max(model(torch.tensor([p + r])).logits.abs().max().item() for p, r in zip(PROMPTS, out.response_ids))
    return logprob_bound(config, top, 1.0)


def _kw(eos: int = NO_EOS):
    return {"dtype": torch.float32, "device": CPU, "eos_token_id": eos, "pad_token_id": PAD_ID}


def _queue(repeats: int = 3) -> list[tuple[int, list[int], int]]:
    return [(k, PROMPTS[k % len(PROMPTS)], BUDGETS[(k + k // len(PROMPTS)) % len(BUDGETS)])
            for k in range(repeats * len(PROMPTS))]


def _drain(rows: RefillingRows, steps: int = 5, version: int = 0) -> dict:
    out = {}
    while rows.busy:
        for f in rows.run(steps, version):
            out[f.key] = f
    return out


def _engine(model_dir, max_batch: int, **kw) -> HFStaticEngine:
    return HFStaticEngine(str(model_dir), max_batch=max_batch, length_multiple=16, **{**_kw(), **kw})


def _assert_like_fresh_calls(model_dir, queue, got, lp_tol, stops=()):
    ref = HFEngine(str(model_dir), **_kw())
    for key, prompt, budget in queue:
        want = ref.generate([prompt], SamplingParams(temperature=0, max_new_tokens=budget, stop_token_ids=stops))
        f = got[key]
        assert f.ids == want.response_ids[0], f"response {key} (prompt {prompt}, budget {budget})"
        assert f.finished == want.finished[0]
        assert len(f.logprobs) == len(f.ids)
        rescored = _rescored(model_dir, [prompt], want, 1.0)[0]
        assert max((abs(a - b) for a, b in zip(f.logprobs, rescored)), default=0.0) <= lp_tol


@pytest.mark.parametrize("compiled", [False, True])
def test_refilled_rows_sample_what_a_fresh_call_samples_across_ring_wraps(model_dir, lp_tol, compiled):
    """30 responses of budgets 1-20 through 2 rows of a 48-slot ring (it wraps 3 times): each equals the HF
    engine's greedy response to its prompt alone, and its log-probs a teacher-forced forward's. Compiled (by
    layer; backend "eager": dynamo's graphs without codegen): the compile runs on the session before its first
    prompts and leaves no trace in them, and every step runs the compiled step."""
    engine = _engine(model_dir, max_batch=2, **({"compile_decode": True, "compile_backend": "eager"} if compiled else {}))
    rows = RefillingRows(engine, SamplingParams(temperature=0), prompt_budget=8, response_budget=20)
    assert engine.compiled_ready(rows.sampler) == compiled
    assert rows.ring == 48 and rows.capacity == 2
    queue = _queue(5)
    for key, prompt, budget in queue:
        rows.add(key, prompt, budget)
    got = _drain(rows)
    assert sorted(got) == [k for k, _, _ in queue]
    assert rows.count > 3 * rows.ring  # the ring really wrapped, several times
    _assert_like_fresh_calls(model_dir, queue, got, lp_tol)


@pytest.mark.parametrize("check_every", [1, 3])
def test_rows_ended_by_a_stop_token_are_refilled_and_every_response_is_cut_where_a_fresh_call_cuts(
        model_dir, lp_tol, check_every):
    """A stop token most greedy rows reach part-way ends a response (finished) and frees its row at the next poll;
    a poll every 3 steps lets rows decode past their end before they are taken out."""
    free = HFEngine(str(model_dir), **_kw()).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    counts: dict[int, int] = {}
    for row in free.response_ids:
        for tok in set(row[1:]):
            counts[tok] = counts.get(tok, 0) + 1
    stop = max(counts, key=counts.get)
    engine = _engine(model_dir, max_batch=3)
    rows = RefillingRows(engine, SamplingParams(temperature=0, stop_token_ids=(stop,)), prompt_budget=8,
                         response_budget=20, check_every=check_every)
    queue = _queue()
    for key, prompt, budget in queue:
        rows.add(key, prompt, budget)
    got = _drain(rows)
    assert any(f.finished for f in got.values()) and not all(f.finished for f in got.values())
    _assert_like_fresh_calls(model_dir, queue, got, lp_tol, stops=(stop,))


def test_sampled_tokens_carry_the_log_probs_they_were_drawn_with(model_dir, lp_tol):
    """Temperature 0.7, eager on a CPU (the call's generator): every token's recorded log-prob is the teacher-forced
    log-prob of the tempered distribution given its prompt and the tokens before it, after refills and wraps."""
    engine = _engine(model_dir, max_batch=2)
    rows = RefillingRows(engine, SamplingParams(temperature=0.7, seed=5), prompt_budget=8, response_budget=20)
    queue = _queue(2)
    for key, prompt, budget in queue:
        rows.add(key, prompt, budget)
    got = _drain(rows)
    from rljob_worker.rollout.base import RolloutOutput

    for key, prompt, budget in queue:
        f = got[key]
        assert len(f.ids) == budget  # no EOS in this vocabulary's draws: each runs to its budget
        want = _rescored(model_dir, [prompt], RolloutOutput([f.ids], [f.logprobs], [False]), 0.7)[0]
        assert max(abs(a - b) for a, b in zip(f.logprobs, want)) <= lp_tol / 0.7


def test_graphed_steps_refill_like_eager_ones(model_dir, monkeypatch):
    """Through stand-in CUDA graphs (captured once per key bucket, the full ring's included, replayed after the
    counters wrap), the same queue gives the eager engine's responses with the in-step sampler, greedy and sampled."""
    graphed, eager = _graphed_and_eager(model_dir, monkeypatch)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=11)):
        results = []
        for engine in (graphed, eager):
            engine.max_batch, engine.length_multiple = 3, 16
            rows = RefillingRows(engine, params, prompt_budget=8, response_budget=20, check_every=2)
            for key, prompt, budget in _queue():
                rows.add(key, prompt, budget)
            results.append({k: (f.ids, f.finished) for k, f in _drain(rows).items()})
        assert results[0] == results[1]
    assert graphed.graph_captures >= 2


def test_each_token_is_tagged_with_the_version_of_the_run_that_sampled_it(model_dir):
    """Versions change between runs: a response spanning runs carries the older version on its first tokens and the
    newer on the rest; tokens stay what one run would give (the weights did not change here)."""
    engine = _engine(model_dir, max_batch=2)
    rows = RefillingRows(engine, SamplingParams(temperature=0), prompt_budget=8, response_budget=20)
    rows.add("a", PROMPTS[0], 20)
    rows.add("b", PROMPTS[2], 20)
    assert rows.run(5, version=7) == []
    got = {f.key: f for f in rows.run(100, version=8)}
    for f in got.values():
        assert len(f.versions) == 20
        assert f.versions[:6] == [7] * 6 and f.versions[6:] == [8] * 14  # first token (prefill) + 5 steps under 7
    one = _engine(model_dir, max_batch=2)
    whole = RefillingRows(one, SamplingParams(temperature=0), prompt_budget=8, response_budget=20)
    whole.add("a", PROMPTS[0], 20)
    assert whole.run(100, version=0)[0].ids == got["a"].ids


def test_a_queue_longer_than_the_rows_waits_and_what_does_not_fit_is_refused(model_dir):
    engine = _engine(model_dir, max_batch=2)
    rows = RefillingRows(engine, SamplingParams(temperature=0), prompt_budget=8, response_budget=20)
    with pytest.raises(ValueError, match="do not fit"):
        rows.add("long", list(range(17)), 5)
    with pytest.raises(ValueError, match="do not fit"):
        rows.add("over", [1], 21)
    for k in range(5):
        rows.add(k, PROMPTS[k], 20)
    rows.run(1, 0)
    assert rows.live == 2 and len(rows.waiting) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (real CUDA graphs)")
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_refilling_through_real_cuda_graphs_equals_eager_decoding(model_dir, compiled):
    """On a GPU in fp32: the graphed session (one graph per key bucket, replayed after the counters wrap; the decode
    step compiled or not, compiled being the GPU default) gives the eager session's greedy responses."""
    cuda = torch.device("cuda")
    results = []
    for graphs in (True, False):
        engine = HFStaticEngine(str(model_dir), max_batch=3, length_multiple=16, use_cuda_graph=graphs,
                                sample_in_step=True, compile_decode=compiled and graphs, **{**_kw(), "device": cuda})
        rows = RefillingRows(engine, SamplingParams(temperature=0), prompt_budget=8, response_budget=20)
        for key, prompt, budget in _queue(5):
            rows.add(key, prompt, budget)
        results.append({k: f.ids for k, f in _drain(rows).items()})
        assert rows.count > 2 * rows.ring
        assert (engine.graph_captures > 0) == graphs
    assert results[0] == results[1]


def test_the_session_takes_only_the_rows_the_free_memory_holds(model_dir):
    """A session of 5k slots takes the rows the free memory holds beyond a prefill's room (max_batch at most; a 7B
    model's rows at 1k + 4k tokens take 0.3 GB each); a device with no room for one row is refused naming the
    fields to change."""
    from rljob_worker.rollout.static_refill import rows_that_fit, session_bytes_per_row

    engine = _engine(model_dir, max_batch=256)
    per_row = session_bytes_per_row(engine, 5120)
    room = engine.prefill_bytes + 2**30
    assert rows_that_fit(engine, 5120, free_bytes=room + 100 * per_row) == 100
    assert rows_that_fit(engine, 5120, free_bytes=room + 10_000 * per_row) == 256
    with pytest.raises(RuntimeError, match="data.maxPromptLength"):
        rows_that_fit(engine, 5120, free_bytes=room + per_row // 2)
    assert rows_that_fit(engine, 5120) == 256  # a CPU: max_batch
