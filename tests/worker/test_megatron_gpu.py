"""The megatron actor's GPU path (megatron DDP + megatron optimizer, Float16Module for bf16).

Needs a CUDA GPU (two for the TP=2, DP=2 and PP=2 tests): run with the device tool, e.g.
``python -m pytest tests/worker/test_megatron_gpu.py -q``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        arch: H.make_tiny_hf_model(arch, root / arch, seed=i) for i, arch in enumerate(["qwen2", "qwen3"])
    }


def _actor(hf_dir, dtype, lr=1e-3, **kw):
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    return MegatronActor.from_hf(
        hf_dir, ParallelConfig(**kw), OptimConfig(lr=lr, grad_clip=100.0), dtype=dtype, seed=1
    )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fp32_matches_hf(hf_dirs, arch):
    hf = H.load_hf_model(hf_dirs[arch])
    actor = _actor(hf_dirs[arch], torch.float32)
    ids, mask = H.sample_batch()
    real = mask.bool()
    ref = H.hf_logits(hf, ids, mask)
    got = actor.forward_logits(ids, mask)
    err = (got[real] - ref[real]).abs().max() / ref[real].abs().max()
    assert err <= 1e-4, err
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, 2)["logprobs"]
    torch.testing.assert_close(lp, H.hf_logprobs(hf, ids, mask), rtol=0, atol=1e-4)
    files = load_file(hf_dirs[arch] / "model.safetensors")
    exported = {k: v.cpu() for k, v in actor.export_hf_weights()}
    assert sorted(exported) == sorted(files)
    assert all(torch.equal(exported[k], files[k]) for k in files)


def test_fp32_grad_norm_matches_hf(hf_dirs):
    hf = H.load_hf_model(hf_dirs["qwen2"]).train()
    actor = _actor(hf_dirs["qwen2"], torch.float32)
    ids, mask = H.sample_batch()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
    ref_lp = torch.nn.functional.pad(
        torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0)
    )
    valid = (mask.bool() & (mask.cumsum(1) > 1)).float()
    ref_loss = -(ref_lp * valid).sum() / valid.sum()
    ref_loss.backward()
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None))
    metrics = actor.update({"input_ids": ids, "attention_mask": mask}, H.seq_nll_loss, micro_batch_size=4)
    assert metrics["loss"] == pytest.approx(float(ref_loss), abs=1e-4)
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-3)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_bf16_trains_and_checkpoints(hf_dirs, tmp_path, distributed_optimizer):
    hf = H.load_hf_model(hf_dirs["qwen2"])
    actor = _actor(hf_dirs["qwen2"], torch.bfloat16, lr=1e-2, use_distributed_optimizer=distributed_optimizer)
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    # bf16 weights are the HF weights rounded; log-probs close to fp32 HF
    files = load_file(hf_dirs["qwen2"] / "model.safetensors")
    exported = {k: v.cpu() for k, v in actor.export_hf_weights()}
    assert all(torch.equal(exported[k], files[k].to(torch.bfloat16)) for k in files)
    res = actor.compute_logprobs(batch, 2, with_entropy=True)
    assert (res["logprobs"] - H.hf_logprobs(hf, ids, mask)).abs().max() < 0.1
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    ref = MegatronActor.from_hf(
        hf_dirs["qwen2"], ParallelConfig(), OptimConfig(lr=1e-2), dtype=torch.bfloat16, trainable=False
    )
    # a frozen copy computes exactly what the trainable actor computes, call for call
    same = ref.compute_logprobs(batch, 2, with_entropy=True)
    torch.testing.assert_close(same["logprobs"], res["logprobs"], rtol=0, atol=0)
    torch.testing.assert_close(same["entropy"], res["entropy"], rtol=0, atol=0)
    # without the entropy the head's compiled reduction is another kernel, whose log-sum-exp may add in another
    # order: within a blocked fp32 sum's bound, log2(V) ulps of the largest log-prob (one ulp seen on the H200)
    alone = ref.compute_logprobs(batch, 2)["logprobs"]
    bound = math.log2(hf.config.vocab_size) * torch.finfo(torch.float32).eps * max(1.0, res["logprobs"].abs().max())
    assert (alone - res["logprobs"]).abs().max() <= bound
    loss0 = actor.eval_loss(ids, mask)
    history = [actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True) for _ in range(5)]
    assert all(m["skipped"] == 0 and m["grad_norm"] > 0 for m in history)
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    assert actor.eval_loss(ids, mask) < loss0 - 0.3

    actor.save_checkpoint(tmp_path / "ckpt")
    fresh = _actor(hf_dirs["qwen2"], torch.bfloat16, lr=1e-2, use_distributed_optimizer=distributed_optimizer)
    meta = fresh.load_checkpoint(tmp_path / "ckpt")
    assert meta["step"] == 5
    assert fresh.eval_loss(ids, mask) == actor.eval_loss(ids, mask)
    a, b = actor.update(batch, H.seq_nll_loss, 2), fresh.update(batch, H.seq_nll_loss, 2)
    assert a["loss"] == b["loss"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_equals_tp1_on_gpus(tmp_path):
    hf_dir = H.make_tiny_hf_model("qwen2", tmp_path / "hf")
    H.make_tiny_hf_model("llama", tmp_path / "out" / "hf_pad", vocab_size=127)
    H.run_torchrun("tp2", hf_dir, tmp_path / "out", timeout=300)
    tp2 = torch.load(tmp_path / "out" / "tp2.pt", map_location="cpu")
    dp2 = torch.load(tmp_path / "out" / "dp2.pt", map_location="cpu")
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = _actor(hf_dir, torch.float32)
    res = actor.compute_logprobs(batch, 2, with_entropy=True)
    torch.testing.assert_close(tp2["logprobs"], res["logprobs"], rtol=0, atol=1e-4)
    torch.testing.assert_close(tp2["entropy"], res["entropy"], rtol=0, atol=1e-4)
    files = load_file(hf_dir / "model.safetensors")
    assert all(torch.equal(tp2["exported"][k], files[k]) for k in files)
    m = actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True)
    assert tp2["metrics"]["loss"] == pytest.approx(m["loss"], abs=1e-4)
    assert tp2["metrics"]["grad_norm"] == pytest.approx(m["grad_norm"], abs=1e-3)
    assert dp2["metrics"]["loss"] == pytest.approx(m["loss"], abs=1e-4)
    assert torch.equal(dp2["checksums"][0], dp2["checksums"][1])
    fresh = _actor(hf_dir, torch.float32)
    fresh.load_checkpoint(tmp_path / "out" / "ckpt_tp2")
    assert fresh.eval_loss(ids, mask) == pytest.approx(tp2["eval_loss"], abs=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dp2_distributed_optimizer_checkpoint_reshards_to_one_gpu(tmp_path):
    hf_dir = H.make_tiny_hf_model("qwen2", tmp_path / "hf")
    H.run_torchrun("dp2_bf16_distopt", hf_dir, tmp_path / "out", timeout=300)
    dp2 = torch.load(tmp_path / "out" / "dp2_distopt.pt", map_location="cpu")
    assert dp2["history"][-1]["loss"] < dp2["history"][0]["loss"]
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = _actor(hf_dir, torch.bfloat16, lr=1e-2, use_distributed_optimizer=True)
    assert actor.load_checkpoint(tmp_path / "out" / "ckpt_dp2_distopt")["step"] == 3
    # the next update on one GPU over the whole batch repeats the DP=2 one (same mean over 2 micro-batches)
    nxt = actor.update(batch, H.seq_nll_loss, micro_batch_size=2)
    assert nxt["loss"] == pytest.approx(dp2["next"]["loss"], abs=1e-3)
    assert nxt["grad_norm"] == pytest.approx(dp2["next"]["grad_norm"], rel=1e-2)
    for name, tensor in actor.export_hf_weights():
        torch.testing.assert_close(tensor.cpu().float(), dp2["exported"][name].float(), rtol=0, atol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp2_and_tp2_sequence_parallel_equal_one_gpu_bf16(tmp_path):
    """CP=2 and TP=2 + sequence parallel (local spec unless transformer_engine is installed), bf16,
    against one GPU: log-probs, entropy and two updates within bf16 noise."""
    from rljob_worker.megatron.actor import ParallelConfig

    hf = {
        "qwen2": H.make_tiny_hf_model("qwen2", tmp_path / "hf"),
        "qwen3": H.make_tiny_hf_model("qwen3", tmp_path / "out" / "hf_qwen3", seed=2),
    }
    H.run_torchrun("cp_sp", hf["qwen2"], tmp_path / "out", timeout=300)
    got = torch.load(tmp_path / "out" / "cp_sp.pt", map_location="cpu")
    ref = {arch: H.run_parallel_steps(d, ParallelConfig(), torch.bfloat16) for arch, d in hf.items()}

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    assert got["cp2"]["seq_seen"] == [8, 8] and got["tp2_sp"]["seq_seen"] == [8, 7]
    # every comparison is made and printed before the verdict, so one run shows the whole picture
    off = []
    for layout, arch in (("cp2", "qwen2"), ("tp2_sp", "qwen2"), ("tp2_qwen3", "qwen3"), ("tp2_sp_qwen3", "qwen3")):
        g, r = got[layout], ref[arch]
        # after two Adam steps at lr 1e-2, bf16 rounding in near-zero gradients becomes whole +-lr
        # steps (Adam normalises them): measured on 4 H200s, qwen3 TP2 (with or without SP) moved a
        # log-prob by 2.05e-2 relative while every step's loss agreed to 4e-4: a looser bound there
        for key, bound in (("logprobs", 1e-2), ("entropy", 1e-2), ("logprobs_after", 5e-2)):
            print(layout, key, f"rel {rel(g[key], r[key]):.2e}")
            if rel(g[key], r[key]) > bound:
                off.append((layout, key, rel(g[key], r[key])))
        for step, (mg, mr) in enumerate(zip(g["history"], r["history"])):
            assert mg["skipped"] == 0, (layout, step)
            for key in ("loss", "entropy", "grad_norm"):
                print(layout, step, key, mg[key], mr[key])
                if mg[key] != pytest.approx(mr[key], rel=1e-2):
                    off.append((layout, step, key, mg[key], mr[key]))
    assert not off, off


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_moe_ep2_bf16_equals_ep1_and_hf(tmp_path):
    """Qwen3-MoE, bf16, distributed optimizer: EP=2 (two experts per GPU, alltoall over NCCL) against
    EP=1 on the same two GPUs, and both against HF in fp32 (relative error <= 1e-2)."""
    hf_dir = H.make_tiny_hf_model("qwen3_moe", tmp_path / "hf")
    H.run_torchrun("ep2_bf16", hf_dir, tmp_path / "out", timeout=300)
    res = torch.load(tmp_path / "out" / "ep2_bf16.pt")
    ids, mask = H.sample_batch()
    ref = H.hf_logprobs(H.load_hf_model(hf_dir), ids, mask)
    scale = ref.abs().max()
    for layout in ("ep1", "ep2"):
        assert (res[layout]["logprobs"] - ref).abs().max() / scale <= 1e-2, layout
    assert (res["ep2"]["logprobs"] - res["ep1"]["logprobs"]).abs().max() / scale <= 1e-2
    for got, want in zip(res["ep2"]["history"], res["ep1"]["history"], strict=True):
        assert got["skipped"] == want["skipped"] == 0
        for key in ("loss", "moe_aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-2), key
    assert res["ep2"]["history"][1]["loss"] < res["ep2"]["history"][0]["loss"]
    assert sorted(res["ep2"]["exported"]) == sorted(res["ep1"]["exported"])
    for name, tensor in res["ep2"]["exported"].items():
        want = res["ep1"]["exported"][name]
        # Adam (lr 1e-2) turns bf16 rounding in tiny gradients into whole steps: allow half a step
        # (measured on H200s: 2.0e-3 on an expert weight, with losses and grad norms within 1e-2)
        assert (tensor - want).abs().max() <= 1e-2 * want.abs().max() + 5e-3, name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_bf16_equals_pp1_on_gpus(tmp_path):
    """PP=2 over two GPUs (NCCL p2p, megatron DDP per stage, finalize_model_grads summing the tied
    embedding's two copies) against PP=1 on one GPU, both bf16: log-probs, entropy, two updates,
    exported weights; then the PP2 checkpoint loads into PP1."""
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    models = H.make_pp_models(tmp_path / "models")
    H.run_torchrun("pp2_bf16", models, tmp_path / "out", timeout=300)
    ranks = [torch.load(tmp_path / "out" / f"pp2_bf16_rank{r}.pt", map_location="cpu") for r in range(2)]

    def rel(got, want):
        return float((got.float() - want.float()).abs().max() / want.float().abs().max())

    for name in ("llama", "qwen2_tied"):
        got = ranks[0][name]
        assert ranks[1][name]["updates"] == got["updates"]
        assert torch.equal(ranks[1][name]["logprobs"], got["logprobs"])
        pp1 = MegatronActor.from_hf(models / name, ParallelConfig(), OptimConfig(lr=1e-3), dtype=torch.bfloat16, seed=1)
        want = H.pp_steps(pp1)
        for key in ("logprobs", "entropy", "logits", "logprobs_after"):
            assert rel(got[key], want[key]) <= 1e-2, (name, key)
        for g, w in zip(got["updates"], want["updates"]):
            assert g["skipped"] == 0
            for key in ("loss", "entropy", "grad_norm"):
                assert g[key] == pytest.approx(w[key], rel=1e-2), (name, key)
        for hf_name, tensor in want["exported_after"].items():
            assert rel(got["exported_after"][hf_name], tensor) <= 1e-2, (name, hf_name)
        fresh = MegatronActor.from_hf(models / name, ParallelConfig(), OptimConfig(lr=1e-3), dtype=torch.bfloat16)
        assert fresh.load_checkpoint(tmp_path / "out" / f"ckpt_bf16_{name}")["pp"] == 2
        ids, mask = H.sample_batch()
        assert fresh.eval_loss(ids, mask) == pytest.approx(got["eval_loss"], rel=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_moe_pp2_bf16_equals_pp1_on_gpus(tmp_path):
    """Mixture-of-experts x PP=2 (EP=1) over two GPUs in bf16 (megatron DDP and optimizer per stage,
    expert buffers, aux loss scaled by the schedule) against PP=1 on one GPU in bf16: the 4-layer
    Qwen3-MoE with a dense layer 1 and the Qwen2-MoE with shared experts of MOE_PP_MODELS; log-probs,
    entropy, two updates (loss, moe_aux_loss, grad_norm), export before (against the HF files) and
    after training; then the PP2 checkpoint loads into PP1. Relative error <= 1e-2."""
    _check_moe_pp2_bf16(tmp_path, "moe_pp2_bf16", ("qwen3_moe4", "qwen2_moe"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_moe_pp2_bf16_stage_without_experts_equals_pp1_on_gpus(tmp_path):
    """As above for a 2-layer Qwen3-MoE whose layer 1 (stage 1) is dense: stage 1 holds no expert
    parameters, so megatron's optimizer there has no expert optimizer in its chain."""
    _check_moe_pp2_bf16(tmp_path, "moe_pp2_bf16_dense_last", ("qwen3_moe_dense_last",))


def _check_moe_pp2_bf16(tmp_path, scenario: str, names: tuple[str, ...]) -> None:
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    models = H.make_moe_pp_models(tmp_path / "models")
    H.run_torchrun(scenario, models, tmp_path / "out", timeout=300)
    ranks = [torch.load(tmp_path / "out" / f"moe_pp2_bf16_rank{r}.pt", map_location="cpu") for r in range(2)]

    def rel(got, want):
        return float((got.float() - want.float()).abs().max() / want.float().abs().max())

    def pp1(name, seed=1):
        return MegatronActor.from_hf(
            models / name,
            ParallelConfig(),
            OptimConfig(lr=1e-3, grad_clip=100.0),
            dtype=torch.bfloat16,
            seed=seed,
        )

    for name in names:
        assert any(layer == "MoELayer" for layer in ranks[0][name]["moe_layers"]), name
        got = ranks[0][name]
        assert ranks[1][name]["updates"] == got["updates"]
        assert torch.equal(ranks[1][name]["logprobs"], got["logprobs"])
        files = load_file(models / name / "model.safetensors")
        for rank in ranks:
            assert sorted(rank[name]["exported"]) == sorted(files)
            for hf_name, tensor in files.items():
                assert rel(rank[name]["exported"][hf_name], tensor) <= 1e-2, (name, hf_name)
        want = H.moe_pp_steps(pp1(name))
        for key in ("logprobs", "entropy", "logits", "logprobs_after"):
            assert rel(got[key], want[key]) <= 1e-2, (name, key)
        for g, w in zip(got["updates"], want["updates"], strict=True):
            assert g["skipped"] == w["skipped"] == 0
            for key in ("loss", "entropy", "moe_aux_loss", "grad_norm"):
                assert g[key] == pytest.approx(w[key], rel=1e-2), (name, key)
        assert got["updates"][1]["loss"] < got["updates"][0]["loss"]
        for hf_name, tensor in want["exported_after"].items():
            assert rel(got["exported_after"][hf_name], tensor) <= 1e-2, (name, hf_name)
        fresh = pp1(name, seed=5)
        assert fresh.load_checkpoint(tmp_path / "out" / f"ckpt_moe_pp2_bf16_{name}")["pp"] == 2
        assert fresh.eval_loss(*H.sample_batch()) == pytest.approx(got["eval_loss"], rel=1e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_four_gpu_layouts_equal_one_gpu_bf16(tmp_path):
    """TP2 x PP2, TP2 x DP2 and PP2 x DP2 (distributed optimizer), and Qwen3-MoE at TP2 + SP x EP2,
    on four GPUs in bf16, against one GPU: log-probs, entropy, two updates (loss, grad norm, MoE aux
    loss) and the log-probs after them, within bf16 noise (relative 1e-2)."""
    from rljob_worker.megatron.actor import ParallelConfig

    root = tmp_path / "models"
    for model in {m for m, _ in H.FOUR_GPU_LAYOUTS.values()}:
        H.make_tiny_hf_model(model, root / model, seed=3)
    H.run_torchrun("gpu4", root, tmp_path, nproc=4, timeout=400)
    got = torch.load(tmp_path / "gpu4.pt", map_location="cpu")
    ref = {m: H.run_parallel_steps(root / m, ParallelConfig(), torch.bfloat16) for m in ("qwen2", "qwen3_moe")}

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    failures = {name: g["error"] for name, g in got.items() if "error" in g}
    assert not failures, failures
    for name, (model, _) in H.FOUR_GPU_LAYOUTS.items():
        g, r = got[name], ref[model]
        # after an update, bf16 noise can flip a near-tied top-k routing choice of the MoE model, which
        # moves its outputs by more than rounding (seen on CPU in bf16: 3.8e-2): a looser bound there
        after = 5e-2 if model.endswith("_moe") else 1e-2
        for key, bound in (("logprobs", 1e-2), ("entropy", 1e-2), ("logprobs_after", after)):
            assert rel(g[key], r[key]) <= bound, (name, key, rel(g[key], r[key]))
        for step, (mg, mr) in enumerate(zip(g["history"], r["history"], strict=True)):
            assert mg["skipped"] == 0, (name, step)
            for key in ("loss", "grad_norm", "moe_aux_loss"):
                if key in mr:
                    bound = 1e-2 if step == 0 else after
                    assert mg[key] == pytest.approx(mr[key], rel=bound), (name, step, key, mg[key], mr[key])
