"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE) in the megatron actor on CPU: HF parity, the weight
mapping, the aux loss, expert parallelism across two gloo processes, and the configuration errors.

One torchrun launch (``megatron_helpers.py ep2``) plays every two-process step (EP=1 and EP=2 on the
same two ranks, TP=2 with expert TP=2, TP=2 with EP=2, an EP=2 checkpoint); the tests compare its
results with HF and with EP=1 in this process. Training at TP=2 + sequence parallel (``moe_tp2_sp``,
two processes; ``moe_tp2_sp_ep2``, four) is compared with the same calls in one process.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron import moe
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
from rljob_worker.megatron.model_config import MegatronConfigError, megatron_config_from_hf

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) path; the GPU path is tested in test_megatron_gpu.py"
)

ARCHS = ["qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    return {arch: H.make_tiny_hf_model(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


_bounds, _metric_bounds = H.reorder_bounds, H.metric_bounds  # decoder_chain counts the router and top-k mixture


def _actor(hf_dir, lr=1e-3, overrides=None, **optim):
    return MegatronActor.from_hf(
        hf_dir, ParallelConfig(), OptimConfig(lr=lr, **optim), seed=1, transformer_overrides=overrides
    )


# --------------------------------------------------------------------------------------------------
# one process


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_logits_logprobs_and_export_match_hf(hf_dirs, arch):
    hf = H.load_hf_model(hf_dirs[arch])
    actor = _actor(hf_dirs[arch])
    ids, mask = H.sample_batch()
    real = mask.bool()

    ref = H.hf_logits(hf, ids, mask)
    got = actor.forward_logits(ids, mask)
    err = (got[real] - ref[real]).abs().max() / ref[real].abs().max()
    tol = _bounds(hf_dirs[arch], ids, mask)
    assert err <= tol["logit"], f"max relative logit error {err}"
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, micro_batch_size=3)["logprobs"]
    torch.testing.assert_close(lp, H.hf_logprobs(hf, ids, mask), rtol=0, atol=tol["lp"])

    # HF -> megatron -> HF is bit-exact, router, experts and (qwen2_moe) shared expert + gate included
    files = load_file(hf_dirs[arch] / "model.safetensors")
    exported = dict(actor.export_hf_weights())
    assert sorted(exported) == sorted(files)
    assert any(".mlp.gate.weight" in n for n in files) and any(".experts.3.down_proj" in n for n in files)
    for name, tensor in files.items():
        assert torch.equal(exported[name], tensor), name


def test_moe_gradients_match_hf_without_aux_loss(hf_dirs):
    """With the aux loss off (HF adds none without output_router_logits), the grad norm over router,
    experts and everything else equals HF autograd's."""
    hf = H.load_hf_model(hf_dirs["qwen3_moe"]).train()
    actor = _actor(hf_dirs["qwen3_moe"], grad_clip=0.0, overrides={"moe_aux_loss_coeff": 0.0})
    ids, mask = H.sample_batch()
    valid = (mask.bool() & (mask.cumsum(1) > 1)).float()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
    lp = torch.nn.functional.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    ref_loss = -(lp * valid).sum() / valid.sum()
    ref_loss.backward()
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None))

    metrics = actor.update({"input_ids": ids, "attention_mask": mask}, H.seq_nll_loss, micro_batch_size=4)
    tol = _bounds(hf_dirs["qwen3_moe"], ids, mask)
    # a token mean of -log p: each term within lp, at most |z| + log V
    loss_tol = T.mean_bound(tol["lp"], tol["n"], tol["z"] + math.log(tol["config"]["vocab_size"]))
    assert metrics["loss"] == pytest.approx(float(ref_loss), abs=loss_tol)
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=tol["grad"])
    assert "moe_aux_loss" not in metrics  # coefficient 0: megatron computes no aux loss


def test_aux_loss_is_reported_and_leaves_logprobs_alone(hf_dirs):
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    on = _actor(hf_dirs["qwen3_moe"], lr=1e-2)
    off = _actor(hf_dirs["qwen3_moe"], lr=1e-2, overrides={"moe_aux_loss_coeff": 0.0})
    assert on.mcfg.transformer_config.moe_aux_loss_coeff == 0.01  # router_aux_loss_coef of the model
    assert torch.equal(on.compute_logprobs(batch, 4)["logprobs"], off.compute_logprobs(batch, 4)["logprobs"])
    m_on, m_off = on.update(batch, H.seq_nll_loss, 2), off.update(batch, H.seq_nll_loss, 2)
    # the switch loss of a uniform router is 1 (top-k fraction x probability, times experts / k)
    assert 0.9 < m_on["moe_aux_loss"] < 2.0 and "moe_aux_loss" not in m_off
    assert m_on["loss"] == m_off["loss"]  # the reported loss is the policy loss only
    assert m_on["grad_norm"] != pytest.approx(m_off["grad_norm"], rel=1e-7)  # the aux loss adds gradient


