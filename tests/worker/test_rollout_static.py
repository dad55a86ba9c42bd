"""The static-KV-cache engine (CUDA-graphed on GPU; the same code eagerly on CPU) against HFEngine.

Same tiny sharp-weight Qwen2 as test_rollout_hf: greedy continuations must be identical token for
token, log-probs equal to float32 rounding, finished/EOS handling and seeded sampling unchanged,
and weight sync must reach the tensors the static forward reads.
"""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from rljob_api.enums import RolloutCompile
from rljob_api.enums import RolloutEngine as EngineName
from rljob_worker.data.builtin_models import EOS, PAD, VOCAB, build_char_tokenizer
from rljob_worker.rollout import SamplingParams, make_engine
from rljob_worker.rollout.compile_config import compile_cache_env, compile_enabled
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.hf_static_engine import HFStaticEngine, bucket_for, dynamo_compiles, kv_buckets

sys.path.insert(0, str(Path(__file__).parent))
from sharp_models import one_torch_thread, sharp_builtin  # noqa: F401 - one_torch_thread: an autouse fixture
from tolerances import logprob_bound

TOK = build_char_tokenizer()
PROMPTS = [TOK(s, add_special_tokens=False)["input_ids"] for s in ["12+3=", "9=", "4444 8=", "0", "77+1=2 #"]]
EOS_ID, PAD_ID = VOCAB.index(EOS), VOCAB.index(PAD)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """builtin://tiny-qwen2 with its 2-D weights redrawn at std 0.5 (prompt-dependent outputs)."""
    return sharp_builtin("tiny-qwen2", tmp_path_factory, seed=0)


@pytest.fixture(scope="module")
def lp_tol(sharp_model_dir):
    """`(temperature) -> bound` on log-prob differences between two summation orders of this model
    (tolerances.logprob_bound), from its largest logit over the prompts and 100 greedy tokens after them."""
    from transformers import AutoModelForCausalLM

    config = json.loads((sharp_model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(sharp_model_dir), dtype=torch.float32)
    out = HFEngine(str(sharp_model_dir), dtype=torch.float32, device=CPU, eos_token_id=len(VOCAB) + 5,
                   pad_token_id=PAD_ID).generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=100))
    with torch.no_grad():
        top = max(model(torch.tensor([p + r])).logits.abs().max().item() for p, r in zip(PROMPTS, out.response_ids))
    return lambda temperature=1.0: logprob_bound(config, top, temperature)


def engines(model_dir, eos=EOS_ID):
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": eos, "pad_token_id": PAD_ID}
    return HFEngine(str(model_dir), **kw), HFStaticEngine(str(model_dir), **kw)


@pytest.fixture(scope="module")
def pair(sharp_model_dir):
    return engines(sharp_model_dir)


