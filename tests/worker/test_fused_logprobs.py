"""Fused (chunked) log-probs and entropy against the unfused full-vocab computation: values and
gradients in fp32 at TP1 and TP2 (two gloo processes, each holding half of a padded vocab), and the
same against megatron's own vocab-parallel cross entropy (the actor's unfused path).

Run as a script under torchrun (``python -m torch.distributed.run --nproc-per-node 2
tests/worker/test_fused_logprobs.py OUT_DIR``) it plays the TP2 scenario."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worker"))
sys.path.insert(0, str(Path(__file__).parent))
from rljob_worker.megatron.fused_logprobs import (
    default_chunk_tokens,
    fused_logprobs_entropy,
    reference_logprobs_entropy,
)

HIDDEN, VOCAB, PADDED = 24, 50, 56  # 6 padded rows: TP2 shards of 28, the second holds 22 real + 6 pad
N_TOKENS = 37


def _case(n: int = N_TOKENS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g)
    weight = torch.randn(PADDED, HIDDEN, generator=g) * 0.5
    weight[VOCAB:] = 10.0  # large padded rows: any leak into the softmax would show
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    targets[:3] = torch.tensor([0, VOCAB - 1, PADDED // 2])  # edges: first, last real id, first id of shard 2
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, weight, targets, g_lp, g_ent


def _tolerance() -> float:
    """fp32 reordering bound (tolerances.reorder_bound): a value passes through the logit's dot product
    (HIDDEN terms), the softmax's sum over the padded vocabulary (PADDED) and, for the weight's gradient,
    the sum over tokens (N_TOKENS); the magnitude is the largest sum of |h_i| |w_ji| over the real rows
    plus log(VOCAB) (log-sum-exp)."""
    from tolerances import reorder_bound

    hidden, weight, *_ = _case()
    magnitude = (hidden.abs() @ weight[:VOCAB].abs().T).max().item() + math.log(VOCAB)
    return reorder_bound(HIDDEN + PADDED + N_TOKENS, magnitude)


TOL = _tolerance()


def _grads(fn, hidden, weight, g_lp, g_ent):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fn(h, w)
    loss = (lp * g_lp).sum() + (ent * g_ent).sum() if ent is not None else (lp * g_lp).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), h.grad, w.grad


def _close(a, b, what):
    assert torch.allclose(a, b, atol=TOL, rtol=TOL), f"{what}: max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_tp1_values_and_gradients_match_unfused(chunk):
    hidden, weight, targets, g_lp, g_ent = _case()
    fused = _grads(lambda h, w: fused_logprobs_entropy(h, w, targets, vocab_size=VOCAB, chunk_tokens=chunk),
                   hidden, weight, g_lp, g_ent)
    ref = _grads(lambda h, w: reference_logprobs_entropy(h, w, targets, VOCAB), hidden, weight, g_lp, g_ent)
    for name, a, b in zip(["logprobs", "entropy", "grad hidden", "grad weight"], fused, ref):
        _close(a, b, name)
    assert torch.all(fused[3][VOCAB:] == 0), "padded vocab rows must get no gradient"
    assert torch.all(fused[0] < 0) and torch.all(fused[1] > 0)


@pytest.mark.slow
def test_compiled_chunks_match_eager():
    """The torch.compile'd chunk functions (the GPU default) on CPU's inductor backend."""
    hidden, weight, targets, g_lp, g_ent = _case(seed=3)
    run = {c: _grads(lambda h, w, c=c: fused_logprobs_entropy(h, w, targets, vocab_size=VOCAB, chunk_tokens=8,
                                                              compiled=c), hidden, weight, g_lp, g_ent)
           for c in (False, True)}
    for name, a, b in zip(["logprobs", "entropy", "grad hidden", "grad weight"], run[True], run[False]):
        _close(a, b, name)


def test_without_entropy_and_logprob_only_gradient():
    hidden, weight, targets, g_lp, _ = _case(seed=1)
    fused = _grads(lambda h, w: fused_logprobs_entropy(h, w, targets, vocab_size=VOCAB, with_entropy=False,
                                                       chunk_tokens=5), hidden, weight, g_lp, None)
    assert fused[1] is None
    ref = _grads(lambda h, w: (reference_logprobs_entropy(h, w, targets, VOCAB)[0], None), hidden, weight, g_lp, None)
    for name, i in [("logprobs", 0), ("grad hidden", 2), ("grad weight", 3)]:
        _close(fused[i], ref[i], name)


def test_entropy_only_gradient():
    """A loss of the entropy alone (logprobs unused): autograd hands the backward no logprob grad."""
    hidden, weight, targets, _, g_ent = _case(seed=2)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    (fused_logprobs_entropy(h1, weight, targets, vocab_size=VOCAB, chunk_tokens=4)[1] * g_ent).sum().backward()
    (reference_logprobs_entropy(h2, weight, targets, VOCAB)[1] * g_ent).sum().backward()
    _close(h1.grad, h2.grad, "grad hidden")


def test_hand_computed_uniform_case():
    """Zero hidden state: uniform over the 50 real words (padding excluded): log p = -ln 50, H = ln 50."""
    hidden = torch.zeros(3, HIDDEN)
    weight = torch.randn(PADDED, HIDDEN)
    lp, ent = fused_logprobs_entropy(hidden, weight, torch.tensor([0, 7, 49]), vocab_size=VOCAB, chunk_tokens=2)
    expected = torch.log(torch.tensor(float(VOCAB)))
    _close(lp, -expected.expand(3), "logprobs")
    _close(ent, expected.expand(3), "entropy")


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="targets must be"):
        fused_logprobs_entropy(torch.zeros(4, HIDDEN), torch.zeros(PADDED, HIDDEN), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden"):
        fused_logprobs_entropy(torch.zeros(4, 3), torch.zeros(PADDED, HIDDEN), torch.zeros(4, dtype=torch.long))


def test_default_chunk_bounds_the_fp32_logits():
    assert default_chunk_tokens(151936) * 151936 * 4 <= 2**30
    assert default_chunk_tokens(10) > 0


def test_tp2_values_and_gradients_match_unfused(tmp_path):
    from megatron_helpers import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    hidden, weight, targets, g_lp, g_ent = _case()
    ref = _grads(lambda h, w: reference_logprobs_entropy(h, w, targets, VOCAB), hidden, weight, g_lp, g_ent)
    shard = PADDED // 2
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        rows = slice(rank * shard, (rank + 1) * shard)
        for chunk, got in out["fused"].items():
            _close(got["logprobs"], ref[0], f"rank {rank} chunk {chunk} logprobs")
            _close(got["entropy"], ref[1], f"rank {rank} chunk {chunk} entropy")
            _close(got["grad_hidden"], ref[2], f"rank {rank} chunk {chunk} grad hidden")
            _close(got["grad_weight"], ref[3][rows], f"rank {rank} chunk {chunk} grad weight shard")
        # megatron's vocab-parallel cross entropy + the actor's vocab-parallel entropy on the same shards
        meg = out["megatron"]
        _close(meg["logprobs"], ref[0], f"rank {rank} megatron logprobs")
        _close(meg["entropy"], ref[1], f"rank {rank} megatron entropy")
        _close(meg["grad_hidden"], ref[2], f"rank {rank} megatron grad hidden")
        _close(meg["grad_weight"], ref[3][rows], f"rank {rank} megatron grad weight")
    assert torch.all(torch.load(tmp_path / "rank1.pt")["fused"][8]["grad_weight"][VOCAB - shard:] == 0)


def _tp2_scenario(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hidden, weight, targets, g_lp, g_ent = _case()
    shard = PADDED // 2
    local_w = weight[rank * shard:(rank + 1) * shard]
    result = {"fused": {}}
    for chunk in (1, 8, 1000):
        lp, ent, gh, gw = _grads(
            lambda h, w, c=chunk: fused_logprobs_entropy(h, w, targets, vocab_size=VOCAB, vocab_start=rank * shard,
                                                         tp_group=dist.group.WORLD, chunk_tokens=c),
            hidden, local_w, g_lp, g_ent)
        result["fused"][chunk] = {"logprobs": lp, "entropy": ent, "grad_hidden": gh, "grad_weight": gw}

    # the actor's unfused path: megatron's vocab-parallel CE and entropy over masked vocab-parallel logits
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from rljob_worker.megatron.actor import _PAD_LOGIT, vocab_parallel_entropy
    from rljob_worker.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)

    def unfused(h, w):
        logits = tensor_parallel.copy_to_tensor_model_parallel_region(h) @ w.t()
        cols = torch.arange(shard) + rank * shard
        logits = logits.masked_fill(cols >= VOCAB, _PAD_LOGIT)
        ent = vocab_parallel_entropy(logits[None])[0]
        lp = -tensor_parallel.vocab_parallel_cross_entropy(logits[None].clone(), targets[None])[0]
        return lp, ent

    lp, ent, gh, gw = _grads(unfused, hidden, local_w, g_lp, g_ent)
    result["megatron"] = {"logprobs": lp, "entropy": ent, "grad_hidden": gh, "grad_weight": gw}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _tp2_scenario(sys.argv[1])
