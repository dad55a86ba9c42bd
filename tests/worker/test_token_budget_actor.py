"""Token-budget micro-batches in the actor update: every row trains once, and with the loss
normalised by the whole mini-batch's token count (``update(normalise_by=...)``, the global-normaliser
rule) the gradient equals the one of row micro-batches, whatever the number of micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig, valid_logprob_mask

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) path")
_IDS, _MASK = H.varied_batch()


@pytest.fixture(scope="module")
def tol(hf_dir):
    """Token-budget micro-batches put the rows in other forwards and sum the weight gradient over the
    mini-batch's tokens in another order: the decoder's gradient bound (tolerances.grad_bound),
    relative to the gradient's size; a normaliser off by the micro-batch count (2 or 3) is far above it."""
    n = int(valid_logprob_mask(_MASK).sum())
    return T.grad_bound(T.hf_config(hf_dir), n, H.max_abs_logit(hf_dir, _IDS, _MASK), seq_len=_IDS.shape[1])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return H.make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("hf") / "qwen2")


def _global_nll(seen: list):
    """-sum(log-prob) / (valid positions of the whole mini-batch, counted by the actor): each
    micro-batch's share of the mini-batch loss."""

    def loss_fn(logprobs, entropy, mb, num_tokens=None, num_sequences=None):
        seen.append(mb["row"].tolist())
        loss = -(logprobs * mb["valid"]).sum() / num_tokens
        return loss, {}

    return loss_fn


def _grads(hf_dir, **split) -> tuple[dict, list, float]:
    actor = MegatronActor.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=1e-3), seed=1)
    ids, mask = H.varied_batch()  # 15, 7, 11 and 13 real tokens
    batch = {"input_ids": ids, "attention_mask": mask, "row": torch.arange(4),
             "valid": valid_logprob_mask(mask).float()}
    grads, step = {}, actor._cpu_step

    def snapshot_then_step(lr):
        grads.update({n: p.grad.clone() for n, p in actor.core.named_parameters() if p.grad is not None})
        return step(lr)

    actor._cpu_step = snapshot_then_step
    seen: list = []
    metrics = actor.update(batch, _global_nll(seen), normalise_by="valid", **split)
    return grads, seen, metrics["grad_norm"]


def _assert_same(a, b, tol):
    assert a.keys() == b.keys() and len(a) > 10
    for name, g in a.items():  # each tensor within tol of its own size
        diff = (g - b[name]).abs().max()
        assert diff <= tol * b[name].abs().max(), f"{name}: {diff:.3g}"


def test_budget_micro_batches_cover_every_row_once_and_equal_row_micro_batches(hf_dir, tol):
    rows, seen_rows, norm_rows = _grads(hf_dir, micro_batch_size=2)
    # budget 30: longest first [15, 13] (2 x 15 = 30) and [11, 7]: two micro-batches, other rows than [0, 1], [2, 3]
    budget, seen_budget, norm_budget = _grads(hf_dir, micro_batch_size=2, max_tokens_per_micro_batch=30)
    assert seen_rows == [[0, 1], [2, 3]]
    assert seen_budget == [[0, 3], [1, 2]]
    assert norm_budget == pytest.approx(norm_rows, rel=tol)
    _assert_same(budget, rows, tol)


def test_budget_with_another_micro_batch_count_gives_the_same_gradient(hf_dir, tol):
    rows, _, norm_rows = _grads(hf_dir, micro_batch_size=2)
    # budget 26: [15] alone, [13, 11] (2 x 13 = 26), [7]: three micro-batches
    budget, seen, norm_budget = _grads(hf_dir, micro_batch_size=2, max_tokens_per_micro_batch=26)
    assert seen == [[0], [2, 3], [1]]
    assert norm_budget == pytest.approx(norm_rows, rel=tol)
    _assert_same(budget, rows, tol)
