"""Precompiled decode regions (rollout/precompiled.py): saved by the first process, loaded by the next without a trace.

Real inductor on the CPU, real processes: a second process (a new pod whose compile cache was restored) must call
the static engine's decode layer and tails without dynamo tracing them, and generate exactly what the first did.
Whatever goes wrong with an artefact (corrupt, refused by its guards) costs a compile, never a token.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.rollout import precompiled
from rljob_worker.rollout.precompiled import PrecompiledRegion, precompile_folder

sys.path.insert(0, str(Path(__file__).parent))
from sharp_models import one_torch_thread, sharp_builtin  # noqa: F401 - one_torch_thread: an autouse fixture

# One process of a pod: the compiled static engine generates greedy and sampled rows and reports how it got each
# region and how many graphs dynamo traced.
POD = """
import json, sys, torch
from torch._dynamo.utils import counters
from rljob_worker.data.builtin_models import EOS, PAD, VOCAB, build_char_tokenizer
from rljob_worker.rollout import SamplingParams
from rljob_worker.rollout.hf_static_engine import HFStaticEngine, dynamo_compiles
torch.set_num_threads(1)
tok = build_char_tokenizer()
prompts = [tok(s, add_special_tokens=False)["input_ids"] for s in ["12+3=", "9=", "4444 8=", "0", "77+1=2 #"]]
kw = dict(dtype=torch.float32, device=torch.device("cpu"), eos_token_id=VOCAB.index(EOS), pad_token_id=VOCAB.index(PAD))
eng = HFStaticEngine(sys.argv[1], compile_decode=True, **kw)
greedy = eng.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=8))
hot = eng.generate(prompts, SamplingParams(n=2, temperature=1.5, max_new_tokens=6, seed=7))
how = lambda region: getattr(region, "source", "traced")  # a plain torch.compile where precompile is off
regions = {"decode-layer": how(eng._compiled_layer), **{f"decode-tail-{m}": how(r) for m, r in eng._compiled_tails.items()}}
print(json.dumps({"greedy": [greedy.response_ids, greedy.response_logprobs],
                  "hot": [hot.response_ids, hot.response_logprobs],
                  "regions": regions, "traced_graphs": dynamo_compiles()}))
"""


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    return sharp_builtin("tiny-qwen2", tmp_path_factory, seed=0)


def _pod(model_dir: Path, cache: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "RLJOB_", "TRITON_"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
               OMP_NUM_THREADS="1", RLJOB_PRECOMPILE="1")
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", POD, str(model_dir)], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


@pytest.mark.timeout(900)
def test_a_new_process_calls_the_saved_regions_without_tracing_them(sharp_model_dir, tmp_path):
    """The first process traces and saves the layer and the two tails it used; the second (the same cache folder,
    as a pod after the archive's restore) loads them, traces no graph at all, and generates the same tokens with
    the same log-probs bit for bit (the same kernels on the same inputs, one thread)."""
    first = _pod(sharp_model_dir, tmp_path)
    used = {"decode-layer", "decode-tail-greedy", "decode-tail-sample"}
    assert {n for n, how in first["regions"].items() if how == "precompiled"} == used, first["regions"]
    assert first["traced_graphs"] >= len(used)
    saved = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "inductor" / precompiled.FOLDER).glob("*.pt2"))
    assert saved == sorted(used)

    second = _pod(sharp_model_dir, tmp_path)
    assert {n: how for n, how in second["regions"].items() if n in used} == dict.fromkeys(used, "loaded")
    assert second["regions"]["decode-tail-filtered"] is None  # never called, never loaded
    assert second["traced_graphs"] == 0, second["log"][-3000:]
    assert second["greedy"] == first["greedy"] and second["hot"] == first["hot"]

    plain = _pod(sharp_model_dir, tmp_path / "plain", RLJOB_PRECOMPILE="0")  # the default path: the same tokens
    assert set(plain["regions"].values()) <= {"traced", None} and plain["greedy"][0] == first["greedy"][0]
    assert not (tmp_path / "plain" / "inductor" / precompiled.FOLDER).exists()


@pytest.mark.timeout(900)
def test_a_corrupt_artefact_costs_a_compile_and_is_replaced(sharp_model_dir, tmp_path):
    first = _pod(sharp_model_dir, tmp_path)
    artefacts = list((tmp_path / "inductor" / precompiled.FOLDER).glob("*.pt2"))
    for path in artefacts:
        path.write_bytes(b"not an artefact")
    again = _pod(sharp_model_dir, tmp_path)
    assert "could not load the precompiled decode-layer" in again["log"]
    assert again["regions"]["decode-layer"] == "precompiled" and again["greedy"] == first["greedy"]
    assert all(path.read_bytes() != b"not an artefact" for path in artefacts)  # saved whole again
    assert not list((tmp_path / "inductor" / precompiled.FOLDER).glob(".*partial"))


def scaled_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu().sum(-1) * 3


def test_a_call_the_artefact_refuses_compiles_as_usual(tmp_path, caplog):
    """An artefact compiled for static sizes (no dim marked dynamic) refuses another size through its guards: that
    call runs the plain torch.compile, with the right result and one warning; the saved size keeps the artefact."""
    torch._dynamo.reset()
    region = PrecompiledRegion(scaled_sum, "scaled-sum", tmp_path, "k")
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    assert torch.allclose(region(x, w), scaled_sum(x, w)) and region.source == "precompiled"
    loaded = PrecompiledRegion(scaled_sum, "scaled-sum", tmp_path, "k")
    assert torch.allclose(loaded(x, w), scaled_sum(x, w)) and loaded.source == "loaded"
    other = torch.randn(5, 8)
    with caplog.at_level(logging.WARNING, logger=precompiled.__name__):
        assert torch.allclose(loaded(other, w), scaled_sum(other, w))
        assert torch.allclose(loaded(other * 2, w), scaled_sum(other * 2, w))
    refusals = [r for r in caplog.records if "does not serve a call" in r.getMessage()]
    assert len(refusals) == 1 and loaded._traced is not None


def test_no_folder_is_the_plain_compile_and_the_switch_is_checked(tmp_path):
    region = PrecompiledRegion(scaled_sum, "scaled-sum", None, "k")
    x, w = torch.randn(2, 8), torch.randn(8, 3)
    assert torch.allclose(region(x, w), scaled_sum(x, w)) and region.source == "traced"
    on = {"RLJOB_PRECOMPILE": "1"}
    assert precompile_folder(on) is None  # the machine's default inductor cache is not the job's
    assert precompile_folder({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), **on}) == tmp_path / precompiled.FOLDER
    assert precompile_folder({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}) is None  # opt-in (see the module)
    assert precompile_folder({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "RLJOB_PRECOMPILE": "0"}) is None
    with pytest.raises(ValueError, match="RLJOB_PRECOMPILE='yes': set 1"):
        precompile_folder({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "RLJOB_PRECOMPILE": "yes"})


def test_the_key_changes_with_the_code_and_the_model(tmp_path):
    cpu = torch.device("cpu")
    key = precompiled.artefact_key({"model": {"hidden_size": 64}}, [precompiled.__name__], cpu)
    assert key == precompiled.artefact_key({"model": {"hidden_size": 64}}, [precompiled.__name__], cpu)
    assert key != precompiled.artefact_key({"model": {"hidden_size": 128}}, [precompiled.__name__], cpu)
    assert key != precompiled.artefact_key({"model": {"hidden_size": 64}}, [precompiled.__name__, __name__], cpu)
