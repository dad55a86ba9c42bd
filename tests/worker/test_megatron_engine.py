"""The megatron engine with a head of its own (what a critic or reward model builds on), on CPU at TP=1:
the head sees the decoder's hidden state after the final norm and the output layer, and a loss on a
head that reads the hidden state trains the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron.engine import HeadInput, MegatronEngine
from rljob_worker.megatron.engine_config import OptimConfig, ParallelConfig

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) path; the GPU path is tested in test_megatron_gpu.py"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return H.make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("hf") / "qwen2", seed=3)


def test_head_sees_final_norm_hidden_state_and_output_layer(hf_dir):
    engine = MegatronEngine.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-3), seed=1)
    ids, mask = H.sample_batch()
    ids, mask = ids[:, :8], torch.ones(4, 8, dtype=torch.long)  # no padding: packed = original columns

    def head(x: HeadInput):
        logits_again = x.output_layer(x.hidden)
        return x.hidden, x.output, logits_again

    results = engine.forward({"input_ids": ids, "attention_mask": mask}, micro_batch_size=3, head=head,
                             needs_hidden=True)
    assert len(results) == 2  # micro-batches of 3 and 1 rows
    hidden = torch.cat([r[0] for r in results])
    logits = torch.cat([r[1] for r in results])
    again = torch.cat([r[2] for r in results])
    hf = H.load_hf_model(hf_dir)
    with torch.no_grad():
        ref_hidden = hf.model(input_ids=ids, attention_mask=mask).last_hidden_state  # after the final norm
        ref_logits = hf(input_ids=ids, attention_mask=mask).logits
    assert hidden.shape == (4, 8, hf.config.hidden_size)
    # megatron against HF: the decoder's reordering bounds, the hidden state's chain stopping before
    # the LM head (its hidden-length sum) and the vocabulary; the recomputed logits: that one sum
    config = T.hf_config(hf_dir)
    hidden_chain = T.decoder_chain(config, ids.shape[1]) - config["hidden_size"] - config["vocab_size"]
    torch.testing.assert_close(hidden, ref_hidden, rtol=0,
                               atol=T.reorder_bound(hidden_chain, float(ref_hidden.abs().max())))
    torch.testing.assert_close(logits, ref_logits, rtol=0,
                               atol=T.logit_bound(config, ids.shape[1]) * float(ref_logits.abs().max()))
    head_terms = float((hidden.abs() @ hf.lm_head.weight.detach().abs().T).max())  # sum_i |h_i| |W_vi|
    torch.testing.assert_close(again.float(), logits, rtol=0,
                               atol=T.reorder_bound(config["hidden_size"], head_terms))
    # without asking, no hook runs and no hidden state is kept
    plain = engine.forward({"input_ids": ids, "attention_mask": mask}, micro_batch_size=4, head=lambda x: x.hidden)
    assert plain == [None]


def test_a_value_head_on_the_hidden_state_trains(hf_dir):
    """A critic-like head: a scalar per token from the hidden state, regressed onto a target."""
    engine = MegatronEngine.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-2), seed=1)
    ids, mask = H.sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask, "target": torch.full((4,), 3.0)}

    def value_head(x: HeadInput) -> torch.Tensor:  # (b,) mean hidden feature over each row's real tokens
        real = torch.arange(x.hidden.shape[1])[None, :] < x.packed.lengths[:, None]
        return (x.hidden.mean(-1) * real).sum(-1) / real.sum(-1)

    def loss_fn(values: torch.Tensor, mb: dict):
        return ((values - mb["target"]) ** 2).mean(), {"value_mean": float(values.mean())}

    before = [p.detach().clone() for p in engine.core.parameters()]
    first = engine.train_step(batch, micro_batch_size=2, head=value_head, loss_fn=loss_fn, needs_hidden=True)
    for _ in range(5):
        last = engine.train_step(batch, micro_batch_size=2, head=value_head, loss_fn=loss_fn, needs_hidden=True)
    assert first["grad_norm"] > 0 and engine.step == 6
    assert last["loss"] < first["loss"]
    assert any(not torch.equal(b, p) for b, p in zip(before, engine.core.parameters()))
