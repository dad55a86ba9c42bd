"""Mixture-of-experts x pipeline parallelism: PP=2 (EP=1) across two gloo processes against PP=1 here.

One torchrun launch (``megatron_helpers.py moe_pp2``) runs :func:`megatron_helpers.moe_pp_steps` on
a 4-layer Qwen3-MoE whose layer 1 is dense (stage 0: [moe, dense], stage 1: [moe, moe], so stage 1's
local layers 0, 1 are HF layers 2, 3), a 2-layer Qwen2-MoE with shared experts (one MoE layer per
stage) and a 2-layer Qwen3-MoE whose last stage has no experts, and writes a checkpoint of each; the
tests repeat the same steps at PP=1 and compare.
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

MODELS = list(H.MOE_PP_MODELS)


def _pp1(hf_dir, seed=1) -> MegatronActor:
    return MegatronActor.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=1e-3, grad_clip=100.0), seed=seed)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_pp2")
    models = H.make_moe_pp_models(root / "models")
    H.run_torchrun("moe_pp2", models, root / "out", timeout=300)
    ranks = [torch.load(root / "out" / f"moe_pp2_rank{r}.pt") for r in range(2)]
    return {"models": models, "out": root / "out", "rank0": ranks[0], "rank1": ranks[1]}


@pytest.fixture(scope="module")
def pp1(run):
    """moe_pp_steps at PP=1 for every model."""
    return {name: H.moe_pp_steps(_pp1(run["models"] / name)) for name in MODELS}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _tol(run, name) -> dict:
    """PP splits the layers over stages (the same sums, another micro-batch schedule and padding; the
    aux loss and expert grad norm all-reduced over stages): the model's reordering bounds on
    sample_batch (decoder_chain counts the router and top-k mixture)."""
    return H.reorder_bounds(run["models"] / name, *H.sample_batch())


def test_each_stage_builds_its_own_layers_with_global_numbers(run, pp1):
    r0, r1 = run["rank0"]["qwen3_moe4"], run["rank1"]["qwen3_moe4"]
    assert r0["layer_numbers"] == [1, 2] and r1["layer_numbers"] == [3, 4]
    assert r0["moe_layers"] == ["MoELayer", "MLP"] and r1["moe_layers"] == ["MoELayer", "MoELayer"]
    assert pp1["qwen3_moe4"]["moe_layers"] == ["MoELayer", "MLP", "MoELayer", "MoELayer"]
    assert r0["local_experts"] == r1["local_experts"] == [0, 1, 2, 3]  # EP=1: every expert
    q2 = (run["rank0"]["qwen2_moe"]["moe_layers"], run["rank1"]["qwen2_moe"]["moe_layers"])
    assert q2 == (["MoELayer"], ["MoELayer"])
    # a stage without experts still joins the expert grad-norm, aux-loss and export collectives
    last = run["rank1"]["qwen3_moe_dense_last"]
    assert last["moe_layers"] == ["MLP"] and last["local_experts"] == []


# qwen2_moe again with micro-batches concatenated (packing.pack_concatenated), against PP=1 in rows
WITH_CONCATENATED = [*MODELS, "qwen2_moe_concatenated"]


@pytest.mark.parametrize("name", WITH_CONCATENATED)
def test_moe_pp2_logprobs_entropy_and_logits_equal_pp1(run, pp1, name):
    model = name.removesuffix("_concatenated")
    got, want = run["rank0"][name], pp1[model]
    tol = _tol(run, model)
    assert _rel_err(got["logits"], want["logits"]) <= tol["logit"]
    for key, bound in (("logprobs", tol["lp"]), ("entropy", tol["ent"])):
        assert (got[key] - want[key]).abs().max() <= bound, key
    for key in ("logprobs", "entropy", "logits"):
        assert torch.equal(run["rank1"][name][key], got[key]), key  # broadcast from the last stage


@pytest.mark.parametrize("name", WITH_CONCATENATED)
def test_moe_pp2_updates_equal_pp1(run, pp1, name):
    model = name.removesuffix("_concatenated")
    got, want = run["rank0"][name], pp1[model]
    tol = _tol(run, model)
    assert run["rank1"][name]["updates"] == got["updates"]  # metrics on every rank
    # the second update and everything after follow Adam steps: taken as within the pre-step bounds (a
    # gradient within rounding of zero could flip its sign-normalised step; no rounding bound covers it)
    for g, w in zip(got["updates"], want["updates"], strict=True):
        assert g["skipped"] == 0 and "moe_aux_loss" in g
        bounds = H.metric_bounds(tol, w)
        for key in ("loss", "nll", "entropy", "moe_aux_loss", "grad_norm"):
            assert g[key] == pytest.approx(w[key], abs=bounds[key]), key
    assert (got["logprobs_after"] - want["logprobs_after"]).abs().max() <= tol["lp"]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=bounds["nll"])
    assert sorted(got["exported_after"]) == sorted(want["exported_after"])
    weight_tol = T.adam_weight_bound(tol["grad"], lr=1e-3, steps=2)  # pp_steps: two updates
    for hf_name, tensor in want["exported_after"].items():
        torch.testing.assert_close(got["exported_after"][hf_name], tensor, rtol=0, atol=weight_tol)
        assert torch.equal(run["rank1"][name]["exported_after"][hf_name], got["exported_after"][hf_name])


@pytest.mark.parametrize("name", MODELS)
def test_moe_pp2_export_equals_hf_files_on_every_rank(run, name):
    files = load_file(run["models"] / name / "model.safetensors")
    assert any(".experts.3.down_proj" in n for n in files)
    for rank in ("rank0", "rank1"):
        exported = run[rank][name]["exported"]
        assert sorted(exported) == sorted(files)
        for hf_name, tensor in files.items():
            assert torch.equal(exported[hf_name], tensor), (rank, hf_name)


@pytest.mark.parametrize("name", MODELS)
def test_moe_pp2_checkpoint_loads_into_pp1(run, name):
    ids, mask = H.sample_batch()
    actor = _pp1(run["models"] / name, seed=5)
    meta = actor.load_checkpoint(run["out"] / f"ckpt_moe_pp2_{name}")
    assert meta["pp"] == 2 and meta["step"] == 2 and actor.step == 2
    assert actor.eval_loss(ids, mask) == pytest.approx(run["rank0"][name]["eval_loss"], abs=1e-6)
    for hf_name, tensor in actor.export_hf_weights():
        assert torch.equal(tensor, run["rank0"][name]["exported_after"][hf_name]), hf_name
    state = actor.optimizer.state_dict()["state"]  # Adam moments of every expert and stage came along
    assert len(state) == len(list(actor.core.parameters()))
    assert all(float(s["exp_avg_sq"].sum()) > 0 for s in state.values())
