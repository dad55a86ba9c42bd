"""Where a process's first torch.compile spends its one-time set-up (issue 35: ~3 s of a restored pod's first step).

Each mode is a fresh process sharing one warm inductor cache (a priming process fills it first), as a restored pod:
- ``plain``: import torch, then compile and call two small CUDA functions (the first pays the set-up);
- ``preimport``: the same after importing the compiler's modules (dynamo, inductor, aot_autograd, triton), timed
  on their own: how much of the set-up is imports that could be paid elsewhere;
- ``profiled``: ``preimport`` with cProfile around the first compile: the top functions by own time.

    python3 bench/first_compile_probe.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
out = {"import_torch_s": time.perf_counter() - t0}
mode = sys.argv[1]
if mode in ("preimport", "profiled"):
    t = time.perf_counter()
    import torch._dynamo, torch._inductor.compile_fx, torch._inductor.codecache, torch._inductor.lowering
    import torch._functorch.aot_autograd, triton, triton.compiler
    out["preimport_s"] = time.perf_counter() - t
x = torch.randn(4096, device="cuda")
torch.cuda.synchronize()

def first(v):
    return torch.sin(v) * 2 + 1

def second(v):
    return torch.cos(v) * 3 - 1

prof = None
if mode == "profiled":
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t = time.perf_counter()
torch.compile(first, fullgraph=True)(x)
torch.cuda.synchronize()
out["first_compile_s"] = time.perf_counter() - t
if prof is not None:
    prof.disable()
    import pstats, io
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    out["profile"] = s.getvalue()[-6000:]
t = time.perf_counter()
torch.compile(second, fullgraph=True)(x)
torch.cuda.synchronize()
out["second_compile_s"] = time.perf_counter() - t
print("RESULT " + json.dumps(out))
"""


def run(mode: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{mode} failed: {proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="first-compile-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    run("plain", env)  # primes the caches: every later process finds its kernels there
    from results import record

    shape = "one CUDA elementwise function, fresh process, warm inductor and Triton caches"
    for _ in range(args.rounds):
        plain, pre = run("plain", env), run("preimport", env)
        for mode, got in (("plain", plain), ("preimport", pre)):
            print(mode, {k: round(v, 3) for k, v in got.items()}, flush=True)
        record("first_compile", shape, "first compile after the compiler's imports", pre["first_compile_s"], "s",
               baseline="first compile, imports inside it", baseline_value=plain["first_compile_s"])
        record("first_compile", shape, "the compiler's imports alone", pre["preimport_s"], "s")
        record("first_compile", shape, "second compile in the process", plain["second_compile_s"], "s",
               baseline="first compile, imports inside it", baseline_value=plain["first_compile_s"])
    got = run("profiled", env)
    print(got.pop("profile"))
    print("profiled", {k: round(v, 3) for k, v in got.items()}, flush=True)


if __name__ == "__main__":
    main()
