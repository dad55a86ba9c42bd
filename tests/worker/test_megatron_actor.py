"""The megatron actor at TP=1 on CPU against HF transformers: logits, log-probs, gradients, weight
export, training and distributed checkpoints."""

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

ARCHS = ["qwen2", "llama", "qwen3"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: H.make_tiny_hf_model(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


def _bounds(hf_dir, ids, mask, temperature=1.0) -> dict:
    """Megatron's forward sums in another order than HF's (fused QKV, its own attention and MLP
    kernels): the fp32 reordering bounds of this model on this batch (tolerances.py)."""
    config, seq = T.hf_config(hf_dir), ids.shape[1]
    z = H.max_abs_logit(hf_dir, ids, mask)
    return {"logit": T.logit_bound(config, seq), "lp": T.logprob_bound(config, z, temperature, seq_len=seq),
            "ent": T.entropy_bound(config, z, temperature, seq_len=seq), "config": config, "z": z}


def _actor(hf_dir, lr=1e-3, **optim):
    return MegatronActor.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=lr, **optim), seed=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_logprobs_and_export_match_hf(hf_dirs, arch):
    hf = H.load_hf_model(hf_dirs[arch])
    actor = _actor(hf_dirs[arch])
    ids, mask = H.sample_batch()
    real = mask.bool()

    ref = H.hf_logits(hf, ids, mask)
    got = actor.forward_logits(ids, mask)
    assert got.shape == ref.shape
    err = (got[real] - ref[real]).abs().max() / ref[real].abs().max()
    tol = _bounds(hf_dirs[arch], ids, mask)
    assert err <= tol["logit"], f"max relative logit error {err}"
    assert torch.all(got[~real] == 0)

    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, micro_batch_size=3)["logprobs"]
    torch.testing.assert_close(lp, H.hf_logprobs(hf, ids, mask), rtol=0, atol=tol["lp"])
    assert torch.all(lp[~real] == 0) and torch.all(lp[:, 0] == 0)

    files = load_file(hf_dirs[arch] / "model.safetensors")
    exported = dict(actor.export_hf_weights())
    assert sorted(exported) == sorted(files)
    for name, tensor in files.items():
        assert exported[name].dtype == tensor.dtype
        assert torch.equal(exported[name], tensor), name


def test_entropy_and_gradients_match_hf(hf_dirs):
    """grad_norm of the actor (tied embeddings, entropy bonus) equals the HF autograd grad norm."""
    hf = H.load_hf_model(hf_dirs["qwen2"]).train()
    actor = _actor(hf_dirs["qwen2"], grad_clip=0.0)
    ids, mask = H.sample_batch()
    valid = (mask.bool() & (mask.cumsum(1) > 1)).float()

    def loss_fn(logprobs, entropy, mb):
        v = (mb["attention_mask"].bool() & (mb["attention_mask"].cumsum(1) > 1)).float()
        loss = (-(logprobs * v).sum() - 0.1 * (entropy * v).sum()) / v.sum()
        return loss, {"entropy": (entropy * v).sum() / v.sum()}

    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    lp = torch.nn.functional.pad(logp.gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    ref_loss = (-(lp * valid).sum() - 0.1 * (ent * valid).sum()) / valid.sum()
    ref_loss.backward()
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None))

    ent_ours = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, 4, with_entropy=True)[
        "entropy"
    ]
    tol = _bounds(hf_dirs["qwen2"], ids, mask)
    n, log_v = int(valid.sum()), torch.log(torch.tensor(128.0)).item()
    torch.testing.assert_close(ent_ours, ent * valid, rtol=0, atol=tol["ent"])
    metrics = actor.update(
        {"input_ids": ids, "attention_mask": mask}, loss_fn, micro_batch_size=4, with_entropy=True
    )
    # the loss: a token mean of -log p - 0.1 H; each term within lp + 0.1 ent, at most |z| + 1.1 log V
    loss_tol = T.mean_bound(tol["lp"] + 0.1 * tol["ent"], n, tol["z"] + 1.1 * log_v)
    assert metrics["loss"] == pytest.approx(float(ref_loss), abs=loss_tol)
    grad_tol = T.grad_bound(tol["config"], n, tol["z"], seq_len=ids.shape[1])
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=grad_tol)
    assert metrics["entropy"] == pytest.approx(float((ent * valid).sum() / valid.sum()),
                                               abs=T.mean_bound(tol["ent"], n, log_v))


