"""Context parallelism (CP=2) and sequence parallelism without transformer_engine (TP=2 + SP) across
two gloo processes, against the same calls in one process.

One torchrun launch (``megatron_helpers.py cp_sp``) plays every layout on a batch of varied lengths
(packed lengths that neither 2 * cp nor TP divide) and saves log-probs, entropy, full logits, two
updates and the exported weights; the tests compare them with world size 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
from rljob_worker.megatron.model_config import MegatronConfigError

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) path; the GPU path is tested in test_megatron_gpu.py"
)
# tp2_qwen3: q/k-norm grads are partial per TP rank (each normalises its own heads) and are summed
# over TP on CPU too, as megatron's finalize_model_grads does on GPU
# tp2_sp_packed: the same with micro-batches concatenated (packing.pack_concatenated)
LAYOUTS = {"cp2": "qwen2", "tp2_sp": "qwen2", "tp2_sp_packed": "qwen2", "tp2_sp_qwen3": "qwen3", "tp2_qwen3": "qwen3"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_sp")
    hf = {
        "qwen2": H.make_tiny_hf_model("qwen2", root / "hf"),
        "qwen3": H.make_tiny_hf_model("qwen3", root / "out" / "hf_qwen3", seed=2),
    }
    H.run_torchrun("cp_sp", hf["qwen2"], root / "out", timeout=300)
    got = torch.load(root / "out" / "cp_sp.pt")
    ref = {arch: H.run_parallel_steps(d, ParallelConfig()) for arch, d in hf.items()}
    # CP splits the attention's sums over the sequence, TP(+SP) the hidden/head sums and the norms'
    # weight gradients: re-bracketings within the model's reordering bounds on varied_batch
    tol = {arch: H.reorder_bounds(d, *H.varied_batch()) for arch, d in hf.items()}
    return got, ref, hf, root / "out", tol


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_entropy_and_logits_equal_one_process(run, layout):
    got, ref, tol = run[0][layout], run[1][LAYOUTS[layout]], run[4][LAYOUTS[layout]]
    for key in ("logprobs", "entropy", "logits"):
        assert got[key].shape == ref[key].shape, key
    assert _rel(got["logits"], ref["logits"]) <= tol["logit"], _rel(got["logits"], ref["logits"])
    for key, bound in (("logprobs", tol["lp"]), ("entropy", tol["ent"])):
        assert (got[key] - ref[key]).abs().max() <= bound, (key, (got[key] - ref[key]).abs().max())
    assert torch.all(got["logprobs"][~H.varied_batch()[1].bool()] == 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_updates_equal_one_process(run, layout):
    got, ref, tol = run[0][layout], run[1][LAYOUTS[layout]], run[4][LAYOUTS[layout]]
    assert len(got["history"]) == len(ref["history"]) == 2
    # the second step follows an Adam step: taken as within the pre-step bounds (a gradient within
    # rounding of zero could flip its sign-normalised step; no rounding bound covers it)
    for step, (g, r) in enumerate(zip(got["history"], ref["history"])):
        bounds = H.metric_bounds(tol, r)
        for key in ("loss", "nll", "entropy", "grad_norm"):
            assert g[key] == pytest.approx(r[key], abs=bounds[key]), (step, key)
        assert g["skipped"] == 0
    assert got["history"][1]["loss"] < got["history"][0]["loss"]
    # after two Adam steps the models still agree (Adam's first steps amplify float noise in
    # near-zero gradients, so compare what the model computes rather than every weight)
    assert (got["logprobs_after"] - ref["logprobs_after"]).abs().max() <= tol["lp"]


def test_cp_ranks_run_their_share_of_the_sequence(run):
    got, ref = run[:2]
    # micro-batches of the varied batch pack to 15 and 13 tokens; CP=2 pads both to 16, runs 8 per rank
    assert ref["qwen2"]["seq_seen"] == [15, 13]
    assert got["cp2"]["seq_seen"] == [8, 8]
    assert got["cp2"]["sp_tagged"] == [] and got["cp2"]["norm_types"] == ["RMSNorm"]  # no SP: torch norms


def test_sequence_parallel_splits_the_sequence_and_tags_norms(run):
    got = run[0]
    # SP pads to a multiple of TP (16, 14) and each TP rank's norms see half
    assert got["tp2_sp"]["seq_seen"] == [8, 7]
    # concatenated: 15 + 7 and 11 + 13 real tokens, even already, half each
    assert got["tp2_sp_packed"]["seq_seen"] == [11, 12]
    # FusedRMSNorm (a SequenceParallelRMSNorm) where the compiled norms are forced on
    fused = os.environ.get("RLJOB_FUSED_ELEMENTWISE") == "1"
    assert got["tp2_sp"]["norm_types"] == ["FusedRMSNorm" if fused else "SequenceParallelRMSNorm"]
    tagged = got["tp2_sp_qwen3"]["sp_tagged"]
    assert "decoder.final_layernorm.weight" in tagged
    assert {"input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"} <= {
        n.split(".")[-2] for n in tagged
    }


def test_cp2_checkpoint_loads_into_one_process(run):
    got, _, hf, out, tol = run
    ids, mask = H.varied_batch()
    actor = MegatronActor.from_hf(hf["qwen2"], ParallelConfig(), OptimConfig(lr=1e-2), seed=5)
    assert actor.load_checkpoint(out / "ckpt_cp2")["step"] == 2
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, micro_batch_size=4)["logprobs"]
    # the same weights, CP=1 against CP=2's order of the attention's sums
    assert (lp - got["cp2"]["logprobs_after"]).abs().max() <= tol["qwen2"]["lp"]
    for name, tensor in actor.export_hf_weights():
        assert torch.equal(tensor, got["cp2"]["exported_after"][name]), name


def test_parallel_layout_errors_name_the_spec_field(tmp_path):
    with pytest.raises(
        MegatronConfigError, match="sequenceParallel=true needs spec.megatron.tensorModelParallelSize > 1"
    ):
        MegatronActor.from_hf("/nonexistent", ParallelConfig(sequence_parallel=True), OptimConfig(lr=1e-3))
    with pytest.raises(MegatronConfigError, match="contextParallelSize must be >= 1"):
        MegatronActor.from_hf("/nonexistent", ParallelConfig(cp=0), OptimConfig(lr=1e-3))
    # world size 1 cannot hold 2 CP ranks
    hf_dir = H.make_tiny_hf_model("qwen2", tmp_path / "hf")
    with pytest.raises(MegatronConfigError, match="not divisible by .* spec.megatron.contextParallelSize=2"):
        MegatronActor.from_hf(hf_dir, ParallelConfig(cp=2), OptimConfig(lr=1e-3))
