"""The bounds in tolerances.py against the arithmetic they bound: sums and matmuls in two orders, a tiny
decoder's log-probs and gradients in fp32 against fp64, and the size of the bugs the bounds must still
catch (a factor of 2, a normaliser off by the micro-batch count)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [10, 1000, 100_000])
def test_sums_in_two_orders_stay_within_reorder_bound(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    exact = x.double().sum().item()
    bound = T.reorder_bound(n, x.double().abs().sum().item(), dtype)
    orders = [x.sum(), x.flip(0).sum(), x[torch.randperm(n, generator=g)].sum()]
    if n % 10 == 0:
        orders.append(x.view(-1, 10).sum(0).sum())  # blocked, as another SIMD width sums
    chain = torch.zeros((), dtype=dtype)
    for v in x[:1000]:  # strictly left to right (the worst case's shape; capped, Python is slow)
        chain = chain + v
    assert abs(chain.double().item() - x[:1000].double().sum().item()) <= T.reorder_bound(
        min(n, 1000), x[:1000].double().abs().sum().item(), dtype)
    for got in orders:
        assert abs(got.double().item() - exact) <= bound
    # terms of one sign (a loss's -log p, a norm's squares) do not cancel: the bound is relative to the
    # sum itself there, and a factor of 2 is far outside it
    pos = x.abs()
    pos_sum = pos.double().sum().item()
    assert abs(pos.sum().double().item() - pos_sum) <= T.reorder_bound(n, pos_sum, dtype)
    if dtype == torch.float32:
        assert pos_sum > 10 * T.reorder_bound(n, pos_sum, dtype)


def test_matmul_batched_vs_rows_within_reorder_bound():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 256, generator=g)
    batched = a @ b
    rows = torch.stack([a[i : i + 1] @ b for i in range(64)])[:, 0]
    exact = a.double() @ b.double()
    bound = T.reorder_bound(512, 1.0) * (a.abs().double() @ b.abs().double())
    assert ((batched.double() - exact).abs() <= bound).all()
    assert ((rows.double() - batched.double()).abs() <= 2 * bound).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_dir = H.make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("hf") / "qwen2")
    return hf_dir, T.hf_config(hf_dir)


def _nll_and_grads(model, ids, mask, scale=1.0):
    model.zero_grad()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    valid = (mask.bool() & (mask.cumsum(1) > 1))[:, 1:].to(lp.dtype)
    loss = -(lp * valid).sum() / valid.sum() * scale
    loss.backward()
    grad = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return lp.detach().double() * valid, loss.item(), grad, int(valid.sum())


def test_decoder_logprobs_and_gradients_within_their_bounds(tiny):
    hf_dir, config = tiny
    ids, _ = H.sample_batch()
    mask = torch.ones_like(ids)  # no padding: fp64 eager attention turns fully masked rows into NaN
    fp32 = H.load_hf_model(hf_dir).train()
    fp64 = H.load_hf_model(hf_dir).double().train()
    lp32, loss32, g32, n = _nll_and_grads(fp32, ids, mask)
    lp64, loss64, g64, _ = _nll_and_grads(fp64, ids, mask)
    z = H.max_abs_logit(hf_dir, ids, mask)
    lp_tol = T.logprob_bound(config, z, seq_len=ids.shape[1])
    assert (lp32 - lp64).abs().max().item() <= lp_tol
    assert abs(loss32 - loss64) <= T.mean_bound(lp_tol, n, z + 4.9)
    rel = ((g32 - g64).norm() / g64.norm()).item()
    grad_tol = T.grad_bound(config, n, z, seq_len=ids.shape[1])
    assert rel <= grad_tol and abs(g32.norm().item() / g64.norm().item() - 1) <= grad_tol
    # the bugs the bounds stand in for are orders of magnitude above them
    _, loss_half, g_half, _ = _nll_and_grads(fp64, ids, mask, scale=0.5)  # a normaliser off by 2
    assert abs(loss_half - loss64) > 100 * T.mean_bound(lp_tol, n, z + 4.9)
    assert ((g_half - g64).norm() / g64.norm()).item() > 100 * grad_tol
    shifted = torch.roll(lp64, 1, dims=1)  # a log-prob read one position off
    assert (shifted - lp64).abs().max().item() > 100 * lp_tol


def test_binomial_bound_holds_a_fair_sampler():
    g = torch.Generator().manual_seed(0)
    n, p = 20_000, 0.3
    freq = (torch.rand(n, generator=g) < p).double().mean().item()
    assert abs(freq - p) <= T.binomial_bound(n, p)
    assert abs(0.35 - p) > T.binomial_bound(n, p)  # a sampler 5 points off is caught