def test_moe_transformer_config_from_hf():
    cfg = megatron_config_from_hf(H.tiny_hf_config("qwen3_moe"), use_te=False).transformer_config
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.moe_layer_freq == [1, 0]  # mlp_only_layers=[1]
    assert cfg.moe_router_pre_softmax is False  # norm_topk_prob=True: softmax over the chosen k
    assert cfg.qk_layernorm and not cfg.add_qkv_bias
    q2 = megatron_config_from_hf(H.tiny_hf_config("qwen2_moe"), use_te=False).transformer_config
    assert q2.moe_router_pre_softmax is True and q2.moe_shared_expert_gate and q2.add_qkv_bias
    assert q2.moe_shared_expert_intermediate_size == 48 and q2.moe_layer_freq == [1, 1]
    sparse = H.tiny_hf_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)
    assert moe.moe_layer_pattern(sparse) == [0, 1, 0, 1]
    off = megatron_config_from_hf(H.tiny_hf_config("qwen3_moe", router_aux_loss_coef=0.0), use_te=False)
    assert off.transformer_config.moe_router_load_balancing_type == "none"


def test_moe_config_errors_name_the_field():
    hf = H.tiny_hf_config("qwen3_moe")
    with pytest.raises(
        MegatronConfigError, match=r"expertModelParallelSize=3 does not divide .*num_experts=4"
    ):
        megatron_config_from_hf(hf, ep=3, use_te=False)
    with pytest.raises(
        MegatronConfigError, match=r"expertTensorParallelSize=3 does not divide moe_intermediate_size"
    ):
        megatron_config_from_hf(hf, etp=3, use_te=False)
    with pytest.raises(
        MegatronConfigError, match=r"expertModelParallelSize=2 needs a mixture-of-experts model"
    ):
        megatron_config_from_hf(H.tiny_hf_config("qwen3"), ep=2, use_te=False)
    with pytest.raises(
        MegatronConfigError, match=r"overrideTransformerConfig.num_moe_experts cannot be overridden"
    ):
        megatron_config_from_hf(hf, overrides={"num_moe_experts": 8}, use_te=False)
    with pytest.raises(
        MegatronConfigError, match=r"expertModelParallelSize=4 x expertTensorParallelSize=1 .* 2 ranks"
    ):
        moe.check_expert_layout(world=2, tp=1, pp=1, cp=1, ep=4, etp=None)
    with pytest.raises(MegatronConfigError, match=r"sequenceParallel must be true"):
        moe.check_training_layout(hf, tp=2, sequence_parallel=False)


def test_ep_that_does_not_fit_the_world_fails_at_start(hf_dirs):
    with pytest.raises(
        MegatronConfigError, match=r"spec.megatron.expertModelParallelSize=2 .* does not divide the 1 ranks"
    ):
        MegatronActor.from_hf(hf_dirs["qwen3_moe"], ParallelConfig(ep=2), OptimConfig(lr=1e-3))


def test_qwen3_30b_a3b_example_is_accepted_by_the_startup_checks():
    """examples/qwen3-30b-a3b-moe.yaml (2 x 8 GPUs, TP2 PP2 EP4, its overrides) against the real
    model's shape: every check the actor makes before building passes (the build itself needs GPUs)."""
    import yaml
    from rljob_api.validation import parse_rljob
    from rljob_worker.megatron.engine_config import check_parallel
    from transformers import Qwen3MoeConfig

    path = Path(__file__).parents[2] / "examples" / "qwen3-30b-a3b-moe.yaml"
    spec = parse_rljob(yaml.safe_load(path.read_text())).spec
    m = spec.megatron
    hf = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )
    world = spec.nnodes * spec.gpus_per_node
    tp, ep, etp = m.tensor_model_parallel_size, m.expert_model_parallel_size, m.expert_tensor_parallel_size
    parallel = ParallelConfig(tp=tp, pp=1, ep=ep, etp=etp, sequence_parallel=m.sequence_parallel)
    check_parallel(parallel, on_gpu=True)  # (pp is the pipeline-parallel work's to accept)
    moe.check_expert_layout(world, tp, m.pipeline_model_parallel_size, m.context_parallel_size, ep, etp)
    moe.check_training_layout(hf, tp, m.sequence_parallel)
    mcfg = megatron_config_from_hf(
        hf,
        tp=tp,
        ep=ep,
        etp=etp,
        use_te=False,
        on_gpu=False,
        overrides=m.override_transformer_config,
        recompute_granularity=m.recompute_granularity.value,
        recompute_method=m.recompute_method.value,
        recompute_num_layers=m.recompute_num_layers,
    )
    cfg = mcfg.transformer_config
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.expert_model_parallel_size) == (128, 8, 4)
    assert cfg.moe_aux_loss_coeff == 0.001 and cfg.moe_router_load_balancing_type == "aux_loss"


