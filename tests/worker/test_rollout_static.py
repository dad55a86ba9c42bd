"""The static-KV-cache engine (CUDA-graphed on GPU; the same code eagerly on CPU) against HFEngine.

Same tiny sharp-weight Qwen2 as test_rollout_hf: greedy continuations must be identical token for
token, log-probs equal to float32 rounding, finished/EOS handling and seeded sampling unchanged,
and weight sync must reach the tensors the static forward reads.
"""
from __future__ import annotations

import pytest
import torch
from rljob_api.enums import RolloutEngine as EngineName
from rljob_worker.builtin_models import EOS, PAD, VOCAB, build_char_tokenizer, materialize_builtin
from rljob_worker.rollout import SamplingParams, make_engine
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.hf_static_engine import HFStaticEngine

TOK = build_char_tokenizer()
PROMPTS = [TOK(s, add_special_tokens=False)["input_ids"] for s in ["12+3=", "9=", "4444 8=", "0", "77+1=2 #"]]
EOS_ID, PAD_ID = VOCAB.index(EOS), VOCAB.index(PAD)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """builtin://tiny-qwen2 with its 2-D weights redrawn at std 0.5 (prompt-dependent outputs)."""
    from transformers import AutoModelForCausalLM

    base = materialize_builtin("tiny-qwen2", tmp_path_factory.mktemp("tiny") / "tiny-qwen2")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


def engines(model_dir, eos=EOS_ID):
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": eos, "pad_token_id": PAD_ID}
    return HFEngine(str(model_dir), **kw), HFStaticEngine(str(model_dir), **kw)


@pytest.fixture(scope="module")
def pair(sharp_model_dir):
    return engines(sharp_model_dir)


@pytest.mark.parametrize("max_new", [1, 5, 12, 40])
def test_greedy_output_equals_hf_engine(pair, max_new):
    ref, static = pair
    params = SamplingParams(n=2, temperature=0, max_new_tokens=max_new)
    a, b = ref.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert b.response_ids == a.response_ids
    assert b.finished == a.finished
    for x, y in zip(a.response_logprobs, b.response_logprobs):
        assert y == pytest.approx(x, abs=1e-4)


def test_eos_never_sampled_runs_to_max_new_tokens(sharp_model_dir):
    ref, static = engines(sharp_model_dir, eos=len(VOCAB) + 5)  # an id the model cannot produce
    params = SamplingParams(n=1, temperature=0, max_new_tokens=30)
    a, b = ref.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert b.response_ids == a.response_ids
    assert all(len(r) == 30 for r in b.response_ids) and not any(b.finished)


def test_seeded_sampling_matches_hf_engine(pair):
    ref, static = pair
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7)
    a, b = ref.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert b.response_ids == a.response_ids  # same logits (to rounding) + same generator draws
    again = static.generate(PROMPTS, params)
    assert again.response_ids == b.response_ids and again.response_logprobs == b.response_logprobs


def test_sessions_are_reused_and_rebuilt_by_shape(pair):
    _, static = pair
    p = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    first = static.generate(PROMPTS, p)
    s = static._session
    assert static.generate(PROMPTS, p).response_ids == first.response_ids and static._session is s
    alone = static.generate(PROMPTS[:1], p)  # another batch size: a new session, same continuation
    assert static._session is not s and alone.response_ids[0] == first.response_ids[0]


def test_weight_sync_reaches_the_static_forward(sharp_model_dir):
    ref, static = engines(sharp_model_dir)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=8)
    before = static.generate(PROMPTS, params)
    gen = torch.Generator().manual_seed(1)
    new = {name: torch.randn(p.shape, generator=gen) * 0.5 for name, p in ref.model.named_parameters()}
    ref.update_weights(new.items())
    static.update_weights(new.items())
    a, b = ref.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert b.response_ids == a.response_ids and b.response_ids != before.response_ids


