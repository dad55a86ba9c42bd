"""RLJOB_SYNTHETIC_LENGTHS (rollout/synthetic_lengths.py): the long-tailed lengths throughput benchmarks run on.

The law must be what it says (log-normal median and spread, capped), a pure function of prompt, sample index and
seed (so batch-at-a-time engines and the pool's refilling rows cut the same response at the same length), and the
engines must end each response exactly there, "finished" unless the cap cut it.
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.data.builtin_models import PAD, TOOLS_VOCAB
from rljob_worker.rollout.base import SamplingParams
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.hf_static_engine import HFStaticEngine
from rljob_worker.rollout.static_refill import RefillingRows
from rljob_worker.rollout.synthetic_lengths import ENV, LengthLaw, law_from_env

sys.path.insert(0, str(Path(__file__).parent))
from sharp_models import one_torch_thread, sharp_builtin  # noqa: F401 - one_torch_thread: an autouse fixture

NO_EOS = len(TOOLS_VOCAB) + 5
KW = {"dtype": torch.float32, "device": torch.device("cpu"), "eos_token_id": NO_EOS,
      "pad_token_id": TOOLS_VOCAB.index(PAD)}


def test_the_law_has_its_median_and_spread_and_repeats_for_the_same_response():
    """4,000 draws of LogNormal(ln 300, 1): the sample median within 10% of 300 (its standard error is ~2% in log
    space, so this is 4+ standard errors) and the log-lengths' spread within 10% of 1; the cap holds; the same
    (prompt, sample, seed) gives the same length and another seed another set."""
    law = LengthLaw(300, 1.0)
    draws = [law.budget([k % 97, k // 97], k % 8, 3, 100_000) for k in range(4000)]
    assert 270 <= statistics.median(draws) <= 330
    assert 0.9 <= statistics.pstdev([math.log(d) for d in draws]) <= 1.1
    assert max(law.budget([k], 0, 3, 4096) for k in range(4000)) == 4096
    assert law.budget([1, 2], 3, 7, 4096) == law.budget([1, 2], 3, 7, 4096)
    assert [law.budget([k], 0, 7, 4096) for k in range(50)] != [law.budget([k], 0, 8, 4096) for k in range(50)]


@pytest.mark.parametrize("value", ["300", "lognormal:300", "lognormal:-1:1", "gamma:300:1", "lognormal:a:1"])
def test_a_malformed_value_names_the_format(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match="lognormal:<median"):
        law_from_env()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return sharp_builtin("tiny-qwen2-tools", tmp_path_factory, seed=2)


def test_batch_engines_and_refilling_rows_end_each_response_at_its_drawn_length(model_dir, monkeypatch):
    """With the env set, the HF engine, the static engine and refilling rows (the pool's loop, fed the budgets the
    way it is) give every response the law's length for its (prompt, sample, seed): the same token counts
    everywhere, "finished" below the cap only, and the tokens a full-length call samples up to there."""
    monkeypatch.setenv(ENV, "lognormal:6:0.8")
    law = law_from_env()
    prompts, params = [[3, 5, 7], [9], [4, 4, 8, 2], [11, 2]], SamplingParams(n=3, temperature=0, max_new_tokens=12, seed=4)
    want = [law.budget(p, j, 4, 12) for p in prompts for j in range(3)]
    assert len(set(want)) > 3  # lengths really vary
    full = {}
    for engine in (HFEngine(str(model_dir), **KW), HFStaticEngine(str(model_dir), max_batch=5, **KW)):
        out = engine.generate(prompts, params)
        assert [len(r) for r in out.response_ids] == want
        assert out.finished == [b < 12 for b in want]
        full.setdefault("ref", out.response_ids)
        assert out.response_ids == full["ref"]
    monkeypatch.delenv(ENV)
    uncut = HFEngine(str(model_dir), **KW).generate(prompts, params)
    assert all(u[:len(c)] == c for u, c in zip(uncut.response_ids, full["ref"]))
    rows = RefillingRows(HFStaticEngine(str(model_dir), max_batch=2, length_multiple=16, **KW), params,
                         prompt_budget=8, response_budget=12)
    for k, (p, j) in enumerate((p, j) for p in prompts for j in range(3)):
        rows.add(k, p, law.budget(p, j, 4, 12))
    got = {}
    while rows.busy:
        got.update({f.key: f.ids for f in rows.run(4, 0)})
    assert [got[k] for k in range(len(want))] == full["ref"]


def test_the_rollout_pools_refilling_rows_cut_responses_by_the_law(tmp_path, monkeypatch):
    """A separate pool with partial rollouts on the static engine (forced on the CPU) under a short law: every step's
    mean response length is the law's, not the ~16 tokens the quickstart's responses run to."""
    from test_ppo_split import by_step, finish, launch
    from test_rollout_pool import pool_job

    monkeypatch.setenv("RLJOB_HF_STATIC", "force")
    monkeypatch.setenv(ENV, "lognormal:4:0.5")
    doc = pool_job("pool-law", "async", steps=4)
    doc["spec"]["rollout"]["partial"] = True
    proc, work = launch(doc, tmp_path)
    out = finish(proc, work)
    assert "refilling rows" in out, out[-2000:]
    lengths = [s["response_length/mean"] for s in by_step(work).values()]
    assert len(lengths) == 4 and all(3 <= x <= 6 for x in lengths), lengths
