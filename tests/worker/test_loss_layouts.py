"""The loss the spec names at every batch layout (issue #18): one optimizer step on one mini-batch gives
the same gradient (within the fp32 reordering bound tolerances.grad_bound, CPU) at micro-batch 1, 2, 4 and 8, DP1 vs DP2 (two gloo
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
import tolerances as T
from loss_layouts import RESPONSE_LENGTHS, mini_batch
from megatron_helpers import free_port, make_tiny_hf_model, max_abs_logit

SCRIPT = Path(__file__).with_name("loss_layouts.py")


def bounds(hf_dir: Path) -> tuple[float, float]:
    """(relative gradient bound, absolute loss bound): layouts re-bracket the sums over the mini-batch's
    tokens and the all-reduces (tolerances.grad_bound). The loss at ratio 1 is -A + 0.1 k3(shift) -
    0.01 H per token: only the entropy depends on the model's rounding (entropy_bound); the mean sums
    terms of at most max|A| + 0.1 max k3 + 0.01 log V. A wrong normaliser moves either by a factor."""
    batch, config = mini_batch(), T.hf_config(hf_dir)
    ids, mask, seq, n = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1], sum(RESPONSE_LENGTHS)
    z = max_abs_logit(hf_dir, ids, mask)
    r = -batch["ref_shift"]
    k3 = (r.exp() - r - 1).abs().max().item()
    log_v = torch.log(torch.tensor(float(config["vocab_size"]))).item()
    magnitude = batch["advantages"].abs().max().item() + 0.1 * k3 + 0.01 * log_v
    loss = T.mean_bound(0.01 * T.entropy_bound(config, z, seq_len=seq), n, magnitude)
    return T.grad_bound(config, n, z, seq_len=seq), loss


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
    results["bounds"] = bounds(hf_dir)
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
    grad_tol, loss_tol = layouts["bounds"]
    bad = {k: v for k, v in errors.items() if v > grad_tol}
    assert not bad, (grad_tol, bad)
    for layout, mbs in CASES:  # the reported loss is the mini-batch loss too
        assert layouts[layout][(mode, mbs)]["loss"] == pytest.approx(reference["loss"], abs=loss_tol)