@pytest.mark.parametrize("max_new", [1, 5, 12, 40])
def test_greedy_output_equals_hf_engine(pair, max_new, lp_tol):
    ref, static = pair
    params = SamplingParams(n=2, temperature=0, max_new_tokens=max_new)
    a, b = ref.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert b.response_ids == a.response_ids
    assert b.finished == a.finished
    for x, y in zip(a.response_logprobs, b.response_logprobs):
        assert y == pytest.approx(x, abs=lp_tol())


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
    static.generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=60))  # a longer cache: rebuilt
    longer = static._session
    assert longer.length == 128 and longer.batch == len(PROMPTS)
    # a shorter rollout keeps the longer cache (and its graphs), with the same tokens as on a cache of its own
    assert static.generate(PROMPTS, p).response_ids == first.response_ids and static._session is longer


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
    monkeypatch.setenv("RLJOB_HF_STATIC", "force")  # unless forced (tests of the pool's refilling rows)
    eng = make_engine(EngineName.HF, str(sharp_model_dir), dtype=torch.float32, device=CPU,
                      eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    assert type(eng) is HFStaticEngine and not eng.use_cuda_graph


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


def _rescored(model_dir, prompts, out, temperature):
    """Each pick's log-prob under the HF model's own forward (teacher-forced), at the sampling temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = []
    for prompt, ids in zip(prompts, out.response_ids):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1] / temperature
        rows.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist())
    return rows


def test_compiled_decode_step_equals_the_uncompiled_one(sharp_model_dir, lp_tol):
    """torch.compile of the decode step with its in-step sampler (the GPU default) changes no token: compiled
    here with inductor on the CPU against the same engine uncompiled (same in-step sampler, same noise for the
    same seed): greedy and temperature sampling give identical tokens and log-probs within the reordering bound
    of fp32 (lp_tol: compiled kernels sum in another order; 1e-5 was this machine's number), greedy equals
    the HF engine, and a sampled token's log-prob is the one the HF model's own forward gives it."""
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    ref = HFEngine(str(sharp_model_dir), **kw)
    eager = HFStaticEngine(str(sharp_model_dir), sample_in_step=True, **kw)
    compiled = HFStaticEngine(str(sharp_model_dir), compile_decode=True, **kw)
    assert compiled.compile_decode and compiled.sample_in_step and not eager.compile_decode
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=8)
    want, got, same = ref.generate(PROMPTS, greedy), compiled.generate(PROMPTS, greedy), eager.generate(PROMPTS, greedy)
    assert got.response_ids == want.response_ids == same.response_ids
    for a, b in zip(got.response_logprobs, same.response_logprobs):
        assert a == pytest.approx(b, abs=lp_tol())
    hot = SamplingParams(n=2, temperature=1.5, max_new_tokens=6, seed=7)
    first, again, plain = compiled.generate(PROMPTS, hot), compiled.generate(PROMPTS, hot), eager.generate(PROMPTS, hot)
    assert first.response_ids == again.response_ids == plain.response_ids
    for a, b in zip(first.response_logprobs, plain.response_logprobs):
        assert a == pytest.approx(b, abs=lp_tol(1.5))
    prompts = [p for p in PROMPTS for _ in range(2)]
    for lps, want in zip(first.response_logprobs, _rescored(sharp_model_dir, prompts, first, 1.5)):
        assert lps == pytest.approx(want, abs=lp_tol(1.5))


def test_in_step_top_p_sampling_draws_from_the_nucleus(sharp_model_dir, lp_tol):
    """top-p inside the step (eager here; the same code is what the GPU graph captures): every pick lies in the
    nucleus of the HF model's distribution, its log-prob is the renormalised nucleus log-prob, and a fixed seed
    repeats."""
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": len(VOCAB) + 5, "pad_token_id": PAD_ID}
    eng = HFStaticEngine(str(sharp_model_dir), sample_in_step=True, **kw)
    params = SamplingParams(n=8, temperature=1.0, top_p=0.5, max_new_tokens=5, seed=3)
    out = eng.generate(PROMPTS[:2], params)
    assert out.response_ids == eng.generate(PROMPTS[:2], params).response_ids
    from rljob_worker.rollout.sampling import filter_logits
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(sharp_model_dir), dtype=torch.float32)
    for i, (ids, lps) in enumerate(zip(out.response_ids, out.response_logprobs)):
        prompt = PROMPTS[i // 8]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(filter_logits(logits, 1.0, -1, 0.5), -1).gather(-1, torch.tensor(ids)[:, None])
        assert torch.isfinite(logp).all()  # never outside the nucleus
        assert lps == pytest.approx(logp.squeeze(-1).tolist(), abs=lp_tol())
    assert len({tuple(r) for r in out.response_ids}) > 1  # it samples


@pytest.mark.parametrize("scope", ["layer", "step"])
def test_new_prompt_widths_do_not_recompile(sharp_model_dir, scope):
    """The prompt width is state, not a shape the compiled step sees: after the first call (and at most one
    recompile with symbolic sizes when a later key bucket is reached), 8 more prompt widths compile nothing.
    By layer: one graph serves both layers (and one the tail), the same count as the whole step's one graph plus
    its recompile. Counted with dynamo's own counter; backend "eager" traces exactly as inductor would, without
    codegen."""
    torch._dynamo.reset()
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": len(VOCAB) + 5, "pad_token_id": PAD_ID}
    eng = HFStaticEngine(str(sharp_model_dir), compile_decode=True, compile_backend="eager", max_graphs=4,
                         length_multiple=256, compile_scope=scope, **kw)
    assert len(eng.layers) == 2 and eng.compile_scope == scope
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=0)
    base = dynamo_compiles()
    eng.generate([[5] * 3, [6] * 20], params)  # width 32, cache 256: buckets 64, 128, ...; steps reach slot 71
    first = dynamo_compiles() - base
    assert 1 <= first <= 2, first
    widths = [5, 17, 40, 9, 33, 60, 25, 49]
    for i, w in enumerate(widths):  # 8 widths (rounded: 16, 32, 48, 64): same session, other key buckets
        out = eng.generate([[7] * w, [8] * (i + 1)], params)
        assert all(len(r) == 40 for r in out.response_ids)
    assert dynamo_compiles() - base <= 2, dynamo_compiles() - base
    assert {b for b in kv_buckets(256, 4)} == {64, 128, 192, 256}


def test_kv_buckets_cover_the_cache_in_at_most_max_graphs_steps():
    assert kv_buckets(384) == [64, 128, 192, 256, 320, 384]
    assert kv_buckets(3072) == [384 * i for i in range(1, 9)]
    assert kv_buckets(100, multiple=64) == [64, 100]
    assert bucket_for(127, [64, 128, 192]) == 128 and bucket_for(128, [64, 128, 192]) == 192
    with pytest.raises(ValueError, match="beyond"):
        bucket_for(192, [64, 128, 192])


def test_compile_follows_the_spec_and_the_env_overrides_it():
    gpu = torch.device("cuda")
    assert compile_enabled(RolloutCompile.AUTO, gpu, {}) and not compile_enabled(RolloutCompile.AUTO, CPU, {})
    assert compile_enabled("enabled", CPU, {}) and not compile_enabled("disabled", gpu, {})
    assert not compile_enabled(RolloutCompile.AUTO, gpu, {"RLJOB_HF_STATIC_COMPILE": "0"})
    assert compile_enabled(RolloutCompile.DISABLED, CPU, {"RLJOB_HF_STATIC_COMPILE": "1"})
    with pytest.raises(ValueError, match="RLJOB_HF_STATIC_COMPILE='yes'.*1.*0"):
        compile_enabled(RolloutCompile.AUTO, gpu, {"RLJOB_HF_STATIC_COMPILE": "yes"})


def test_cpu_default_is_uncompiled_with_the_hf_engines_sampler(sharp_model_dir, monkeypatch):
    monkeypatch.delenv("RLJOB_HF_STATIC_COMPILE", raising=False)
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    eng = HFStaticEngine(str(sharp_model_dir), **kw)
    assert not eng.compile_decode and not eng.sample_in_step and not eng.use_cuda_graph
    with pytest.raises(ValueError, match="sample_in_step"):
        HFStaticEngine(str(sharp_model_dir), compile_decode=True, sample_in_step=False, **kw)


def test_compile_cache_env_points_under_the_workdir_unless_set(tmp_path):
    env = compile_cache_env(tmp_path, {})
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile-cache" / "inductor"),
                   "TRITON_CACHE_DIR": str(tmp_path / "compile-cache" / "triton"),
                   "VLLM_CACHE_ROOT": str(tmp_path / "compile-cache" / "vllm"),
                   "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    assert compile_cache_env(tmp_path, {"TORCHINDUCTOR_CACHE_DIR": "/cache", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                                        "TRITON_CACHE_DIR": "/t", "VLLM_CACHE_ROOT": "/v"}) == {
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def test_prefill_in_row_chunks_changes_nothing(sharp_model_dir, pair, lp_tol):
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
        assert a == pytest.approx(b, abs=lp_tol())


def test_release_cache_frees_the_session_and_the_next_rollout_rebuilds_it(pair):
    _, static = pair
    params = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    first = static.generate(PROMPTS, params)
    assert static._session is not None
    static.release_cache()
    assert static._session is None
    assert static.generate(PROMPTS, params).response_ids == first.response_ids


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on a CPU: "capture" records the decode step the engine runs inside
    ``torch.cuda.graph(...)`` and a replay runs it again (what a real replay does, minus the speed)."""

    active, owner = None, None
    error_modes: ClassVar[list[str]] = []  # capture_error_mode of every capture

    def __init__(self):
        self.body, self.generators = None, []

    def register_generator_state(self, generator):
        self.generators.append(generator)

    def replay(self):
        self.body()


def _graphed_and_eager(model_dir, monkeypatch, noise_in_graph: bool = True, **graphed_kw):
    """Two static engines on a CPU: one running its decode steps through stand-in CUDA graphs (a capture records
    the step, a replay runs it), one stepping eagerly."""
    import contextlib

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        if capture_error_mode not in ("global", "thread_local", "relaxed"):  # torch's accepted modes
            raise ValueError(f"unknown capture_error_mode {capture_error_mode!r}")
        _FakeGraph.error_modes.append(capture_error_mode)
        _FakeGraph.active, _FakeGraph.owner = g, threading.current_thread()  # a capture is one thread's
        try:
            yield
        finally:
            _FakeGraph.active = None

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    for name, value in {"CUDAGraph": _FakeGraph, "graph": graph, "Stream": Stream,
                        "stream": lambda st: contextlib.nullcontext(), "synchronize": lambda device=None: None,
                        "current_stream": lambda device=None: Stream(),
                        "graph_pool_handle": lambda: None, "empty_cache": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": len(VOCAB) + 5, "pad_token_id": PAD_ID}
    graphed = HFStaticEngine(str(model_dir), sample_in_step=True, max_graphs=8, **kw, **graphed_kw)
    graphed.use_cuda_graph, graphed.noise_in_graph = True, noise_in_graph
    eager = HFStaticEngine(str(model_dir), sample_in_step=True, max_graphs=8, **kw)
    real_step = graphed._run_step

    def run_step(*args, **kwargs):  # inside a capture (on its thread): remember the step as the graph's body
        if _FakeGraph.active is not None and _FakeGraph.owner is threading.current_thread():
            _FakeGraph.active.body = lambda: real_step(*args, **kwargs)
        real_step(*args, **kwargs)

    monkeypatch.setattr(graphed, "_run_step", run_step)
    return graphed, eager


def test_fewer_rows_reuse_the_graphed_session_with_finished_padding_rows(sharp_model_dir, monkeypatch, lp_tol):
    """With CUDA graphs a call with fewer rows (the agent loop's second turn) runs in the larger session: no new
    allocation, no capture; its extra rows start finished (the call stops when the real rows do) and the real
    rows' tokens are those of an engine of their own size, their log-probs to fp32's reordering bound (another
    batch size blocks the matmuls differently). A larger call grows the session."""
    graphed, eager = _graphed_and_eager(sharp_model_dir, monkeypatch)
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=100)
    graphed.generate(PROMPTS, greedy)
    session, captures = graphed._session, graphed.graph_captures
    few = [p[:3] for p in PROMPTS[:1]]
    a, b = graphed.generate(few, greedy), eager.generate(few, greedy)
    assert graphed._session is session and graphed.graph_captures == captures
    assert a.response_ids == b.response_ids and a.finished == b.finished
    for x, y in zip(a.response_logprobs, b.response_logprobs):
        assert x == pytest.approx(y, abs=lp_tol())
    many = PROMPTS * 3
    graphed.generate(many, greedy)
    assert graphed._session.batch == len(many) * 2 and graphed._session is not session
    assert eager._session.batch == len(few) * 2  # without graphs: the call's exact batch


@pytest.mark.parametrize("noise_in_graph", [True, False])
def test_graph_bookkeeping_replays_decode_as_the_eager_steps(sharp_model_dir, monkeypatch, noise_in_graph, lp_tol):
    """The CUDA-graph control flow, run on a CPU with a stand-in graph: captures happen before the prefill (one
    per key bucket the rollout reaches), their warm-ups leave no trace in the output, a replay draws its noise
    (inside the graph, or just before it without register_generator_state) and advances the step counters, so
    seeded sampling and greedy through the graphs equal the same engine stepping eagerly. Captures are
    thread-local: a separate rollout pool's weights arrive on another thread meanwhile (rollout/weight_push.py).
    Log-probs to fp32's reordering bound: on the GPU host's 16-core CPU the two engines' log-probs differed in the
    last bits (same tokens), on 2 cores they did not; the two runs' buffers differ in size and address, which the
    CPU's GEMM kernels may block and round differently."""
    _FakeGraph.error_modes.clear()
    graphed, eager = _graphed_and_eager(sharp_model_dir, monkeypatch, noise_in_graph)
    for params in (SamplingParams(n=3, temperature=1.0, max_new_tokens=100, seed=4),
                   SamplingParams(n=3, temperature=0.9, top_p=0.8, max_new_tokens=100, seed=4),
                   SamplingParams(n=1, temperature=0, max_new_tokens=100)):
        a, b = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
        assert a.response_ids == b.response_ids
        for x, y in zip(a.response_logprobs, b.response_logprobs, strict=True):
            assert x == pytest.approx(y, abs=lp_tol(params.temperature or 1.0))
        assert all(len(r) == 100 for r in a.response_ids)
    graphs = graphed._session.graphs
    assert sorted({k[-1] for k in graphs}) == [64, 128] and graphed.graph_captures == 6  # 2 buckets x 3 samplers
    assert _FakeGraph.error_modes == ["thread_local"] * 6
    assert all((len(g.generators) == 1) == (noise_in_graph and k[0] != "greedy") for k, g in graphs.items())


class _CountingBackend:
    """A torch.compile backend that counts its compiles and the calls of the graphs it returns; ``fail`` makes
    the compile raise instead."""

    def __init__(self, fail: bool = False):
        self.compiles, self.calls, self.fail = 0, 0, fail

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        if self.fail:
            raise RuntimeError("no kernels for this device")

        def run(*args):
            self.calls += 1
            return gm.forward(*args)
        return run


def test_a_failed_compile_keeps_the_uncompiled_step(sharp_model_dir, caplog):
    """A compile that raises is said once in the log and never retried; rollouts go on with the uncompiled step."""
    torch._dynamo.reset()
    backend = _CountingBackend(fail=True)
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    ref = HFStaticEngine(str(sharp_model_dir), sample_in_step=True, **kw)
    eng = HFStaticEngine(str(sharp_model_dir), compile_decode=True, compile_backend=backend, **kw)
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=12)
    with caplog.at_level("WARNING"):
        first = eng.generate(PROMPTS, greedy)
        second = eng.generate(PROMPTS, greedy)
    want = ref.generate(PROMPTS, greedy).response_ids
    assert first.response_ids == second.response_ids == want
    assert backend.compiles == 1 and backend.calls == 0 and not eng.compiled_ready(("greedy", -1, 1.0))
    assert eng.compiles.failed(("greedy", -1, 1.0)) == "RuntimeError: no kernels for this device"
    failed = [r.message for r in caplog.records if "compiling the decode step (greedy sampler) failed" in r.message]
    assert len(failed) == 1 and "(RuntimeError: no kernels for this device)" in failed[0]


def test_graphs_capture_the_compiled_step_from_the_first_rollout(sharp_model_dir, monkeypatch, lp_tol):
    """With CUDA graphs (stand-ins on a CPU): the first rollout compiles the step, then captures every bucket with
    the compiled step, once; later rollouts replay it, and seeded sampling through it equals an engine stepping
    eagerly."""
    torch._dynamo.reset()
    backend = _CountingBackend()
    graphed, eager = _graphed_and_eager(sharp_model_dir, monkeypatch, compile_decode=True, compile_backend=backend)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=100, seed=4)
    want = eager.generate(PROMPTS, params)
    a = graphed.generate(PROMPTS, params)
    assert graphed.compiled_ready(("sample", -1, 1.0)) and graphed.graph_captures == 2
    # the layer graph (all layers) and the tail, and at most one recompile with symbolic sizes at the second bucket
    compiles, calls = backend.compiles, backend.calls
    assert compiles in (2, 3), compiles
    b = graphed.generate(PROMPTS, params)
    assert graphed.graph_captures == 2 and backend.calls > calls  # replays of the compiled step, no new capture
    assert backend.compiles == compiles
    for out in (a, b):
        assert out.response_ids == want.response_ids
        for x, y in zip(out.response_logprobs, want.response_logprobs, strict=True):
            assert x == pytest.approx(y, abs=lp_tol())


