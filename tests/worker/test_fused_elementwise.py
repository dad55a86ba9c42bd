"""The fused elementwise kernels of the local layer spec (compiled RMSNorm, RoPE, SwiGLU) against
the eager ops they replace: values and gradients in fp32 (1e-5), each function alone and a whole tiny
model (forward, backward, an update) with the fusions on and off. The compiled paths run for real on
CPU (inductor's C++ backend); without a working C++ compiler they skip with the reason."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron import fused_elementwise as fe
from rljob_worker.megatron.errors import MegatronConfigError

# The kernels alone (relative to max(1, |value|)): the norm's mean square sums 64 terms, its weight
# gradient the s * b <= 33 tokens; compiled exp/rsqrt/sin/cos may differ by a few ulps (8 allowed).
TOL = T.reorder_bound(64 + 33 + 8, 1.0)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) path; GPU: bench/actor_update.py")


@functools.lru_cache(maxsize=1)
def _compile_unavailable() -> str | None:
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as exc:  # noqa: BLE001 - any failure means no compiled path on this machine
        return f"torch.compile does not run on this CPU: {type(exc).__name__}: {str(exc)[:200]}"
    return None


@pytest.fixture
def compiled():
    reason = _compile_unavailable()
    if reason:
        pytest.skip(reason)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= TOL * max(1.0, b.abs().max().item()), f"{what}: max |diff| {diff:.3g}"


def _graphs() -> int:
    """Graphs dynamo has compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _values_and_grads(fn, *inputs, upstream):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(upstream)
    return out.detach(), [t.grad for t in leaves]


def test_env_knob(monkeypatch):
    monkeypatch.delenv(fe.ENV, raising=False)
    assert fe.fused_elementwise_enabled(on_gpu=True) and not fe.fused_elementwise_enabled(on_gpu=False)
    monkeypatch.setenv(fe.ENV, "0")
    assert not fe.fused_elementwise_enabled(on_gpu=True)
    monkeypatch.setenv(fe.ENV, "1")
    assert fe.fused_elementwise_enabled(on_gpu=False)
    monkeypatch.setenv(fe.ENV, "yes")
    with pytest.raises(MegatronConfigError, match="RLJOB_FUSED_ELEMENTWISE='yes'"):
        fe.fused_elementwise_enabled(on_gpu=True)


def test_model_config_wiring(monkeypatch):
    """On: megatron's SwiGLU and RoPE fusion flags and FusedRMSNorm in every norm slot (q/k norms
    and the final norm too); off (the CPU default): the spec megatron builds without them."""
    from rljob_worker.megatron.model_config import megatron_config_from_hf

    monkeypatch.delenv(fe.ENV, raising=False)
    off = megatron_config_from_hf(H.tiny_hf_config("qwen3"), on_gpu=False)
    on = megatron_config_from_hf(H.tiny_hf_config("qwen3"), on_gpu=False, fused_elementwise=True)
    assert not off.fused_elementwise and not off.transformer_config.bias_activation_fusion
    assert not off.transformer_config.apply_rope_fusion and off.final_layernorm is None
    assert on.fused_elementwise and on.transformer_config.bias_activation_fusion
    assert on.transformer_config.apply_rope_fusion and on.final_layernorm is fe.FusedRMSNorm
    sub = on.layer_spec.submodules
    attn = sub.self_attention.submodules
    assert sub.input_layernorm is sub.pre_mlp_layernorm is attn.q_layernorm is attn.k_layernorm is fe.FusedRMSNorm
    # an explicit override wins over the default
    kept = megatron_config_from_hf(H.tiny_hf_config("qwen2"), on_gpu=False, fused_elementwise=True,
                                   overrides={"bias_activation_fusion": False})
    assert not kept.transformer_config.bias_activation_fusion and kept.transformer_config.apply_rope_fusion


