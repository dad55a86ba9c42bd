"""The loss the spec names at every batch layout (issue #18): one optimizer step on one mini-batch gives
the same gradient (relative error <= 1e-5, fp32, CPU) at micro-batch 1, 2, 4 and 8, DP1 vs DP2 (two gloo
processes), PP1 vs PP2 and CP1 vs CP2, for token-mean, seq-mean-token-mean and seq-mean-token-sum-norm,
with response lengths that differ across micro-batches and ranks (tests/worker/loss_layouts.py). The
loss includes the KL-in-loss and entropy terms, normalised alike.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from megatron_helpers import free_port, make_tiny_hf_model

SCRIPT = Path(__file__).with_name("loss_layouts.py")
TOL = 1e-5


def run_layouts(hf_dir: Path, out: Path, nproc: int, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(SCRIPT), str(hf_dir), str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def relative_error(grads: dict, reference: dict) -> float:
    assert set(grads) == set(reference), sorted(set(grads) ^ set(reference))
    diff = sum(float((grads[k] - reference[k]).square().sum()) for k in reference)
    norm = sum(float(reference[k].square().sum()) for k in reference)
    return (diff / norm) ** 0.5


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss_layouts")
    hf_dir = make_tiny_hf_model("llama", root / "hf")  # untied: the PP2 stages' parameters are disjoint
    results = run_layouts(hf_dir, root / "one.pt", 1)
    results.update(run_layouts(hf_dir, root / "two.pt", 2))
    return results


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CASES = [("dp1", 1), ("dp1", 2), ("dp1", 3), ("dp1", 4), ("dp2", 1), ("dp2", 2), ("dp2", 4),
         ("pp2", 1), ("pp2", 2), ("pp2", 3), ("pp2", 4), ("cp2", 1), ("cp2", 2), ("cp2", 4)]


@pytest.mark.parametrize("mode", MODES)
def test_every_layout_gives_the_whole_mini_batch_gradient(layouts, mode):
    reference = layouts["dp1"][(mode, 8)]  # the whole mini-batch in one micro-batch on one rank
    report, errors = [], {}
    for layout, mbs in CASES:
        got = layouts[layout][(mode, mbs)]
        errors[(layout, mbs)] = relative_error(got["grads"], reference["grads"])
        report.append(f"{layout} mbs {mbs}: grad_norm {got['grad_norm']:.6f} rel.err {errors[(layout, mbs)]:.2e}")
    print(f"\n{mode}: reference grad_norm {reference['grad_norm']:.6f}\n" + "\n".join(report))
    bad = {k: v for k, v in errors.items() if v > TOL}
    assert not bad, bad
    for layout, mbs in CASES:  # the reported loss is the mini-batch loss too
        assert layouts[layout][(mode, mbs)]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