# --------------------------------------------------------------------------- on a GPU (bench/gpu_all.sh rollouttests)


def _cuda_engines(model_dir, **static_kw):
    kw = {"dtype": torch.float32, "device": torch.device("cuda"), "eos_token_id": len(VOCAB) + 5, "pad_token_id": PAD_ID}
    return HFEngine(str(model_dir), **kw), HFStaticEngine(str(model_dir), **kw, **static_kw)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_graphs_greedy_equal_the_hf_engine_across_key_buckets(sharp_model_dir, compiled, lp_tol):
    """fp32 greedy through the CUDA graphs (one per key bucket: 100 tokens after 16-token prompts cross the
    64-slot buckets of a 128-slot cache), compiled or not: the HF engine's tokens, log-probs to fp32's
    reordering bound (lp_tol)."""
    ref, static = _cuda_engines(sharp_model_dir, compile_decode=compiled, max_graphs=8)
    assert static.use_cuda_graph and static.sample_in_step and static.compile_decode == compiled
    params = SamplingParams(n=2, temperature=0, max_new_tokens=100)
    want, got = ref.generate(PROMPTS, params), static.generate(PROMPTS, params)
    assert static.graph_captures == 2  # keys 64 and 128
    assert got.response_ids == want.response_ids
    for a, b in zip(got.response_logprobs, want.response_logprobs):
        assert a == pytest.approx(b, abs=lp_tol())
    assert static.generate([p[:2] for p in PROMPTS], params).response_ids == ref.generate(
        [p[:2] for p in PROMPTS], params).response_ids  # another prompt width: same session and graphs
    assert static.graph_captures == 2


