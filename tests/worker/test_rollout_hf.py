"""Rollout: pure top-k / top-p sampling, and the transformers engine on the builtin tiny Qwen2.

The builtin model's random init (std 0.02) gives near-uniform logits and a constant greedy
continuation, which would let prompt-mixing bugs pass; the engine tests use the same
architecture with larger random weights (`sharp_model_dir`), whose outputs depend on the prompt.
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.data.builtin_models import EOS, PAD, VOCAB, build_char_tokenizer, materialize_builtin
from rljob_worker.rollout import SamplingParams
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.sampling import filter_logits, sample_next

sys.path.insert(0, str(Path(__file__).parent))
from sharp_models import one_torch_thread, sharp_builtin  # noqa: F401 - one_torch_thread: an autouse fixture

NEG = float("-inf")
PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(*rows):
    return torch.tensor([[math.log(p) for p in row] for row in rows])


# ---------------------------------------------------------------- filter_logits / sample_next


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [[i for i, v in enumerate(row) if v != NEG] for row in logits.tolist()]


def test_filter_logits_no_op_settings_only_scale_by_temperature():
    logits = logits_of(PROBS)
    assert torch.allclose(filter_logits(logits, 1.0, -1, 1.0), logits)
    assert torch.allclose(filter_logits(logits, 1.0, 10, 1.0), logits)  # k >= V keeps everything
    assert torch.allclose(filter_logits(logits, 2.0, -1, 1.0), logits / 2)


def test_top_k_by_hand():
    logits = logits_of(PROBS, PROBS[::-1])
    out = filter_logits(logits, 1.0, 2, 1.0)
    assert kept(out) == [[0, 1], [2, 3]]
    assert torch.allclose(out[0, :2], logits[0, :2])


@pytest.mark.parametrize(("top_p", "expected"), [
    (0.4, [0]),  # the top token always stays
    (0.7, [0, 1]),  # 0.5 < 0.7 <= 0.8
    (0.85, [0, 1, 2]),
    (0.99, [0, 1, 2, 3]),
])
def test_top_p_by_hand(top_p, expected):
    out = filter_logits(logits_of(PROBS, PROBS[::-1]), 1.0, -1, top_p)
    assert kept(out) == [expected, sorted(3 - i for i in expected)]  # the nucleus follows each row's own order


def test_top_k_then_top_p_renormalises_the_kept_tokens():
    probs = torch.softmax(filter_logits(logits_of(PROBS), 1.0, 3, 0.7), dim=-1)[0]
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)


def test_greedy_picks_the_argmax_with_its_raw_log_prob():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, logp = sample_next(logits, temperature=0, top_k=-1, top_p=1.0, generator=None)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_sampling_follows_the_filtered_distribution_and_its_log_prob():
    gen = torch.Generator().manual_seed(0)
    logits = logits_of(*[PROBS] * 20000)
    tokens, logp = sample_next(logits, temperature=1.0, top_k=-1, top_p=0.7, generator=gen)
    counts = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert counts[2:].sum() == 0
    assert abs(counts[0] - 0.625) < 0.02
    expected = torch.tensor([math.log(0.625), math.log(0.375)])[tokens]
    assert torch.allclose(logp, expected, atol=1e-5)
    again, _ = sample_next(logits, 1.0, -1, 0.7, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


# ---------------------------------------------------------------- HFEngine


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """builtin://tiny-qwen2 materialised, then its 2-D weights redrawn with std 0.5."""
    return sharp_builtin("tiny-qwen2", tmp_path_factory, seed=0)


def make_engine(model_dir, eos: str = EOS) -> HFEngine:
    return HFEngine(str(model_dir), dtype=torch.float32, device=torch.device("cpu"),
                    eos_token_id=VOCAB.index(eos), pad_token_id=VOCAB.index(PAD))


@pytest.fixture(scope="module")
def engine(sharp_model_dir):
    return make_engine(sharp_model_dir)