# --------------------------------------------------------------------------------------------------
# two processes


@pytest.fixture(scope="module")
def ep2(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep2")
    H.run_torchrun("ep2", hf_dirs["qwen3_moe"], out, timeout=300)
    return {"out": out, **torch.load(out / "ep2.pt")}


@pytest.fixture(scope="module")
def ep1_here(hf_dirs):
    """EP=1 in this process on the whole batch (the two-process runs split it over DP=2)."""
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = _actor(hf_dirs["qwen3_moe"], lr=1e-2)
    lp = actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"]
    return {"logprobs": lp, "first_update": actor.update(batch, H.seq_nll_loss, micro_batch_size=1)}


@pytest.fixture(scope="module")
def q3_tol(hf_dirs):
    """The reordering bounds of qwen3_moe on sample_batch: EP/TP/DP layouts re-bracket the sums of the
    one-process forward (a 2-rank all-reduce splits a sum decoder_chain already counts in two)."""
    return _bounds(hf_dirs["qwen3_moe"], *H.sample_batch())


def test_ep2_holds_half_the_experts_and_logprobs_equal_ep1(ep2, ep1_here, q3_tol):
    assert len(ep2["ep2"]["local_experts"]) == len(ep2["ep1"]["local_experts"]) // 2 == 4
    for layout in ("ep1", "ep2", "tp2_etp2", "tp2_ep2"):
        torch.testing.assert_close(ep2[layout]["logprobs"], ep1_here["logprobs"], rtol=0, atol=q3_tol["lp"])


def test_ep2_updates_equal_ep1(ep2, ep1_here, q3_tol):
    # the second update and eval_loss follow an Adam step: taken as within the pre-step bounds (a
    # gradient within rounding of zero could flip its sign-normalised step; no rounding bound covers it)
    for got, want in zip(ep2["ep2"]["history"], ep2["ep1"]["history"], strict=True):
        bounds = _metric_bounds(q3_tol, want)
        for key in ("loss", "nll", "moe_aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=bounds[key]), key
        assert got["lr"] == want["lr"]  # the schedule: no float reordering
    # DP=2 x 1 micro-batch of 1 row each = 4 micro-batches of 1 row here (aux loss and all)
    first, here = ep2["ep1"]["history"][0], ep1_here["first_update"]
    bounds = _metric_bounds(q3_tol, here)
    for key in ("loss", "moe_aux_loss", "grad_norm"):
        assert first[key] == pytest.approx(here[key], abs=bounds[key]), key
    assert ep2["ep2"]["eval_loss"] == pytest.approx(ep2["ep1"]["eval_loss"], abs=bounds["nll"])
    exported_ep1 = ep2["ep1"]["exported"]
    assert sorted(ep2["ep2"]["exported"]) == sorted(exported_ep1)
    weight_tol = T.adam_weight_bound(q3_tol["grad"], lr=1e-2, steps=2)  # the scenario's two steps
    for name, tensor in ep2["ep2"]["exported"].items():
        torch.testing.assert_close(tensor, exported_ep1[name], rtol=0, atol=weight_tol)


def test_tp_and_expert_tp_exports_are_the_hf_files(ep2, hf_dirs):
    files = load_file(hf_dirs["qwen3_moe"] / "model.safetensors")
    for layout in ("tp2_etp2", "tp2_ep2"):
        exported = ep2[layout]["exported"]
        assert sorted(exported) == sorted(files)
        for name, tensor in files.items():
            assert torch.equal(exported[name], tensor), (layout, name)


def test_ep2_checkpoint_loads_into_ep1(ep2, hf_dirs):
    ids, mask = H.sample_batch()
    actor = _actor(hf_dirs["qwen3_moe"], lr=1e-2)
    meta = actor.load_checkpoint(ep2["out"] / "ckpt_ep2")
    assert meta["ep"] == 2 and meta["step"] == 2
    assert actor.eval_loss(ids, mask) == pytest.approx(ep2["ep2"]["eval_loss"], abs=1e-6)
    for name, tensor in actor.export_hf_weights():
        assert torch.equal(tensor, ep2["ep2"]["exported"][name]), name
    state = actor.optimizer.state_dict()["state"]  # Adam moments of every expert came along
    assert len(state) == len(list(actor.core.parameters()))
    assert all(float(s["exp_avg_sq"].sum()) > 0 for s in state.values())


# --------------------------------------------------------------------------------------------------
# training under TP=2 + sequence parallel (two processes) against one process

SP_LAYOUTS = [f"{arch}_tp2_sp_{etp}" for arch in ARCHS for etp in ("etp2", "etp1")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def moe_sp(hf_dirs, tmp_path_factory):
    """One torchrun launch (``moe_tp2_sp``) of :func:`H.run_parallel_steps` in every layout of
    ``SP_LAYOUTS``, and the same calls in this process."""
    out = tmp_path_factory.mktemp("moe_tp2_sp")
    (out / "hf_qwen2_moe").symlink_to(hf_dirs["qwen2_moe"])
    H.run_torchrun("moe_tp2_sp", hf_dirs["qwen3_moe"], out, timeout=300)
    got = torch.load(out / "moe_tp2_sp.pt")
    ref = {arch: H.run_parallel_steps(hf_dirs[arch], ParallelConfig()) for arch in ARCHS}
    tol = {arch: _bounds(hf_dirs[arch], *H.varied_batch()) for arch in ARCHS}
    return got, ref, tol


@pytest.mark.parametrize("layout", SP_LAYOUTS)
def test_tp2_sp_training_equals_one_process(moe_sp, layout):
    """Log-probs, two updates (policy loss, load-balancing loss, grad norm) and the weights after them
    equal one process: the varied batch packs to lengths TP does not divide, so the aux loss must
    ignore SP's padding, sum its per-rank shares, and the router / shared-expert gate / norm grads
    (partial per TP rank under SP) and, with expert TP 1, the replicated experts' grads (each TP rank
    ran its own tokens through them) must be summed over TP."""
    arch = layout.split("_tp2")[0]
    _assert_equals_one_process(moe_sp[0][layout], moe_sp[1][arch], moe_sp[2][arch])


def test_tp2_sp_ep2_on_four_processes_equals_one_process(moe_sp, hf_dirs, tmp_path):
    """TP=2 + SP + EP=2 (expert TP 2, DP 2 on the same data): the production layout in miniature."""
    H.run_torchrun("moe_tp2_sp_ep2", hf_dirs["qwen3_moe"], tmp_path, nproc=4, timeout=300)
    got = torch.load(tmp_path / "moe_tp2_sp_ep2.pt")
    assert len([n for n in got["exported_after"] if ".experts." in n]) == 4 * 3  # all 4 experts back
    _assert_equals_one_process(got, moe_sp[1]["qwen3_moe"], moe_sp[2]["qwen3_moe"])


def _assert_equals_one_process(got: dict, ref: dict, tol: dict) -> None:
    assert got["seq_seen"] == [8, 7]  # each TP rank's norms see half of the 16 / 14 padded tokens
    assert _rel(got["logits"], ref["logits"]) <= tol["logit"]
    for key, bound in (("logprobs", tol["lp"]), ("entropy", tol["ent"])):
        assert (got[key] - ref[key]).abs().max() <= bound, key
    # steps and values after Adam steps: within the pre-step bounds (see test_ep2_updates_equal_ep1)
    for step, (g, r) in enumerate(zip(got["history"], ref["history"], strict=True)):
        bounds = _metric_bounds(tol, r)
        for key in ("loss", "nll", "entropy", "moe_aux_loss", "grad_norm"):
            assert g[key] == pytest.approx(r[key], abs=bounds[key]), (step, key)
        assert g["skipped"] == 0
    assert got["history"][1]["loss"] < got["history"][0]["loss"]
    assert (got["logprobs_after"] - ref["logprobs_after"]).abs().max() <= tol["lp"]
    assert sorted(got["exported_after"]) == sorted(ref["exported_after"])
    for name, want in ref["exported_after"].items():
        if name.endswith("k_proj.bias"):
            # its exact gradient is 0 (softmax ignores a per-query constant): Adam turns float noise
            # into full lr steps, so only the log-probs above speak for it
            continue
        # two Adam steps of lr 1e-2 (run_parallel_steps) from gradients within tol["grad"]
        weight_tol = T.adam_weight_bound(tol["grad"], lr=1e-2, steps=2)
        torch.testing.assert_close(got["exported_after"][name], want, rtol=0, atol=weight_tol, msg=name)


def test_tp2_sp_tags_router_gate_and_norms_for_the_tp_sum(moe_sp):
    got = moe_sp[0]
    q3 = {n.split(".")[-2] for n in got["qwen3_moe_tp2_sp_etp2"]["sp_tagged"]}
    assert {"input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "router"} <= q3
    fused = os.environ.get("RLJOB_FUSED_ELEMENTWISE") == "1"  # FusedRMSNorm: a SequenceParallelRMSNorm
    assert got["qwen3_moe_tp2_sp_etp2"]["norm_types"] == ["FusedRMSNorm" if fused else "SequenceParallelRMSNorm"]
    q2 = got["qwen2_moe_tp2_sp_etp2"]["sp_tagged"]
    assert "decoder.layers.0.mlp.shared_experts.gate_weight" in q2
    assert "decoder.final_layernorm.weight" in q2
