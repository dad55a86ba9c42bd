"""What a new sequence length costs each SDPA backend: the actor update's attention (1.5B shape: 12 query
heads, 2 kv heads, head dim 128, bf16, causal, GQA) forward + backward at ``--lengths`` distinct lengths, the
first call at each length against a second call at the same length.

A backend that builds a plan per shape (cuDNN's) pays at every new length, and a GRPO step's micro-batches have
new lengths every step; one that does not (flash) pays nothing.

    python bench/sdpa_shapes.py [--rows 8 --lengths 12]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def fwd_bwd(b: int, s: int, heads: int, groups: int, d: int) -> float:
    q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--lengths", type=int, default=12)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    backends = {"default": None, "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
                "efficient": [SDPBackend.EFFICIENT_ATTENTION]}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, rows {a.rows}, 12 heads / 2 kv heads x 128")
    for name, chosen in backends.items():
        lengths = sorted({int(x) for x in torch.randint(300, 2049, (a.lengths,), generator=g)})
        try:
            with sdpa_kernel(chosen) if chosen else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
                fwd_bwd(a.rows, 512 + 7, 12, 2, 128)  # library warm-up at a length not in the list
                first = [fwd_bwd(a.rows, s, 12, 2, 128) for s in lengths]
                again = [fwd_bwd(a.rows, s, 12, 2, 128) for s in lengths]
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape says so
            print(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        extra = [f - s for f, s in zip(first, again)]
        print(f"{name}: {len(lengths)} new lengths: first call {1e3 * statistics.mean(first):.1f} ms mean, again "
              f"{1e3 * statistics.mean(again):.1f} ms; a new length costs {1e3 * statistics.mean(extra):.1f} ms "
              f"(max {1e3 * max(extra):.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
