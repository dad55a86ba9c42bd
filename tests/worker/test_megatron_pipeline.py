"""Pipeline parallelism: PP=2 (and PP=2 x VPP=2) across two gloo processes against PP=1 here.

One torchrun launch (``megatron_helpers.py pp2``) runs :func:`megatron_helpers.pp_steps` on an untied
llama, a tied-embedding qwen2 and a 4-layer llama with two virtual stages per rank, writes
checkpoints and an HF export, and moves a checkpoint from PP2 to TP2 and back; the tests repeat the
same steps at PP=1 and compare.
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
from rljob_worker.megatron.model_config import MegatronConfigError

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) path; the GPU path is tested in test_megatron_gpu.py"
)

MODELS = list(H.PP_MODELS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp2")
    models = H.make_pp_models(root / "models")
    H.run_torchrun("pp2", models, root / "out", timeout=300)
    ranks = [torch.load(root / "out" / f"pp2_rank{r}.pt") for r in range(2)]
    return {"models": models, "out": root / "out", "rank0": ranks[0], "rank1": ranks[1]}


@pytest.fixture(scope="module")
def pp1(run):
    """pp_steps at PP=1 for every model."""
    return {
        name: H.pp_steps(MegatronActor.from_hf(run["models"] / name, ParallelConfig(), OptimConfig(lr=1e-3), seed=1))
        for name in MODELS
    }


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _tol(run, name) -> dict:
    """PP splits the layers over stages (the same sums, another micro-batch schedule and padding) and
    all-reduces the tied embedding's two gradients: the model's reordering bounds on sample_batch."""
    return H.reorder_bounds(run["models"] / name, *H.sample_batch())


# the same steps with micro-batches concatenated (packing.pack_concatenated): every micro-batch of a call runs
# (1, the longest total), its padding a segment of its own; compared with PP=1 in the rows layout
CONCATENATED = [f"{name}_concatenated" for name in ("qwen2_tied", "llama4")]


@pytest.mark.parametrize("name", MODELS + CONCATENATED)
def test_pp2_logprobs_entropy_and_logits_equal_pp1(run, pp1, name):
    model = name.removesuffix("_concatenated")
    got, want = run["rank0"][name], pp1[model]
    tol = _tol(run, model)
    assert _rel_err(got["logits"], want["logits"]) <= tol["logit"]
    for key, bound in (("logprobs", tol["lp"]), ("entropy", tol["ent"])):
        assert (got[key] - want[key]).abs().max() <= bound, key
    for key in ("logprobs", "entropy", "logits"):
        # the last stage computes, the first receives the broadcast: both return the same tensor
        assert torch.equal(run["rank1"][name][key], got[key]), key


@pytest.mark.parametrize("name", MODELS + CONCATENATED)
def test_pp2_updates_equal_pp1(run, pp1, name):
    model = name.removesuffix("_concatenated")
    got, want = run["rank0"][name], pp1[model]
    tol = _tol(run, model)
    assert run["rank1"][name]["updates"] == got["updates"]  # metrics on every rank
    # the second update and everything after follow Adam steps: taken as within the pre-step bounds (a
    # gradient within rounding of zero could flip its sign-normalised step; no rounding bound covers it)
    for g, w in zip(got["updates"], want["updates"]):  # micro-batch 2, then 3 (rows 3 + 1)
        bounds = H.metric_bounds(tol, w)
        for key in ("loss", "nll", "entropy", "grad_norm"):
            assert g[key] == pytest.approx(w[key], abs=bounds[key]), key
    assert (got["logprobs_after"] - want["logprobs_after"]).abs().max() <= tol["lp"]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=bounds["nll"])
    weight_tol = T.adam_weight_bound(tol["grad"], lr=1e-3, steps=2)  # pp_steps: two updates
    for hf_name, tensor in want["exported_after"].items():
        torch.testing.assert_close(got["exported_after"][hf_name], tensor, rtol=0, atol=weight_tol)


@pytest.mark.parametrize("name", MODELS)
def test_pp2_export_equals_hf_files_on_every_rank(run, name):
    files = load_file(run["models"] / name / "model.safetensors")
    for rank in ("rank0", "rank1"):
        exported = run[rank][name]["exported"]
        assert sorted(exported) == sorted(files)
        for hf_name, tensor in files.items():
            assert torch.equal(exported[hf_name], tensor), (rank, hf_name)


def test_pp2_tied_save_hf_checkpoint(run):
    written = load_file(run["out"] / "hf_export_tied" / "model.safetensors")
    after = run["rank0"]["qwen2_tied"]["exported_after"]
    assert sorted(written) == sorted(after) and "lm_head.weight" not in written
    for hf_name, tensor in after.items():
        assert torch.equal(written[hf_name], tensor), hf_name


@pytest.mark.parametrize("name", MODELS)
def test_pp2_checkpoint_loads_into_pp1(run, name):
    ids, mask = H.sample_batch()
    actor = MegatronActor.from_hf(run["models"] / name, ParallelConfig(), OptimConfig(lr=1e-3), seed=5)
    meta = actor.load_checkpoint(run["out"] / f"ckpt_{name}")
    assert meta["pp"] == 2 and meta["step"] == 2 and actor.step == 2
    assert actor.eval_loss(ids, mask) == pytest.approx(run["rank0"][name]["eval_loss"], abs=1e-6)
    for hf_name, tensor in actor.export_hf_weights():
        assert torch.equal(tensor, run["rank0"][name]["exported_after"][hf_name]), hf_name
    # Adam moments came across too (non-zero after two steps), one per parameter
    state = actor.optimizer.state_dict()["state"]
    assert len(state) == len(list(actor.core.parameters()))
    assert all(float(s["exp_avg_sq"].sum()) > 0 for s in state.values())


def test_tp_and_pp_checkpoints_load_into_each_other(run):
    mixed = run["rank0"]["mixed"]
    assert mixed["tp2_from_pp2"] == pytest.approx(run["rank0"]["llama"]["eval_loss"], abs=1e-6)
    assert mixed["tp2_after_step"] < mixed["tp2_from_pp2"]
    assert mixed["pp2_from_tp2_meta"]["tp"] == 2 and mixed["pp2_from_tp2_meta"]["step"] == 3
    assert mixed["pp2_from_tp2"] == pytest.approx(mixed["tp2_after_step"], abs=1e-6)
    assert run["rank1"]["mixed"]["pp2_from_tp2"] == mixed["pp2_from_tp2"]


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (ParallelConfig(vpp=2), "virtualPipelineModelParallelSize=2 needs pipeline parallelism"),
        (ParallelConfig(pp=3), "pipelineModelParallelSize=3 does not divide the model's 2 layers"),
        (ParallelConfig(pp=2, vpp=2), "pipelineModelParallelSize=2 x spec.megatron.virtualPipelineModelParallelSize=2"),
    ],
)
def test_bad_pipeline_layouts_are_refused(run, parallel, message):
    with pytest.raises(MegatronConfigError, match=message):
        MegatronActor.from_hf(run["models"] / "llama", parallel, OptimConfig(lr=1e-3))
