"""A decoder layer's q, k and v projections as one GEMM, and the MLP's gate and up as another (static engine).

A small model's decode step is bound by kernel launches, not by bytes: at 0.5B and batch 256 each of a layer's seven
GEMMs reads a few MB of weights in 5-10 us, most of it fixed cost. Concatenating q/k/v and gate/up leaves four GEMMs
a layer (qkv, o, gate_up, down), the layout vLLM and megatron keep their weights in.

The transformers modules keep their parameters, now as row slices (views) of the fused tensor, so everything that
writes weights by name (weight sync's in-place copies) writes through to what the fused GEMM reads. The fused tensor is
a non-persistent buffer of the attention / MLP module: a graph input under torch.compile like the parameters, so one
compiled layer still serves every layer. `unfuse` drops the buffers before the model moves between devices (a moved
view becomes a tensor of its own); `fuse` again after the move.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QKV = "rljob_qkv"
GATE_UP = "rljob_gate_up"


def _fuse(module: torch.nn.Module, names: tuple[str, ...], fused: str) -> bool:
    """Concatenate the named linear layers' weights (and biases) of ``module`` into buffers ``<fused>_weight`` and
    ``<fused>_bias`` and point each layer's parameters at its rows. False (nothing changed) where they are not plain
    linear layers on one device and dtype, or only some have a bias."""
    linears = [getattr(module, n, None) for n in names]
    if not all(type(m) is torch.nn.Linear for m in linears):
        return False
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) != all(b is None for b in biases):
        return False
    weights = [m.weight for m in linears]
    if len({(w.device, w.dtype, w.shape[1]) for w in weights}) != 1:
        return False
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        start = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight.data = weight[start:start + rows]
            if bias is not None:
                m.bias.data = bias[start:start + rows]
            start += rows
    module.register_buffer(f"{fused}_weight", weight, persistent=False)
    module.register_buffer(f"{fused}_bias", bias, persistent=False)
    return True


def fuse(layers) -> int:
    """Fuse q/k/v and gate/up in each decoder layer where the modules allow it; returns how many GEMMs a decode step
    no longer launches (2 per fused attention, 1 per fused MLP)."""
    saved = 0
    for layer in layers:
        if getattr(layer.self_attn, f"{QKV}_weight", None) is None:
            saved += 2 * _fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"), QKV)
        mlp = layer.mlp
        if hasattr(mlp, "act_fn") and hasattr(mlp, "down_proj") and getattr(mlp, f"{GATE_UP}_weight", None) is None:
            saved += _fuse(mlp, ("gate_proj", "up_proj"), GATE_UP)
    return saved


def unfuse(layers) -> None:
    """Drop the fused buffers (the parameters stay views until the model moves, then own their storage)."""
    for layer in layers:
        for module, fused in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
            for part in ("weight", "bias"):
                module._buffers.pop(f"{fused}_{part}", None)


def qkv(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., hidden) -> q (..., q_out), k, v (..., kv_out): one GEMM where fused, three otherwise."""
    weight = getattr(attn, f"{QKV}_weight", None)
    if weight is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q_out, kv_out = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    return F.linear(x, weight, getattr(attn, f"{QKV}_bias")).split([q_out, kv_out, kv_out], dim=-1)


def mlp(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP down(act(gate(x)) * up(x)), gate and up as one GEMM where fused; the module's own forward
    otherwise."""
    weight = getattr(module, f"{GATE_UP}_weight", None)
    if weight is None:
        return module(x)
    sizes = [module.gate_proj.weight.shape[0], module.up_proj.weight.shape[0]]
    gate, up = F.linear(x, weight, getattr(module, f"{GATE_UP}_bias")).split(sizes, dim=-1)
    return module.down_proj(module.act_fn(gate) * up)
