"""The actor's fused policy head (log-probs and entropy from the hidden state in token chunks)
against the unfused head over full vocab-parallel logits: same log-probs, entropy, loss, grad norm,
gradients of every parameter and log-probs after two updates, in fp32, for tied and untied output layers. The parallel layouts (TP2
with a padded vocab, SP, CP, PP) run the fused head by default and are compared with one process in
their own test modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron import fused_head
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) path; GPU: test_fused_head_on_gpu")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: H.make_tiny_hf_model(arch, root / arch, seed=i) for i, arch in enumerate(["qwen2", "qwen3"])}


def _run(hf_dir, fused: bool, monkeypatch) -> dict:
    calls, real = [], fused_head.fused_logprobs_entropy
    monkeypatch.setattr(fused_head, "fused_logprobs_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    actor = MegatronActor.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=1e-3), seed=1, fused_head=fused)
    ids, mask = H.varied_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    before = actor.compute_logprobs(batch, micro_batch_size=3, with_entropy=True)
    grads, step = {}, actor._cpu_step

    def snapshot_then_step(lr):  # the gradients as the optimizer receives them (first update)
        if not grads:
            grads.update({n: p.grad.clone() for n, p in actor.core.named_parameters() if p.grad is not None})
        return step(lr)

    actor._cpu_step = snapshot_then_step
    metrics = [actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True)]
    metrics.append(actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True))
    after = actor.compute_logprobs(batch, micro_batch_size=4, with_entropy=True)
    logits = actor.forward_logits(ids, mask)
    assert bool(calls) == fused, f"fused_head={fused} but the fused kernel ran {len(calls)} times"
    return {"before": before, "metrics": metrics, "after": after, "grads": grads, "logits": logits}


@cpu_only
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # tied / untied output layer
def test_fused_head_equals_unfused(hf_dirs, arch, monkeypatch):
    unfused, fused = _run(hf_dirs[arch], False, monkeypatch), _run(hf_dirs[arch], True, monkeypatch)
    # the fused head sums the vocabulary in chunks and the weight gradient over tokens in another order:
    # the decoder's reordering bounds (tolerances.py) on this model and batch
    ids, mask = H.varied_batch()
    config, seq, z = T.hf_config(hf_dirs[arch]), ids.shape[1], H.max_abs_logit(hf_dirs[arch], ids, mask)
    n = int((mask.bool() & (mask.cumsum(1) > 1)).sum())
    log_v = torch.log(torch.tensor(float(config["vocab_size"]))).item()
    tol = {"logprobs": T.logprob_bound(config, z, seq_len=seq), "entropy": T.entropy_bound(config, z, seq_len=seq)}
    tol |= {"nll": T.mean_bound(tol["logprobs"], n, z + log_v), "entropy_mean": T.mean_bound(tol["entropy"], n, log_v)}
    grad_tol = T.grad_bound(config, n, z, seq_len=seq)
    # "after" (two Adam steps) is taken as within the same bounds: a gradient component within grad_tol
    # of zero could flip its sign-normalised step, which no rounding bound covers
    for when in ("before", "after"):
        for key in ("logprobs", "entropy"):
            diff = (fused[when][key] - unfused[when][key]).abs().max().item()
            assert diff <= tol[key], f"{when} {key}: {diff:.3g}"
    for m_f, m_u in zip(fused["metrics"], unfused["metrics"]):
        for key, bound in (("loss", tol["nll"]), ("nll", tol["nll"]), ("entropy", tol["entropy_mean"])):
            assert m_f[key] == pytest.approx(m_u[key], abs=bound), key
        assert m_f["grad_norm"] == pytest.approx(m_u["grad_norm"], rel=grad_tol)
    assert unfused["grads"].keys() == fused["grads"].keys() and len(fused["grads"]) > 10
    for name, g in unfused["grads"].items():  # each tensor within grad_tol of its own size
        assert (fused["grads"][name] - g).abs().max() <= grad_tol * g.abs().max(), name
    # the update moved the weights (the comparison is not of two untouched models), and the output
    # layer is whole again after the fused passes (forward_logits goes through it)
    assert (fused["after"]["logprobs"] - fused["before"]["logprobs"]).abs().max() > 1e-4
    logit_tol = T.logit_bound(config, seq) * unfused["logits"].abs().max()
    assert (fused["logits"] - unfused["logits"]).abs().max() <= logit_tol


@cpu_only
def test_env_turns_the_fused_head_off(hf_dirs, monkeypatch):
    monkeypatch.setenv("RLJOB_FUSED_LOGPROBS", "0")
    assert not MegatronActor.from_hf(hf_dirs["qwen2"], ParallelConfig(), OptimConfig(lr=1e-3), seed=1).fused_head
    monkeypatch.delenv("RLJOB_FUSED_LOGPROBS")
    assert MegatronActor.from_hf(hf_dirs["qwen2"], ParallelConfig(), OptimConfig(lr=1e-3), seed=1).fused_head


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tol, norm_tol, after_tol", [(torch.float32, 1e-4, 1e-4, 1e-3),
                                                            (torch.bfloat16, 5e-2, 2e-2, 5e-2)])
def test_fused_head_on_gpu(hf_dirs, dtype, tol, norm_tol, after_tol):
    """GPU path: megatron DDP + optimizer (the fused weight gradient must reach the main-grad
    buffers), Float16Module in bf16, the torch.compile'd chunk kernels."""
    ids, mask = H.varied_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    out = {}
    for fused in (False, True):
        actor = MegatronActor.from_hf(hf_dirs["qwen2"], ParallelConfig(), OptimConfig(lr=1e-3, grad_clip=100.0),
                                      dtype=dtype, seed=1, fused_head=fused)
        before = actor.compute_logprobs(batch, micro_batch_size=3, with_entropy=True)
        metrics = actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True)
        after = actor.compute_logprobs(batch, micro_batch_size=4)
        out[fused] = (before, metrics, after)
    (b0, m0, a0), (b1, m1, a1) = out[False], out[True]
    for key in ("logprobs", "entropy"):
        assert (b1[key] - b0[key]).abs().max() <= tol, key
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=norm_tol)
    assert m1["loss"] == pytest.approx(m0["loss"], rel=norm_tol)
    assert (a1["logprobs"] - a0["logprobs"]).abs().max() <= after_tol
