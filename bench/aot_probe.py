"""Does torch's ahead-of-time precompile remove a restored pod's dynamo trace? (issue 35, warm starts)

A restored pod loads the decode step's kernels from the inductor cache but dynamo still traces the Python (3.1 s of
a 9.5 s first step at 0.5B, bench/NOTES.md). This probe compiles a decoder-layer-shaped function that takes its
module as an argument, as the static engine's by-layer compile does, with
``torch.compile(fn, fullgraph=True).aot_compile(...)``, saves it, and in fresh processes compares:

- ``aot``: ``torch.compiler.load_compiled_function`` then the first call (no dynamo trace expected);
- ``cache``: a plain ``torch.compile`` first call with the inductor cache the save left behind (today's path).

It also checks what a worker depends on: the loaded function reads the module's weights at call time (weight sync
writes them in place every step) and accepts another batch size.

    python bench/aot_probe.py            # runs save, aot, cache in turn; prints one JSON line each
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    """RMSNorm, fused q/k/v, a head-wise softmax over the row, o projection, RMSNorm, SwiGLU MLP."""

    def __init__(self, hidden: int = 896, inter: int = 4864, heads: int = 14):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.n1 = nn.Parameter(torch.ones(hidden))
        self.n2 = nn.Parameter(torch.ones(hidden))


def layer_step(layer: Layer, h: torch.Tensor, scale: float) -> torch.Tensor:
    """h (B, hidden) -> (B, hidden)."""
    x = F.rms_norm(h, (h.shape[-1],), layer.n1)
    q, k, v = layer.qkv(x).chunk(3, dim=-1)
    b = h.shape[0]
    q, k, v = (t.view(b, layer.heads, -1) for t in (q, k, v))
    attn = torch.softmax((q * k).sum(-1, keepdim=True) * scale, dim=1) * v
    h = h + layer.o(attn.reshape(b, -1))
    gate, up = layer.gate_up(F.rms_norm(h, (h.shape[-1],), layer.n2)).chunk(2, dim=-1)
    return h + layer.down(F.silu(gate) * up)


def setup(device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    layer = Layer().to(device, dtype)
    h = torch.randn(64, 896, device=device, dtype=dtype)
    return layer, h


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def child(mode: str, path: str) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer, h = setup(device, dtype)
    out: dict = {"mode": mode, "torch": torch.__version__, "device": device}
    for name in ("torch._dynamo", "torch._inductor.compile_fx"):  # a worker has these imported already
        importlib.import_module(name)  # (megatron-core imports them): time the load, not the import
    torch.set_grad_enabled(False)  # a rollout's decode runs without autograd; the guards record the grad mode
    t0 = time.perf_counter()
    if mode == "save":
        compiled = torch.compile(layer_step, fullgraph=True, dynamic=True)
        if hasattr(compiled, "aot_compile"):
            fn = compiled.aot_compile(((layer, h, 0.125), {}))
        else:  # older torch: the same entry point, called directly
            from torch._dynamo.aot_compile import aot_compile_fullgraph
            from torch._dynamo.hooks import Hooks

            backend = torch._TorchCompileInductorWrapper("default", None, True)
            fn = aot_compile_fullgraph(layer_step, ((layer, h, 0.125), {}), hooks=Hooks(), backend=backend,
                                       dynamic=True)
        out["compile_s"] = time.perf_counter() - t0
        fn.save_compiled_function(path)
    elif mode == "aot":
        with open(path, "rb") as f:
            fn = torch.compiler.load_compiled_function(f, f_globals=globals())
        out["load_s"] = time.perf_counter() - t0
    else:
        fn = torch.compile(layer_step, fullgraph=True, dynamic=True)
    t1 = time.perf_counter()
    with torch.no_grad():
        got = fn(layer, h, 0.125)
        sync(device)
        out["first_call_s"] = time.perf_counter() - t1
        out["to_first_result_s"] = time.perf_counter() - t0
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        out["matches_eager"] = bool(torch.allclose(got, layer_step(layer, h, 0.125), atol=tol, rtol=tol))
        for p in layer.parameters():  # weight sync writes in place: the function must read the new values
            p.mul_(0.5)
        out["reads_new_weights"] = bool(torch.allclose(fn(layer, h, 0.125), layer_step(layer, h, 0.125),
                                                       atol=tol, rtol=tol))
        h2 = h[:17].clone()
        try:
            out["other_batch_ok"] = bool(torch.allclose(fn(layer, h2, 0.125), layer_step(layer, h2, 0.125),
                                                        atol=tol, rtol=tol))
        except Exception as exc:  # noqa: BLE001 - a probe: report what the API does
            out["other_batch_ok"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(child(sys.argv[1], sys.argv[2])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(tmp, "triton")}
        path = os.path.join(tmp, "layer.aot")
        for mode in ("save", "aot", "cache", "aot"):
            proc = subprocess.run([sys.executable, __file__, mode, path], env=env, capture_output=True, text=True, check=False,
                                  timeout=600)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            print(lines[-1] if lines else json.dumps({"mode": mode, "rc": proc.returncode,
                                                      "stderr": proc.stderr[-1500:]}), flush=True)


if __name__ == "__main__":
    main()