def test_rms_norm_fused_equals_eager(compiled):
    # the tiny qwen3's widths (hidden 64, head_dim 32), so the engine test below reuses these graphs
    g = torch.Generator().manual_seed(0)
    graphs = {}
    for shape in [(7, 3, 64), (11, 2, 64), (5, 3, 4, 32)]:  # a new length; q/k-norm shape (s, b, heads, d)
        h = shape[-1]
        weight = torch.randn(h, generator=g)
        x = torch.randn(*shape, generator=g)
        if len(shape) == 4:  # q/k norms see a strided view of the fused qkv projection
            x = torch.randn(*shape[:3], 2 * h, generator=g)[..., :h]
        up = torch.randn(shape, generator=g)
        eager_out, eager_grads = _values_and_grads(lambda a, w: F.rms_norm(a, a.shape[-1:], w, 1e-6), x, weight,
                                                   upstream=up)
        fused_out, fused_grads = _values_and_grads(lambda a, w: fe.fused_rms_norm(a, w, 1e-6), x, weight, upstream=up)
        _close(fused_out, eager_out, f"rms_norm {shape} value")
        for name, a, b in zip(("x", "weight"), fused_grads, eager_grads):
            _close(a, b, f"rms_norm {shape} grad {name}")
        graphs[shape] = _graphs()
    assert graphs[(11, 2, 64)] == graphs[(7, 3, 64)], "a new micro-batch length recompiled the norm"


def test_fused_rms_norm_module_is_torch_rmsnorm(compiled):
    """The module: the same parameter as torch.nn.RMSNorm, fused and eager agree, and the switch works."""
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    norm = fe.FusedRMSNorm(cfg, 64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    ref = torch.nn.RMSNorm(64, eps=1e-6)
    ref.load_state_dict(norm.state_dict())
    x = torch.randn(6, 2, 64, requires_grad=True)  # the kind of call the test above compiled
    _close(norm(x), ref(x), "FusedRMSNorm")
    norm.fused = False
    _close(norm(x), ref(x), "FusedRMSNorm (eager)")


def test_rope_fused_equals_megatron(compiled):
    """megatron's apply_rotary_pos_emb with apply_rope_fusion (the compiled kernel) against its
    unfused path, and the unfused path against the rotation written out by hand."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import TransformerConfig

    fe.install_rope_fusion()
    base = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4}
    fused_cfg = TransformerConfig(**base, apply_rope_fusion=True)
    eager_cfg = TransformerConfig(**base)
    g = torch.Generator().manual_seed(1)
    cp_group = object()  # only read by the THD (packed-sequence) path, which is not used
    graphs = []
    for s, b, heads in [(9, 2, 4), (13, 3, 2), (5, 2, 4)]:  # new lengths, rows and head counts
        d = 32  # the tiny qwen3's head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(s).float(), inv)  # (s, d/2)
        freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's (s, 1, 1, d) layout
        t = torch.randn(s, b, heads, d, generator=g)
        up = torch.randn(s, b, heads, d, generator=g)
        def run(cfg, freqs=freqs):
            return lambda x: apply_rotary_pos_emb(x, freqs, config=cfg, cp_group=cp_group)

        eager_out, (eager_grad,) = _values_and_grads(run(eager_cfg), t, upstream=up)
        fused_out, (fused_grad,) = _values_and_grads(run(fused_cfg), t, upstream=up)
        _close(fused_out, eager_out, f"rope {(s, b, heads)} value")
        _close(fused_grad, eager_grad, f"rope {(s, b, heads)} grad")
        # by hand: pairs (x_i, x_{i+d/2}) rotate by position * inv_freq_i
        x1, x2 = t[..., : d // 2], t[..., d // 2 :]
        cos, sin = angles.cos()[:, None, None, :], angles.sin()[:, None, None, :]
        _close(eager_out, torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1), "rope by hand")
        graphs.append(_graphs())
    assert graphs[0] == graphs[-1], f"new shapes recompiled the RoPE kernel: {graphs}"


def test_swiglu_fused_equals_eager(compiled):
    """megatron's bias_activation_fusion SwiGLU (compiled forward and hand-written compiled backward)
    against the local MLP's silu(gate) * up."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    g = torch.Generator().manual_seed(2)
    for shape in [(7, 3, 256), (10, 2, 256)]:  # (s, b, 2 * ffn / tp): gate half, up half (tiny: ffn 128)
        y = torch.randn(*shape, generator=g) * 3
        up = torch.randn(*shape[:2], shape[2] // 2, generator=g)

        def eager(x):
            gate, lin = torch.chunk(x, 2, dim=-1)
            return F.silu(gate) * lin

        eager_out, (eager_grad,) = _values_and_grads(eager, y, upstream=up)
        fused_out, (fused_grad,) = _values_and_grads(lambda x: bias_swiglu_impl(x, None), y, upstream=up)
        _close(fused_out, eager_out, f"swiglu {shape} value")
        _close(fused_grad, eager_grad, f"swiglu {shape} grad")


def _actor_run(hf_dir, fused: bool) -> dict:
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    actor = MegatronActor.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=1e-3), seed=1, fused_elementwise=fused)
    norms = [m for m in actor.core.modules() if isinstance(m, fe.FusedRMSNorm)]
    ids, mask = H.varied_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    before = actor.compute_logprobs(batch, micro_batch_size=3, with_entropy=True)
    grads, step = {}, actor._cpu_step

    def snapshot_then_step(lr):
        grads.update({n: p.grad.clone() for n, p in actor.core.named_parameters() if p.grad is not None})
        return step(lr)

    actor._cpu_step = snapshot_then_step
    metrics = actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True)
    after = actor.compute_logprobs(batch, micro_batch_size=4, with_entropy=True)
    return {"before": before, "after": after, "metrics": metrics, "grads": grads, "norms": len(norms),
            "config": actor.mcfg.transformer_config}


