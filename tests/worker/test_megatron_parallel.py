"""TP=2 and DP=2 across two gloo processes (torchrun) against TP=1 in this process.

One torchrun launch (``megatron_helpers.py tp2``) plays every multi-process step and saves its
results; the tests compare them with the same steps at TP=1 here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) path; the GPU path is tested in test_megatron_gpu.py"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    hf_dir = H.make_tiny_hf_model("qwen2", root / "hf")
    pad_dir = H.make_tiny_hf_model("llama", root / "out" / "hf_pad", vocab_size=127)
    H.run_torchrun("tp2", hf_dir, root / "out")
    return {
        "hf_dir": hf_dir,
        "pad_dir": pad_dir,
        "out": root / "out",
        "tp2": torch.load(root / "out" / "tp2.pt"),
        "dp2": torch.load(root / "out" / "dp2.pt"),
        "tp2_pad": torch.load(root / "out" / "tp2_pad.pt"),
    }


@pytest.fixture(scope="module")
def tol(run):
    """TP=2 splits the hidden/head sums over two ranks and all-reduces them, DP=2 splits the token sum:
    re-bracketings within the model's reordering bounds on sample_batch (megatron_helpers.reorder_bounds).
    After the update (one Adam step of lr 1e-3) they are taken as within the pre-step bounds: a
    gradient within rounding of zero could flip its sign-normalised step, no rounding bound covers it."""
    b = H.reorder_bounds(run["hf_dir"], *H.sample_batch())
    return b | {"weight": T.adam_weight_bound(b["grad"], lr=1e-3, steps=1)}


@pytest.fixture(scope="module")
def tp1(run):
    """The TP=1 counterpart of the torchrun scenario."""
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = MegatronActor.from_hf(run["hf_dir"], ParallelConfig(tp=1), OptimConfig(lr=1e-3), seed=1)
    res = actor.compute_logprobs(batch, micro_batch_size=2, with_entropy=True)
    exported = dict(actor.export_hf_weights())
    metrics = actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True)
    after = actor.compute_logprobs(batch, micro_batch_size=4)
    return {
        "res": res,
        "exported": exported,
        "metrics": metrics,
        "after": after,
        "exported_after": dict(actor.export_hf_weights()),
        "eval_loss": actor.eval_loss(ids, mask),
    }


def test_tp2_logprobs_and_entropy_equal_tp1(run, tp1, tol):
    torch.testing.assert_close(run["tp2"]["logprobs"], tp1["res"]["logprobs"], rtol=0, atol=tol["lp"])
    torch.testing.assert_close(run["tp2"]["entropy"], tp1["res"]["entropy"], rtol=0, atol=tol["ent"])


def test_tp2_update_equals_tp1(run, tp1, tol):
    got, want = run["tp2"]["metrics"], tp1["metrics"]
    bounds = H.metric_bounds(tol, want)
    for key in ("loss", "nll", "entropy", "grad_norm"):
        assert got[key] == pytest.approx(want[key], abs=bounds[key]), key
    assert got["lr"] == want["lr"]  # the schedule: no float reordering
    torch.testing.assert_close(run["tp2"]["logprobs_after"], tp1["after"]["logprobs"], rtol=0, atol=tol["lp"])
    assert run["tp2"]["eval_loss"] == pytest.approx(tp1["eval_loss"], abs=bounds["nll"])


def test_tp2_export_equals_tp1_and_hf_files(run, tp1, tol):
    files = load_file(run["hf_dir"] / "model.safetensors")
    exported = run["tp2"]["exported"]
    assert sorted(exported) == sorted(files) == sorted(tp1["exported"])
    for name in files:
        assert torch.equal(exported[name], files[name]), name
        assert torch.equal(exported[name], tp1["exported"][name]), name
    for name, tensor in run["tp2"]["exported_after"].items():
        torch.testing.assert_close(tensor, tp1["exported_after"][name], rtol=0, atol=tol["weight"])


def test_tp2_checkpoint_loads_into_tp1(run):
    ids, mask = H.sample_batch()
    actor = MegatronActor.from_hf(run["hf_dir"], ParallelConfig(tp=1), OptimConfig(lr=1e-3), seed=5)
    meta = actor.load_checkpoint(run["out"] / "ckpt_tp2")
    assert meta["tp"] == 2 and meta["step"] == 1 and actor.step == 1
    assert actor.eval_loss(ids, mask) == pytest.approx(run["tp2"]["eval_loss"], abs=1e-6)
    for name, tensor in actor.export_hf_weights():
        assert torch.equal(tensor, run["tp2"]["exported_after"][name]), name
    # AdamW moments were resharded too: they are non-zero for every parameter after one step
    state = actor.optimizer.state_dict()["state"]
    assert len(state) == len(list(actor.core.parameters()))
    assert all(float(s["exp_avg_sq"].sum()) > 0 for s in state.values())


def test_dp2_stays_in_sync_and_equals_full_batch(run, tp1, tol):
    dp2 = run["dp2"]
    assert torch.equal(dp2["checksums"][0], dp2["checksums"][1])  # both replicas hold the same weights
    # each DP rank took 2 of 4 rows (one micro-batch): the same average as TP1 over 4 rows at mbs 2
    bounds = H.metric_bounds(tol, tp1["metrics"])
    assert dp2["metrics"]["loss"] == pytest.approx(tp1["metrics"]["loss"], abs=bounds["loss"])
    assert dp2["metrics"]["grad_norm"] == pytest.approx(tp1["metrics"]["grad_norm"], abs=bounds["grad_norm"])
    for name, tensor in dp2["exported"].items():
        torch.testing.assert_close(tensor, tp1["exported_after"][name], rtol=0, atol=tol["weight"])


def test_dp2_checkpoint_loads_into_one_process(run):
    ids, mask = H.sample_batch()
    actor = MegatronActor.from_hf(run["hf_dir"], ParallelConfig(tp=1), OptimConfig(lr=1e-3), seed=5)
    meta = actor.load_checkpoint(run["out"] / "ckpt_dp2")
    assert meta["step"] == 1
    assert actor.eval_loss(ids, mask) == pytest.approx(run["dp2"]["eval_loss"], abs=1e-6)
    for name, tensor in actor.export_hf_weights():
        assert torch.equal(tensor, run["dp2"]["exported"][name]), name


def test_tp2_padded_vocab_matches_hf(run):
    ids, mask = H.sample_batch()
    ids = ids.clamp(max=126)
    hf = H.load_hf_model(run["pad_dir"])
    pad = run["tp2_pad"]
    lp_tol = H.reorder_bounds(run["pad_dir"], ids, mask)["lp"]  # megatron TP2 against HF's order
    torch.testing.assert_close(pad["logprobs"], H.hf_logprobs(hf, ids, mask), rtol=0, atol=lp_tol)
    files = load_file(run["pad_dir"] / "model.safetensors")
    assert sorted(pad["exported"]) == sorted(files)
    for name in files:
        assert torch.equal(pad["exported"][name], files[name]), name
