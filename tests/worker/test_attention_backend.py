"""The actor's attention kernel choice (megatron/sdpa_attention.py): flash first on a GPU, torch's order
on request, CPU kernels untouched, a bad setting named with its fix."""
from __future__ import annotations

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
    """The order applies to GPU tensors only: on the CPU nothing is pinned (the CPU tests' numerics are
    those of torch's own choice), and the setting is not even read."""
    backend("not-read-on-cpu")
    with sdpa_attention._kernel_order(on_gpu=False):
        q = torch.randn(1, 2, 5, 8)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_attention_runs_flash_at_every_length(backend):
    """bf16 causal GQA attention forward and backward at three lengths (a micro-batch's length is new most
    of the time): with the default, flash kernels only; torch's order ("auto") gives the same outputs within
    bf16 rounding of a head_dim-long dot product's reordering."""
    from torch.profiler import ProfilerActivity, profile

    def run(length: int):
        g = torch.Generator(device="cuda").manual_seed(length)
        q = torch.randn(2, 4, length, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        kv = torch.randn(2, 2, length, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        with sdpa_attention._kernel_order(on_gpu=True):
            out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            out.float().square().sum().backward()
        return out.detach(), q.grad

    backend(None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flash = [run(n) for n in (97, 256, 301)]
    names = [e.key.lower() for e in prof.key_averages()]
    assert any("flash" in n for n in names), names
    assert not any("cudnn" in n for n in names), names
    backend("auto")
    for (out, grad), n in zip(flash, (97, 256, 301)):
        want_out, want_grad = run(n)
        torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)  # bf16: 8 bits of mantissa
        torch.testing.assert_close(grad, want_grad, rtol=5e-2, atol=5e-2)
