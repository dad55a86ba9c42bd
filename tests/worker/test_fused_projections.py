"""fused_projections: a layer's q/k/v and gate/up as one GEMM each, on the transformers modules' own parameters.

The fused GEMM computes each output column as the module's GEMM does (the same dot product over the hidden size), so
outputs agree to the rounding of one fp32 dot product of that length, bounded elementwise by
``hidden * u * (|x| @ |W|^T + |b|)``; a weight written into a module's parameter by name (weight sync) must reach the
fused GEMM; dropping the fusion before a move and fusing again after it must leave the same layer.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rljob_worker.rollout import fused_projections
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.hf_static_engine import HFStaticEngine

sys.path.insert(0, str(Path(__file__).parent))
from sharp_models import one_torch_thread, sharp_builtin  # noqa: F401 - one_torch_thread: an autouse fixture

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return sharp_builtin("tiny-qwen2", tmp_path_factory, seed=3)


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def gemm_bound(x: torch.Tensor, *linears) -> torch.Tensor:
    """Elementwise bound on two fp32 evaluations of the same dot products over x's last dim (length K)."""
    weight = torch.cat([m.weight for m in linears])
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else 0.0
    return x.shape[-1] * U32 * (x.abs() @ weight.abs().T + (bias.abs() if torch.is_tensor(bias) else 0.0)) + 1e-30


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    excess = (got - want).abs() - bound
    assert excess.max().item() <= 0, f"off by up to {excess.max().item():.3g} beyond the rounding bound"


def test_a_fused_layer_computes_what_its_modules_compute(model_dir):
    model = load(model_dir)
    layers = list(model.model.layers)
    assert fused_projections.fuse(layers) == 3 * len(layers)  # two GEMMs saved in attention, one in the MLP
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = fused_projections.qkv(attn, x)
            for got, module in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)):
                assert_within(got, module(x), gemm_bound(x, module))
            # down(act(gate) * up): the gate/up rounding delta (elementwise) passes through act (|silu'| <= 1.1) and
            # the product; each evaluation also rounds the product (u) and the activation (a few u: exp, division),
            # <= 5u of |inner| each, 10u for the two; then the down GEMM adds its own rounding
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            delta = gemm_bound(x, mlp.gate_proj, mlp.up_proj)
            n = mlp.gate_proj.out_features
            inner = mlp.act_fn(gate) * up
            inner_delta = (1.1 * up.abs() * delta[..., :n] + (mlp.act_fn(gate).abs() + 1.1 * delta[..., :n]) * delta[..., n:]
                           + 10 * U32 * inner.abs())
            bound = gemm_bound(inner, mlp.down_proj) + inner_delta @ mlp.down_proj.weight.abs().T
            assert_within(fused_projections.mlp(mlp, x), mlp.down_proj(inner), bound)
            # the parameters are rows of the fused weight: one storage
            fused = attn.rljob_qkv_weight
            assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.rljob_gate_up_weight.untyped_storage().data_ptr()


def test_weights_written_by_name_reach_the_fused_gemm(model_dir):
    model = load(model_dir)
    layers = list(model.model.layers)
    fused_projections.fuse(layers)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weight sync's in-place copy, by name
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.bias",
                     "model.layers.0.mlp.up_proj.weight"):
            params[name].copy_(torch.randn(params[name].shape, generator=gen))
        x = torch.randn(2, 4, model.config.hidden_size, generator=gen)
        attn = layers[0].self_attn
        _, k, v = fused_projections.qkv(attn, x)
        assert_within(k, x @ params["model.layers.0.self_attn.k_proj.weight"].T + attn.k_proj.bias,
                      gemm_bound(x, attn.k_proj))
        assert_within(v, attn.v_proj(x), gemm_bound(x, attn.v_proj))
        assert torch.equal(attn.rljob_qkv_bias[-attn.v_proj.out_features:],
                           params["model.layers.0.self_attn.v_proj.bias"])


def test_unfuse_before_a_move_and_fuse_after_it_keeps_the_layer(model_dir):
    model = load(model_dir)
    layers = list(model.model.layers)
    fused_projections.fuse(layers)
    x = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = [fused_projections.mlp(layer.mlp, x) for layer in layers]
        fused_projections.unfuse(layers)
        assert getattr(layers[0].self_attn, "rljob_qkv_weight", None) is None
        old_storage = layers[0].self_attn.q_proj.weight.untyped_storage().data_ptr()
        # a move there and back (fp32 -> fp64 -> fp32 is exact): every parameter becomes a tensor of its own
        model.to(torch.float64).to(torch.float32)
        attn = layers[0].self_attn
        assert attn.q_proj.weight.untyped_storage().data_ptr() != old_storage
        assert fused_projections.fuse(layers) == 3 * len(layers)
        assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.rljob_qkv_weight.untyped_storage().data_ptr()
        after = [fused_projections.mlp(layer.mlp, x) for layer in layers]
    for a, b in zip(before, after):  # the same weights through the same GEMMs: the same bits
        assert torch.equal(a, b)


def test_layers_whose_modules_differ_are_left_as_they_are(model_dir):
    model = load(model_dir)
    layers = list(model.model.layers)
    layers[0].self_attn.k_proj.bias = None  # q and v have a bias, k not: one fused bias cannot hold them
    saved = fused_projections.fuse(layers)
    assert saved == 3 * len(layers) - 2
    assert getattr(layers[0].self_attn, "rljob_qkv_weight", None) is None
    x = torch.randn(2, model.config.hidden_size)
    _, k, _ = fused_projections.qkv(layers[0].self_attn, x)  # the separate GEMMs
    assert torch.equal(k, layers[0].self_attn.k_proj(x))


@pytest.mark.parametrize("compile_decode", [False, True])
def test_the_static_engine_with_fused_projections_decodes_as_the_hf_engine(model_dir, compile_decode):
    """On a CPU the engine fuses only when asked (GPUs by default): greedy tokens equal the HF engine's, before and
    after a weight sync, and the compiled layer serves the fused layers."""
    from rljob_worker.data.builtin_models import PAD, VOCAB, build_char_tokenizer
    from rljob_worker.rollout import SamplingParams

    if compile_decode:
        pytest.importorskip("torch._inductor")
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001 - no C++ compiler: inductor cannot build CPU kernels here
            pytest.skip(f"torch.compile on a CPU needs a C++ compiler: {exc}")
    tok = build_char_tokenizer()
    prompts = [tok(s, add_special_tokens=False)["input_ids"] for s in ["12+3=", "9=", "4444 8="]]
    kw = {"dtype": torch.float32, "device": torch.device("cpu"), "eos_token_id": len(VOCAB) + 5,
          "pad_token_id": VOCAB.index(PAD)}
    ref = HFEngine(str(model_dir), **kw)
    static = HFStaticEngine(str(model_dir), **kw, fuse_projections=True, compile_decode=compile_decode,
                            sample_in_step=True if compile_decode else None)
    assert static.fused_gemms_saved == 3 * len(static.layers)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=12)
    assert static.generate(prompts, params).response_ids == ref.generate(prompts, params).response_ids
    gen = torch.Generator().manual_seed(5)
    new = {name: torch.randn(p.shape, generator=gen) * 0.5 for name, p in ref.model.named_parameters()}
    ref.update_weights(new.items())
    static.update_weights(new.items())
    assert static.generate(prompts, params).response_ids == ref.generate(prompts, params).response_ids