@pytest.mark.gpu
def test_gpu_graph_replays_draw_fresh_noise_as_the_eager_steps_do(sharp_model_dir, lp_tol):
    """Sampling inside the graph: a replay advances the engine's generator exactly as the eager step does, so a
    seeded run through the graphs equals the same engine stepping eagerly (a graph that froze its noise would
    repeat one draw every step and differ), repeats for the same seed and differs for another."""
    _, graphed = _cuda_engines(sharp_model_dir, compile_decode=False)
    _, eager = _cuda_engines(sharp_model_dir, compile_decode=False, use_cuda_graph=False, sample_in_step=True)
    assert graphed.use_cuda_graph and graphed.noise_in_graph and not eager.use_cuda_graph
    for params in (SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=5),
                   SamplingParams(n=4, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=40, seed=5)):
        a, b = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
        assert a.response_ids == b.response_ids
        for x, y in zip(a.response_logprobs, b.response_logprobs):
            assert x == pytest.approx(y, abs=lp_tol(params.temperature))
        assert graphed.generate(PROMPTS, params).response_ids == a.response_ids
        other = SamplingParams(**{**params.__dict__, "seed": 6})
        assert graphed.generate(PROMPTS, other).response_ids != a.response_ids


@pytest.mark.gpu
def test_gpu_compile_cache_is_reused_by_a_second_process(tmp_path):
    """The worker's cache variables (compile_cache_env): a second process compiling the same function loads it
    from the first one's FX graph cache. (On a 2-core CPU the first compile alone takes minutes: GPU only.)"""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, torch\nfrom torch._dynamo.utils import counters\n"
            "f = torch.compile(lambda x: (x.sin() * 2 + 1).sum(-1))\nf(torch.randn(8, 16, device='cuda'))\n"
            "print(json.dumps(dict(counters['inductor'])))")
    env = {**os.environ, **compile_cache_env(tmp_path, {})}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0].get("fxgraph_cache_miss", 0) >= 1 and runs[1].get("fxgraph_cache_hit", 0) >= 1, runs
    assert (tmp_path / "compile-cache" / "inductor").is_dir()


