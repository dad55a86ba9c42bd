"""The policy head alone: per-token log-probs + entropy and their backward, fused (chunked) vs unfused.

    python bench/fused_logprobs.py [--hidden 896,1536 --tokens 8192,16384 --out DIR]

Random bf16 hidden states ``(N, H)`` and a bf16 output weight ``(151936, H)`` (Qwen2.5's vocab; H
896 = 0.5B, 1536 = 1.5B) on one GPU, TP1. A loss ``sum(g1 * logprob + g2 * entropy)`` with random
g1, g2 is back-propagated to the hidden state and the weight. Variants:
- ``unfused``: what the actor's head does today: bf16 logits ``(N, V)``, an fp32 copy, log-softmax
  gather and entropy over it, autograd backward;
- ``fused``: :func:`fused_logprobs_entropy` eager (chunked, recomputing backward);
- ``fused+compile``: the same with the per-chunk reductions ``torch.compile``d (the GPU default).
Reports the median of 5 timed runs after 2 warm-ups, the peak memory above the inputs, and the max
difference to the unfused values and gradients. Appends to results.jsonl (bench/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for sub in ("worker", "bench"):
    if str(REPO / sub) not in sys.path:
        sys.path.insert(0, str(REPO / sub))

VOCAB = 151936


def unfused(hidden, weight, targets):
    logits = (hidden @ weight.t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    m = logits.detach().amax(-1, keepdim=True)  # the actor's entropy: log S - T / S
    z = logits - m
    e = torch.exp(z)
    s = e.sum(-1)
    return logp.gather(1, targets[:, None])[:, 0], torch.log(s) - (e * z).sum(-1) / s


def run(fn, hidden, weight, targets, g1, g2, device):
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    lp, ent = fn(h, w, targets)
    ((lp * g1).sum() + (ent * g2).sum()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return lp.detach(), ent.detach(), h.grad, w.grad


def main() -> int:
    from rljob_worker.megatron.fused_logprobs import fused_logprobs_entropy

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="896,1536")
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    import results as bench_results

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = bench_results.card_name()
    variants = {
        "unfused": unfused,
        "fused": lambda h, w, t: fused_logprobs_entropy(h, w, t, compiled=False),
        "fused+compile": lambda h, w, t: fused_logprobs_entropy(h, w, t, compiled=True),
    }
    rows = []
    for hid in [int(x) for x in a.hidden.split(",")]:
        for n in [int(x) for x in a.tokens.split(",")]:
            g = torch.Generator(device="cpu").manual_seed(0)
            hidden = torch.randn(n, hid, generator=g).to(device, dtype)
            weight = (torch.randn(a.vocab, hid, generator=g) * hid**-0.5).to(device, dtype)
            targets = torch.randint(0, a.vocab, (n,), generator=g).to(device)
            g1, g2 = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
            ref = None
            for name, fn in variants.items():
                try:
                    for _ in range(2):
                        out = run(fn, hidden, weight, targets, g1, g2, device)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                        base_mem = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    times = []
                    for _ in range(a.repeats):
                        t0 = time.perf_counter()
                        out = run(fn, hidden, weight, targets, g1, g2, device)
                        times.append(time.perf_counter() - t0)
                    peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30 if device.type == "cuda" else None
                    ref = ref or out
                    diff = [float((x.float() - y.float()).abs().max()) for x, y in zip(out, ref)]
                    row = {"variant": name, "hidden": hid, "tokens": n, "ms": 1e3 * statistics.median(times),
                           "peak_gib": peak, "max_diff_lp_ent_gh_gw": diff}
                except Exception as exc:  # noqa: BLE001 - report and go on
                    row = {"variant": name, "hidden": hid, "tokens": n, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"\n## policy head (log-probs + entropy, forward + backward), vocab {a.vocab}, {dtype}, {card}")
    print("| H | tokens | variant | ms | vs unfused | peak GiB | max |diff| (lp, ent, grad h, grad W) |")
    print("|---|---|---|---|---|---|---|")
    base = {(r["hidden"], r["tokens"]): r for r in rows if r["variant"] == "unfused" and "ms" in r}
    for r in rows:
        b = base.get((r["hidden"], r["tokens"]))
        shape = f"H {r['hidden']}, {r['tokens']} tokens, vocab {a.vocab}, {str(dtype).split('.')[-1]}, TP1"
        if "error" in r:
            print(f"| {r['hidden']} | {r['tokens']} | {r['variant']} | ERROR {r['error'][:80]} | | | |")
            continue
        ratio = f"{b['ms'] / r['ms']:.2f}x" if b else "-"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"| {r['hidden']} | {r['tokens']} | {r['variant']} | {r['ms']:.1f} | {ratio} | {peak} | "
              + ", ".join(f"{d:.2g}" for d in r["max_diff_lp_ent_gh_gw"]) + " |")
        kw = {"baseline": "unfused", "baseline_value": b["ms"], "same_run": True} if b and r is not b else {}
        bench_results.record(f"policy_head {r['variant']}", shape, "fwd_bwd_ms", r["ms"], "ms", card=card, **kw)
        if r["peak_gib"] is not None:
            kw = ({"baseline": "unfused", "baseline_value": b["peak_gib"], "same_run": True}
                  if b and r is not b else {})
            bench_results.record(f"policy_head {r['variant']}", shape, "peak_memory", r["peak_gib"], "GiB",
                                 card=card, **kw)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_logprobs.json").write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