@cpu_only
def test_engine_fused_equals_unfused(compiled, tmp_path, monkeypatch):
    """A tiny qwen3 (q/k norms, untied output layer) through the engine: log-probs, entropy, loss,
    grad norm and every parameter gradient equal with the fusions on and off, and again after an
    update; the fused run went through the compiled functions."""
    hf_dir = H.make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=3)
    calls = {"rms": 0, "rope": 0, "swiglu": 0}
    real_rms, real_rope = fe.fused_rms_norm, fe.fused_apply_rotary_pos_emb
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import mlp

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(fe, "fused_rms_norm", count("rms", real_rms))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", count("rope", real_rope))
    monkeypatch.setattr(mlp, "bias_swiglu_impl", count("swiglu", fused_bias_swiglu.bias_swiglu_impl))
    unfused = _actor_run(hf_dir, False)
    assert calls == {"rms": 0, "rope": 0, "swiglu": 0} and unfused["norms"] == 0
    fused = _actor_run(hf_dir, True)
    assert fused["norms"] == 2 * 4 + 1  # 2 layers x (input, pre-MLP, q, k) + the final norm
    assert all(v > 0 for v in calls.values()), calls
    # the whole model: the fused kernels reorder sums along the decoder's chain (tolerances.py)
    ids, mask = H.varied_batch()
    config, seq, z = T.hf_config(hf_dir), ids.shape[1], H.max_abs_logit(hf_dir, ids, mask)
    n = int((mask.bool() & (mask.cumsum(1) > 1)).sum())
    lp_tol = T.logprob_bound(config, z, seq_len=seq)
    ent_tol = T.entropy_bound(config, z, seq_len=seq)
    grad_tol = T.grad_bound(config, n, z, seq_len=seq)
    # after: one Adam step from gradients within grad_tol; taken as unchanged by it (a component within
    # grad_tol of zero could flip its sign-normalised step: not a rounding bound, an assumption)
    for when in ("before", "after"):
        for key, tol in (("logprobs", lp_tol), ("entropy", ent_tol)):
            diff = (fused[when][key] - unfused[when][key]).abs().max().item()
            assert diff <= tol, f"{when} {key}: max |diff| {diff:.3g} > {tol:.3g}"
    log_v = torch.log(torch.tensor(float(config["vocab_size"]))).item()
    for key, tol in (("nll", T.mean_bound(lp_tol, n, z + log_v)), ("entropy", T.mean_bound(ent_tol, n, log_v)),
                     ("loss", T.mean_bound(lp_tol, n, z + log_v)), ("grad_norm", None)):
        if tol is None:
            assert fused["metrics"][key] == pytest.approx(unfused["metrics"][key], rel=grad_tol), key
        else:
            assert fused["metrics"][key] == pytest.approx(unfused["metrics"][key], abs=tol), key
    assert fused["grads"].keys() == unfused["grads"].keys() and len(fused["grads"]) > 10
    for name, grad in unfused["grads"].items():  # each tensor within grad_tol of its own size
        diff = (fused["grads"][name] - grad).abs().max().item()
        assert diff <= grad_tol * grad.abs().max().item(), f"grad {name}: {diff:.3g}"
    assert (fused["after"]["logprobs"] - fused["before"]["logprobs"]).abs().max() > 1e-4