def test_make_engine_picks_static_only_on_cuda_with_the_env(monkeypatch, sharp_model_dir):
    monkeypatch.setenv("RLJOB_HF_STATIC", "1")
    eng = make_engine(EngineName.HF, str(sharp_model_dir), dtype=torch.float32, device=CPU,
                      eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    assert type(eng) is HFEngine  # CPU keeps the plain engine


def test_sliding_window_models_are_refused(sharp_model_dir, monkeypatch):
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained

    def with_sliding_layers(path, **kw):
        model = real(path, **kw)
        model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", with_sliding_layers)
    with pytest.raises(ValueError, match="sliding"):
        HFStaticEngine(str(sharp_model_dir), dtype=torch.float32, device=CPU, eos_token_id=EOS_ID,
                       pad_token_id=PAD_ID)


def test_compiled_decode_step_equals_hf_engine(sharp_model_dir):
    """torch.compile of the decode step (the GPU option RLJOB_HF_STATIC_COMPILE=1) changes no
    token: compiled here with inductor on the CPU, greedy continuations equal HFEngine's, including
    after a change of shape (which recompiles)."""
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    ref = HFEngine(str(sharp_model_dir), **kw)
    compiled = HFStaticEngine(str(sharp_model_dir), compile_decode=True, **kw)
    assert compiled.compile_decode
    params = SamplingParams(n=1, temperature=0, max_new_tokens=8)
    for prompts in (PROMPTS, PROMPTS[:2]):
        want, got = ref.generate(prompts, params), compiled.generate(prompts, params)
        assert got.response_ids == want.response_ids
        for a, b in zip(got.response_logprobs, want.response_logprobs):
            assert a == pytest.approx(b, abs=1e-4)
    # plain temperature sampling takes the compiled race sampler: seeded runs repeat, and each pick's
    # log-prob is the one the HF engine's forward gives that token (teacher-forced re-scoring below)
    hot = SamplingParams(n=1, temperature=1.5, max_new_tokens=6, seed=7)
    first, again = compiled.generate(PROMPTS, hot), compiled.generate(PROMPTS, hot)
    assert first.response_ids == again.response_ids
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(sharp_model_dir), dtype=torch.float32)
    for prompt, ids, lps in zip(PROMPTS, first.response_ids, first.response_logprobs):
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt) - 1 : -1] / 1.5
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert lps == pytest.approx(want.tolist(), abs=1e-4)


def test_compile_is_opt_in_on_cuda_only(sharp_model_dir, monkeypatch):
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    monkeypatch.setenv("RLJOB_HF_STATIC_COMPILE", "1")
    assert not HFStaticEngine(str(sharp_model_dir), **kw).compile_decode  # the env acts on CUDA only


def test_prefill_in_row_chunks_changes_nothing(sharp_model_dir, pair):
    """Long prompts prefill a few rows at a time (bounded scores memory): one row per chunk gives the
    same greedy continuations and log-probs as the whole batch at once, and the decode that follows
    reads the cache the chunks wrote."""
    ref, whole = pair
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    chunked = HFStaticEngine(str(sharp_model_dir), prefill_bytes=1, **kw)
    assert chunked.prefill_rows(16) == 1 and whole.prefill_rows(16) >= len(PROMPTS) * 2
    # 7B shape (28 heads, intermediate 18944, bf16) at 1024-token prompts: ~0.5 GiB a row -> 8 rows in 4 GiB
    per_row = 3.5 * 28 * 1024 * 1024 * 4 + 3 * 1024 * 18944 * 2
    assert int(4 * 2**30 // per_row) == 8
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12)
    want, got = ref.generate(PROMPTS, params), chunked.generate(PROMPTS, params)
    assert got.response_ids == want.response_ids
    for a, b in zip(got.response_logprobs, want.response_logprobs):
        assert a == pytest.approx(b, abs=1e-4)


def test_release_cache_frees_the_session_and_the_next_rollout_rebuilds_it(pair):
    _, static = pair
    params = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    first = static.generate(PROMPTS, params)
    assert static._session is not None
    static.release_cache()
    assert static._session is None
    assert static.generate(PROMPTS, params).response_ids == first.response_ids