def test_update_changes_params_and_lowers_loss(hf_dirs):
    actor = _actor(hf_dirs["llama"], lr=1e-2, lr_warmup_steps=2)
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    before = {n: p.detach().clone() for n, p in actor.core.named_parameters()}
    loss0 = actor.eval_loss(ids, mask)
    history = [actor.update(batch, H.seq_nll_loss, micro_batch_size=2) for _ in range(6)]
    assert [m["lr"] for m in history[:3]] == pytest.approx([5e-3, 1e-2, 1e-2])
    assert all(m["grad_norm"] > 0 and m["skipped"] == 0 for m in history)
    assert history[-1]["loss"] < history[0]["loss"] - 0.5
    assert actor.eval_loss(ids, mask) < loss0 - 0.5
    for name, p in actor.core.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not change"


def test_dist_checkpoint_round_trip_tp1(hf_dirs, tmp_path):
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = _actor(hf_dirs["qwen3"], lr=1e-2)
    for _ in range(2):
        actor.update(batch, H.seq_nll_loss, micro_batch_size=2)
    actor.save_checkpoint(tmp_path / "ckpt")
    params = {n: p.detach().clone() for n, p in actor.core.named_parameters()}
    opt_state = actor.optimizer.state_dict()["state"]

    fresh = _actor(hf_dirs["qwen3"], lr=1e-2)
    meta = fresh.load_checkpoint(tmp_path / "ckpt")
    assert meta["step"] == 2 and fresh.step == 2
    for n, p in fresh.core.named_parameters():
        assert torch.equal(p, params[n]), n
    loaded_state = fresh.optimizer.state_dict()["state"]
    assert loaded_state.keys() == opt_state.keys()
    for k, st in opt_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded_state[k][key], st[key]), (k, key)
    # training continues identically
    assert actor.update(batch, H.seq_nll_loss, 2) == fresh.update(batch, H.seq_nll_loss, 2)


def test_frozen_reference_actor(hf_dirs, tmp_path):
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = _actor(hf_dirs["qwen2"], lr=1e-2)
    ref = MegatronActor.from_hf(hf_dirs["qwen2"], ParallelConfig(), OptimConfig(lr=1e-2), trainable=False)
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.core.parameters())
    torch.testing.assert_close(
        ref.compute_logprobs(batch, 4), actor.compute_logprobs(batch, 4), rtol=0, atol=0
    )
    with pytest.raises(RuntimeError, match="trainable=False"):
        ref.update(batch, H.seq_nll_loss, 4)
    actor.update(batch, H.seq_nll_loss, 4)
    actor.save_checkpoint(tmp_path / "ckpt")
    assert ref.load_checkpoint(tmp_path / "ckpt")["step"] == 1  # weights only from a training checkpoint
    assert ref.eval_loss(ids, mask) == actor.eval_loss(ids, mask)


def test_save_hf_checkpoint_loads_in_transformers(hf_dirs, tmp_path):
    actor = _actor(hf_dirs["qwen2"], lr=1e-2)
    ids, mask = H.sample_batch()
    actor.update({"input_ids": ids, "attention_mask": mask}, H.seq_nll_loss, micro_batch_size=4)
    actor.save_hf_checkpoint(tmp_path / "export")
    hf = H.load_hf_model(tmp_path / "export")
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, 4)["logprobs"]
    tol = _bounds(tmp_path / "export", ids, mask)["lp"]
    torch.testing.assert_close(lp, H.hf_logprobs(hf, ids, mask), rtol=0, atol=tol)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "unfused-head"])
def test_logprobs_and_entropy_at_a_sampling_temperature(hf_dirs, fused):
    """logit_temperature T: log-probs and entropy of softmax(logits / T), as HF's logits divided by T."""
    hf = H.load_hf_model(hf_dirs["qwen2"])
    actor = MegatronActor.from_hf(hf_dirs["qwen2"], ParallelConfig(), OptimConfig(lr=1e-3), seed=1, fused_head=fused)
    actor.logit_temperature = 0.7
    ids, mask = H.sample_batch()
    m = mask.bool()
    valid = m & (m.long().cumsum(1) > 1)
    logp = torch.log_softmax(H.hf_logits(hf, ids, mask).float() / 0.7, -1)[:, :-1]
    want_lp = torch.nn.functional.pad(logp.gather(-1, ids[:, 1:, None])[..., 0], (1, 0)) * valid
    want_ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0)) * valid
    got = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, micro_batch_size=3, with_entropy=True)
    tol = _bounds(hf_dirs["qwen2"], ids, mask, temperature=0.7)
    torch.testing.assert_close(got["logprobs"], want_lp, rtol=0, atol=tol["lp"])
    torch.testing.assert_close(got["entropy"], want_ent, rtol=0, atol=tol["ent"])
    at_one = H.hf_logprobs(hf, ids, mask)
    assert (got["logprobs"] - at_one).abs().max() > 1e-2  # the temperature changed them