def _rope_with(fn, freqs, t):
    return fn(t, freqs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_on_gpu(dtype):
    """The Triton kernels against the eager ops on a GPU (fp32: 1e-5; bf16: a bf16 rounding step),
    over six micro-batch lengths, compiling nothing new after the third."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    # the longest sum: the weight gradient over s * b <= 6144 tokens, plus the norm's 896; bf16 adds one
    # rounding of each output (1 ulp = eps between two kernels' results)
    tol = T.reorder_bound(896 + 6144 + 8, 1.0) + (0.0 if dtype == torch.float32 else torch.finfo(dtype).eps)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weight = torch.randn(896, generator=g, device=dev, dtype=dtype)
    inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=dev).float() / 64))
    seen = []
    for s, b in [(1024, 4), (1536, 2), (2048, 3), (768, 5), (1792, 2), (1280, 3)]:
        x = torch.randn(s, b, 896, generator=g, device=dev, dtype=dtype)
        up = torch.randn_like(x)
        e_out, e_grads = _values_and_grads(lambda a, w: F.rms_norm(a, (896,), w, 1e-6), x, weight, upstream=up)
        f_out, f_grads = _values_and_grads(lambda a, w: fe.fused_rms_norm(a, w, 1e-6), x, weight, upstream=up)
        for a, c, what in [(f_out, e_out, "value"), *zip(f_grads, e_grads, ("grad x", "grad weight"))]:
            diff = ((a.float() - c.float()).abs().max() / c.float().abs().max().clamp(min=1)).item()
            assert diff <= tol, f"rms_norm {dtype} {what}: {diff:.3g}"
        angles = torch.outer(torch.arange(s, device=dev).float(), inv)
        freqs = torch.cat([angles, angles], -1)[:, None, None, :]
        t = torch.randn(s, b, 14, 64, generator=g, device=dev, dtype=dtype)
        up = torch.randn_like(t)
        e_out, (e_grad,) = _values_and_grads(functools.partial(_rope_with, _apply_rotary_pos_emb_bshd, freqs), t,
                                             upstream=up)
        f_out, (f_grad,) = _values_and_grads(functools.partial(_rope_with, fe.fused_apply_rotary_pos_emb, freqs), t,
                                             upstream=up)
        for a, c, what in [(f_out, e_out, "value"), (f_grad, e_grad, "grad")]:
            diff = ((a.float() - c.float()).abs().max() / c.float().abs().max().clamp(min=1)).item()
            assert diff <= tol, f"rope {dtype} {what}: {diff:.3g}"
        y = torch.randn(s, b, 2 * 4864, generator=g, device=dev, dtype=dtype)
        up = torch.randn(s, b, 4864, generator=g, device=dev, dtype=dtype)
        e_out, (e_grad,) = _values_and_grads(lambda a: F.silu(a.chunk(2, -1)[0]) * a.chunk(2, -1)[1], y, upstream=up)
        f_out, (f_grad,) = _values_and_grads(lambda a: bias_swiglu_impl(a, None), y, upstream=up)
        for a, c, what in [(f_out, e_out, "value"), (f_grad, e_grad, "grad")]:
            diff = ((a.float() - c.float()).abs().max() / c.float().abs().max().clamp(min=1)).item()
            assert diff <= tol, f"swiglu {dtype} {what}: {diff:.3g}"
        seen.append(_graphs())
    # megatron's SwiGLU compiles static first and dynamic on the second length; the H100 showed one more
    # graph at the third (graphs 4, 6, 7 in fp32). Bounded: nothing new over the last three lengths.
    print(f"graphs after each length ({dtype}): {seen}")
    assert seen[-1] == seen[2], f"new lengths kept compiling: graphs {seen}"