@pytest.fixture(scope="module")
def lp_tol(engine, sharp_model_dir):
    """fp32 reordering bound on this model's log-probs (tolerances.logprob_bound), from its largest logit
    over the prompts and 40 greedy tokens after them: batched vs alone and engine vs full forward sum in
    other orders."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tolerances import logprob_bound

    config = json.loads((sharp_model_dir / "config.json").read_text())
    out = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=40))
    with torch.no_grad():
        top = max(engine.model(torch.tensor([p + r])).logits.abs().max().item()
                  for p, r in zip(PROMPTS, out.response_ids))
    return logprob_bound(config, top)


TOK = build_char_tokenizer()
PROMPTS = [TOK(s, add_special_tokens=False)["input_ids"] for s in ["12+3=", "9=", "4444 8=", "0"]]
EOS_ID = VOCAB.index(EOS)
GREEDY = SamplingParams(n=1, temperature=0, max_new_tokens=12)


def full_forward_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response[t] | prompt, response[:t]) from one unpadded, uncached forward pass."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(response) - 1)
    return [logp[pos, tok].item() for pos, tok in zip(positions, response)]


@pytest.mark.parametrize(("name", "head_dim"), [("tiny-qwen2", 16), ("tiny-qwen2-hd64", 64)])
def test_the_builtin_folders_load(tmp_path, name, head_dim):
    folder = materialize_builtin(name, tmp_path / "m")
    engine = make_engine(folder)
    config = engine.model.config
    assert config.hidden_size // config.num_attention_heads == head_dim
    out = engine.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
    assert len(out.response_ids) == 2 and all(1 <= len(r) <= 4 for r in out.response_ids)


def test_eos_stops_a_response_and_marks_it_finished(engine):
    out = engine.generate(PROMPTS, GREEDY)
    assert len(out.response_ids) == len(PROMPTS)
    for ids, lps, done in zip(out.response_ids, out.response_logprobs, out.finished):
        assert done and ids[-1] == EOS_ID and EOS_ID not in ids[:-1]  # EOS included, nothing after it
        assert len(lps) == len(ids) and len(ids) < GREEDY.max_new_tokens


def test_max_new_tokens_cuts_unfinished_responses(engine):
    full = engine.generate(PROMPTS, GREEDY)
    short = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=3))
    for whole, cut, done in zip(full.response_ids, short.response_ids, short.finished):
        assert cut == whole[:3]
        assert done == (EOS_ID in cut) and (done or len(cut) == 3)
    assert not all(short.finished)
    sampled = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=5, seed=3))
    assert all(len(r) <= 5 for r in sampled.response_ids)
    assert all(f == (r[-1] == EOS_ID) for r, f in zip(sampled.response_ids, sampled.finished))


def test_another_eos_token_stops_at_its_first_occurrence(engine, sharp_model_dir):
    greedy = engine.generate(PROMPTS, GREEDY).response_ids
    stop = greedy[1][2]  # the third greedy token of prompt 1 becomes the EOS
    stop_engine = make_engine(sharp_model_dir, eos=VOCAB[stop])
    out = stop_engine.generate(PROMPTS, GREEDY)
    for whole, ids, done in zip(greedy, out.response_ids, out.finished):
        if stop in whole:
            assert ids == whole[: whole.index(stop) + 1] and done
        else:  # the old EOS is an ordinary token now: generation runs to max_new_tokens
            assert len(ids) == GREEDY.max_new_tokens and not done and ids[: len(whole)] == whole


def test_n_samples_per_prompt_are_grouped_contiguously(engine):
    greedy = engine.generate(PROMPTS, GREEDY)
    grouped = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0, max_new_tokens=12))
    assert grouped.response_ids == [r for r in greedy.response_ids for _ in range(3)]


def test_left_padding_does_not_change_a_prompts_continuation(engine, lp_tol):
    batched = engine.generate(PROMPTS, GREEDY)
    assert len({len(p) for p in PROMPTS}) > 1
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], GREEDY)
        assert batched.response_ids[i] == alone.response_ids[0]
        assert batched.response_logprobs[i] == pytest.approx(alone.response_logprobs[0], abs=lp_tol)


def test_same_seed_same_samples(engine):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
    c = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=12))
    assert c.response_ids != a.response_ids
    assert len({tuple(r) for r in a.response_ids}) > len(PROMPTS)  # samples of one prompt differ


def test_logprobs_match_a_full_forward_of_the_model(engine, lp_tol):
    n = 3
    out = engine.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, top_p=1.0, max_new_tokens=10, seed=5))
    assert len(out.response_ids) == len(PROMPTS) * n
    for j, (ids, lps) in enumerate(zip(out.response_ids, out.response_logprobs)):
        # sample j belongs to prompt j // n: the recomputation only matches against that prompt
        assert lps == pytest.approx(full_forward_logprobs(engine.model, PROMPTS[j // n], ids), abs=lp_tol)
    assert any(lp < -0.5 for lps in out.response_logprobs for lp in lps)  # not a trivially peaked model


def test_update_weights_changes_generations_and_round_trips(sharp_model_dir):
    eng = make_engine(sharp_model_dir)
    before = eng.generate(PROMPTS, GREEDY)
    original = {k: v.clone() for k, v in eng.model.state_dict().items()}
    assert "lm_head.weight" in original  # tied: sent by the exporter, skipped by the engine
    gen = torch.Generator().manual_seed(1)
    eng.update_weights((k, v + torch.randn(v.shape, generator=gen)) for k, v in original.items())
    after = eng.generate(PROMPTS, GREEDY)
    assert after.response_ids != before.response_ids
    eng.update_weights(original.items())
    assert eng.generate(PROMPTS, GREEDY).response_ids == before.response_ids


def test_update_weights_rejects_unknown_names_wrong_shapes_and_gaps(sharp_model_dir):
    eng = make_engine(sharp_model_dir)
    state = eng.model.state_dict()
    with pytest.raises(KeyError, match="no parameter 'model.layers.9.mlp.up_proj.weight'"):
        eng.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=re.escape(f"{name} has shape (3, 3), expected {tuple(state[name].shape)}")):
        eng.update_weights([(name, torch.zeros(3, 3))])
    with pytest.raises(KeyError, match="no tensor for"):
        eng.update_weights([(name, state[name])])


# ---------------------------------------------------------------- partial rollouts (rollout/partial.py)

def test_a_partial_rollout_continues_each_response_token_for_token(engine, sharp_model_dir, lp_tol):
    """Greedy, weights unchanged: generating in chunks of 3 (each later chunk a re-prefill of prompt + tokens so
    far) gives the tokens of one uninterrupted call, log-probs within the fp32 reordering bound, and tags every
    token with the version installed when its chunk started; with the real EOS, a row that ended is never
    continued."""
    from rljob_worker.rollout.partial import generate_partial

    no_stop = make_engine(sharp_model_dir, eos=PAD)  # runs to the budget (PAD is never sampled after a prompt)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=10)
    whole = no_stop.generate(PROMPTS, params)
    refreshed = iter([5, 6, 7])
    parts = generate_partial(no_stop.generate, lambda: next(refreshed), PROMPTS, params, version=4, chunk=3)
    assert parts.out.response_ids == whole.response_ids and parts.out.finished == whole.finished
    assert any(len(ids) == 10 for ids in whole.response_ids)  # some rows ran through all four chunks
    for got, want in zip(parts.out.response_logprobs, whole.response_logprobs):
        assert all(math.isclose(a, b, rel_tol=0, abs_tol=lp_tol) for a, b in zip(got, want))
    for ids, versions in zip(parts.out.response_ids, parts.token_versions):
        assert versions == ([4] * 3 + [5] * 3 + [6] * 3 + [7])[:len(ids)]

    ended = generate_partial(engine.generate, lambda: 9, PROMPTS, GREEDY, version=1, chunk=2)
    assert ended.out.response_ids == engine.generate(PROMPTS, GREEDY).response_ids and all(ended.out.finished)


def test_a_sampled_partial_rollout_keeps_groups_in_order_and_versions_rising(engine):
    from rljob_worker.rollout.partial import generate_partial

    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=9, seed=11)
    refreshed = iter(range(2, 10))
    parts = generate_partial(engine.generate, lambda: next(refreshed), PROMPTS, params, version=1, chunk=2)
    assert len(parts.out.response_ids) == len(PROMPTS) * 3 == len(parts.token_versions)
    for ids, lps, done, versions in zip(parts.out.response_ids, parts.out.response_logprobs, parts.out.finished,
                                        parts.token_versions):
        assert 1 <= len(ids) <= 9 and len(lps) == len(ids) == len(versions)
        assert done == (ids[-1] == EOS_ID) and EOS_ID not in ids[:-1]
        assert versions == sorted(versions) and versions[0] == 1
        # chunk c's tokens carry version c + 1: positions 2c and 2c + 1
        assert versions == [1 + position // 2 for position in range(len(ids))]