@pytest.mark.parametrize("sample_in_step", [False, True])
def test_stop_token_ends_a_row_inside_the_decode_step(sharp_model_dir, sample_in_step):
    """SamplingParams.stop_token_ids end a row like EOS and stay its last token: greedy rows are the unstopped
    rows up to and including their first stop token, in the HF engine and in the static engine's decode step
    (its in-step bookkeeping, the part the CUDA graph captures, with sample_in_step)."""
    kw = {"dtype": torch.float32, "device": CPU, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    ref, static = HFEngine(str(sharp_model_dir), **kw), HFStaticEngine(str(sharp_model_dir), sample_in_step=sample_in_step, **kw)
    free = ref.generate(PROMPTS, SamplingParams(n=1, temperature=0, max_new_tokens=20))
    counts = {}
    for row in free.response_ids:
        for tok in row[1:]:
            counts[tok] = counts.get(tok, 0) + 1
    stop = max((t for t in counts if t != EOS_ID), key=counts.get)  # a token most rows produce mid-way
    params = SamplingParams(n=1, temperature=0, max_new_tokens=20, stop_token_ids=(stop,))
    for out in (ref.generate(PROMPTS, params), static.generate(PROMPTS, params)):
        for row, full, finished in zip(out.response_ids, free.response_ids, out.finished):
            cut = full.index(stop) + 1 if stop in full else len(full)
            assert row == full[:cut]
            assert finished == (stop in full or EOS_ID in full[:cut])
    assert any(stop in row for row in out.response_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_stop_token_ends_rows_inside_the_graphed_step(sharp_model_dir, compiled):
    """The stop tokens live in a session buffer the captured (and compiled) decode step reads: a call with stop
    tokens after a call without them replays the same graphs and stops each row at its first stop token, as the
    HF engine does; a later call without them runs to the end again."""
    ref, static = _cuda_engines(sharp_model_dir, compile_decode=compiled, max_graphs=8)
    free_params = SamplingParams(n=1, temperature=0, max_new_tokens=40)
    free = static.generate(PROMPTS, free_params)
    captures = static.graph_captures
    counts = {}
    for row in free.response_ids:
        for tok in row[1:]:
            counts[tok] = counts.get(tok, 0) + 1
    stop = max(counts, key=counts.get)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=40, stop_token_ids=(stop,))
    got, want = static.generate(PROMPTS, params), ref.generate(PROMPTS, params)
    assert got.response_ids == want.response_ids and got.finished == want.finished
    assert any(len(r) < 40 for r in got.response_ids)
    assert static.graph_captures == captures  # no recapture for the stops
    assert static.generate(PROMPTS, free_params).response_ids == free.response_ids
