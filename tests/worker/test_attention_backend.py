"""The actor's attention kernel choice (megatron/sdpa_attention.py): flash first on a GPU, torch's order
on request, CPU kernels untouched, a bad setting named with its fix."""
from __future__ import annotations

import contextlib

import pytest
import torch
from rljob_worker.megatron import sdpa_attention


@pytest.fixture
def backend(monkeypatch):
    def choose(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(sdpa_attention.ATTENTION_BACKEND_VAR, raising=False)
        else:
            monkeypatch.setenv(sdpa_attention.ATTENTION_BACKEND_VAR, value)
        sdpa_attention.flash_first.cache_clear()

    yield choose
    sdpa_attention.flash_first.cache_clear()


def test_flash_first_is_the_default_and_auto_gives_torch_its_order(backend):
    backend(None)
    assert sdpa_attention.flash_first()
    backend("auto")
    assert not sdpa_attention.flash_first()


def test_an_unknown_backend_is_refused_naming_the_variable_and_the_choices(backend):
    backend("cudnn")
    with pytest.raises(ValueError, match=r"RLJOB_ATTENTION_BACKEND='cudnn': use flash .* or auto"):
        sdpa_attention.flash_first()


def test_cpu_attention_keeps_torchs_kernels(backend):
    """The order applies to GPU tensors only: on the CPU no kernel is pinned (the CPU tests' numerics are those
    of torch's own choice), and the setting is not even read."""
    backend("not-read-on-cpu")
    assert isinstance(sdpa_attention._kernel_order(on_gpu=False), contextlib.nullcontext)


def _reference(q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention of the same bf16 values in float64, and d/dq of sum(out^2): (out, q.grad)."""
    q = q.detach().double().requires_grad_()
    k = kv.detach().double().repeat_interleave(q.shape[1] // kv.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = q.shape[2]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = scores.softmax(-1) @ k
    out.square().sum().backward()
    return out.detach(), q.grad


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_attention_runs_flash_at_every_length(backend):
    """bf16 causal GQA attention forward and backward at three lengths (a micro-batch's length is new most
    of the time): with the default, flash kernels only and no cuDNN one, and results a float64 reference on the
    same bf16 values gives. Bound: the kernel accumulates in fp32 and rounds to bf16 (unit roundoff u = 2^-8)
    the probabilities before P @ V and the output, each a relative error <= u on one factor of one product, so
    the output's error relative to its norm is <= 2u, asserted at 4u; the query gradient also carries the
    output's rounding (it is 2 x out) and the backward's rounded dP and dS tiles: 8u."""
    from torch.profiler import ProfilerActivity, profile

    backend(None)
    lengths = (97, 256, 301)
    results = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for n in lengths:
            g = torch.Generator(device="cuda").manual_seed(n)
            q = torch.randn(2, 4, n, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            kv = torch.randn(2, 2, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            with sdpa_attention._kernel_order(on_gpu=True):
                out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
                out.float().square().sum().backward()
            results.append((q, kv, out.detach(), q.grad))
    names = [e.key.lower() for e in prof.key_averages()]
    assert any("flash" in n for n in names), names
    assert not any("cudnn" in n for n in names), names
    u = 2.0**-8
    for q, kv, out, grad in results:
        want_out, want_grad = _reference(q, kv)
        assert _relative(out, want_out) <= 4 * u
        assert _relative(grad, want_grad) <= 8 * u
