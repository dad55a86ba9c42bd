"""The PPO critic on the megatron engine, on CPU (gloo): the value head reads the right hidden state
(HF's hidden_states[k] through the final norm), only k layers are built, it learns, its checkpoint
round-trips, TP=2 equals TP=1, and an intermediate layer with pipeline stages is refused."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron.critic import MegatronCritic, ValueHead
from rljob_worker.megatron.engine_config import OptimConfig, ParallelConfig
from rljob_worker.megatron.errors import MegatronConfigError

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU (gloo) path; the GPU path runs in the GPU tests"
)

SCENARIOS = Path(__file__).with_name("critic_scenarios.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return H.make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("hf") / "qwen2", seed=3, num_hidden_layers=3)


def expected_values(hf, head: ValueHead, ids, mask, k: int) -> torch.Tensor:
    """The critic's convention from HF: head(norm(hidden_states[k])) at the previous real token."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = hf.model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
        hidden = out.hidden_states[k]
        if k < hf.config.num_hidden_layers:  # HF's last entry is already normed
            hidden = hf.model.norm(hidden)
        per_token = (hidden @ head.weight.detach().T)[..., 0]  # (B, T): value after each token
    values = torch.zeros_like(per_token)
    for b in range(ids.shape[0]):
        real = mask[b].nonzero().flatten().tolist()
        for prev, cur in itertools.pairwise(real):
            values[b, cur] = per_token[b, prev]
    return values, out.hidden_states[k]


def _value_tol(hf_dir, critic, ids, mask, layers: int) -> float:
    """Two summation orders of the critic's value (HF against megatron, TP2, another micro-batch
    split): tolerances.value_bound of the `layers` layers, relative to the head's terms sum |w||h|."""
    hf = H.load_hf_model(hf_dir)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = hf.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                          output_hidden_states=True).hidden_states[layers]
        if layers < hf.config.num_hidden_layers:
            hidden = hf.model.norm(hidden)
        magnitude = float((hidden.abs() @ critic.core.output_layer.weight.detach().abs().T)[mask.bool()].max())
    return T.value_bound(T.hf_config(hf_dir), layers, magnitude, seq_len=ids.shape[1])


@pytest.mark.parametrize("k", [1, 2, 3, None])
def test_value_head_reads_layer_k_through_the_final_norm(hf_dir, k):
    critic = MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-3), seed=1,
                                    output_layer_index=k)
    layers = 3 if k is None else k
    assert len(critic.core.decoder.layers) == layers  # the layers above k are not built
    head = critic.core.output_layer
    assert isinstance(head, ValueHead) and tuple(head.weight.shape) == (1, 64)
    assert not any(p.shape[0] == 128 for n, p in critic.core.named_parameters() if "output_layer" in n)
    ids, mask = H.sample_batch()
    seen = []
    hook = critic.core.decoder.final_layernorm.register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    values = critic.compute_values({"input_ids": ids, "attention_mask": mask}, micro_batch_size=4)
    hook.remove()
    hf = H.load_hf_model(hf_dir)
    want, hidden_k = expected_values(hf, head, ids, mask, layers)
    torch.testing.assert_close(values, want, rtol=0, atol=_value_tol(hf_dir, critic, ids, mask, layers))
    if layers < 3:  # the final norm's input is HF's hidden_states[k] (packed: compare a row without padding)
        full = (mask[3] == 1).all()
        assert full
        # the residual stream after k layers: their chain (decoder_chain less norm, head and vocab)
        config = T.hf_config(hf_dir)
        chain = T.decoder_chain({**config, "num_hidden_layers": layers}, ids.shape[1]) - (
            2 * config["hidden_size"] + config["vocab_size"])
        atol = T.reorder_bound(chain, float(hidden_k[3].abs().max()))
        torch.testing.assert_close(seen[0].transpose(0, 1)[3], hidden_k[3], rtol=0, atol=atol)


def test_value_head_starts_small_and_the_same_for_every_layout(hf_dir):
    a = ValueHead(64, seed=7)
    b = ValueHead(64, seed=7)
    assert torch.equal(a.weight, b.weight)
    assert float(a.weight.abs().max()) < 0.1  # N(0, 1/(H+1)): values start near 0


def test_critic_regression_learns_and_checkpoint_round_trips(hf_dir, tmp_path):
    critic = MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-2), seed=1,
                                    output_layer_index=2)
    ids, mask = H.sample_batch()
    target = torch.where(mask.bool(), 2.0, 0.0)
    batch = {"input_ids": ids, "attention_mask": mask, "target": target}

    def loss_fn(values, mb):
        real = mb["attention_mask"].bool()
        err = torch.where(real, values - mb["target"], 0.0)
        return err.square().sum() / real.sum(), {}

    losses = [critic.update(batch, loss_fn, micro_batch_size=2)["loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses
    critic.save_checkpoint(tmp_path / "ckpt")
    saved = critic.compute_values(batch, micro_batch_size=4)
    critic.update(batch, loss_fn, micro_batch_size=2)
    assert not torch.equal(critic.compute_values(batch, micro_batch_size=4), saved)
    critic.load_checkpoint(tmp_path / "ckpt")
    torch.testing.assert_close(critic.compute_values(batch, micro_batch_size=4), saved, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_value_loss_is_the_mini_batch_loss_at_every_micro_batch_size(hf_dir, mode):
    """With the mini-batch's normalisers (normalise_by), micro-batches of 1, 3 and 4 rows give the same loss
    and gradient as the whole mini-batch in one piece (uneven rows: 15, 7, 11, 13 real tokens)."""
    from rljob_api.enums import LossAggregation
    from rljob_worker.algorithms.gae import value_loss

    ids, mask = H.varied_batch()
    response = mask.clone()
    response[:, :4] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": response,
             "returns": torch.linspace(-1, 1, ids.shape[1]).expand(ids.shape).contiguous() * response}

    def loss_fn(values, mb, **counts):
        return value_loss(values, torch.zeros_like(values), mb["returns"], mb["response_mask"], 0.5,
                          LossAggregation(mode), norm_length=16, **counts)

    results = {}
    for mbs in (4, 1, 3):
        critic = MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-2), seed=1)
        if mbs == 4:
            values = critic.compute_values(batch, micro_batch_size=4)
            value_tol = _value_tol(hf_dir, critic, ids, mask, 3)
        results[mbs] = critic.update(batch, loss_fn, micro_batch_size=mbs, normalise_by="response_mask")
    # micro-batches of 1 and 3 rows reorder the forward's and the token sums: the value loss within
    # squared_error_bound, the grad norm within value_grad_bound (relative); a normaliser off by the
    # micro-batch count is a factor 3-4 (and the row-weighting bug: the check below)
    n = int(response.sum())
    loss_tol = T.squared_error_bound(value_tol, float(values.abs().max()), 1.0, n)
    # one layout: the grad norm sums the same parameters' squares in the same order in every run
    grad_tol = T.value_grad_bound(T.hf_config(hf_dir), 3, n, seq_len=ids.shape[1], norm_reordered=False)
    for mbs in (1, 3):
        assert results[mbs]["loss"] == pytest.approx(results[4]["loss"], abs=loss_tol), (mbs, results)
        assert results[mbs]["grad_norm"] == pytest.approx(results[4]["grad_norm"], rel=grad_tol), (mbs, results)
    if mode == "token-mean":  # without the normalisers, micro-batch means weigh rows, not tokens: it differs
        critic = MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-2), seed=1)
        plain = critic.update(batch, loss_fn, micro_batch_size=1)
        # the row-weighting bug this test guards against lands far (10x) above the equality bound
        moved = abs(plain["grad_norm"] - results[4]["grad_norm"]) / results[4]["grad_norm"]
        assert moved > 10 * grad_tol, (moved, grad_tol)


def test_intermediate_layer_with_pipeline_stages_is_refused_naming_the_field(hf_dir):
    with pytest.raises(MegatronConfigError, match=r"spec\.critic\.outputLayerIndex.*pipelineModelParallelSize"):
        MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(pp=2), output_layer_index=2)


def test_critic_layout_errors_name_the_critic_block(hf_dir):
    with pytest.raises(MegatronConfigError, match=r"spec\.critic\.megatron\.pipelineModelParallelSize=2 does not divide"):
        MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(pp=2))  # 3 layers


def test_output_layer_index_beyond_the_model_is_refused(hf_dir):
    with pytest.raises(MegatronConfigError, match=r"spec\.critic\.outputLayerIndex=9 is outside the model's 3"):
        MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(), output_layer_index=9)


def hf_export_values(export_dir, ids, mask) -> torch.Tensor:
    """The trainer's value convention computed by transformers from an exported critic
    (AutoModelForTokenClassification): its logit after each real token is the value at the next one."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(export_dir, dtype=torch.float32).eval()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        per_token = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0]
    values = torch.zeros_like(per_token)
    for b in range(ids.shape[0]):
        real = mask[b].nonzero().flatten().tolist()
        for prev, cur in itertools.pairwise(real):
            values[b, cur] = per_token[b, prev]
    return values


def test_critic_tp2_equals_tp1(hf_dir, tmp_path):
    """Values before, two updates (losses), values after: TP=2 on two gloo processes against TP=1. The trained
    critic of each layout, exported (checkpoint.exportCritic) and loaded by transformers as a one-label token
    classifier, gives that layout's values."""
    import json

    import critic_scenarios

    tp1 = critic_scenarios.critic_steps(hf_dir, ParallelConfig(), export_dir=tmp_path / "hf-critic-tp1")
    critic_scenarios.run_torchrun("tp2", hf_dir, tmp_path)
    tp2 = torch.load(tmp_path / "tp2.pt")
    # TP splits the hidden/head sums over two ranks: the value and value-loss bounds of the 2 layers
    # critic_steps reads (varied_batch, returns in [-1, 1]); after Adam steps taken as within the
    # pre-step bounds (a gradient within rounding of zero could flip its sign-normalised step)
    ids, mask = H.varied_batch()
    critic = MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-2), seed=1,
                                    output_layer_index=2)
    value_tol = _value_tol(hf_dir, critic, ids, mask, 2)
    n = int(mask[:, 4:].sum())  # critic_steps' response: the real tokens from column 4
    loss_tol = T.squared_error_bound(value_tol, float(tp1["values"].abs().max()), 1.0, n)
    grad_tol = T.value_grad_bound(T.hf_config(hf_dir), 2, n, seq_len=ids.shape[1])
    torch.testing.assert_close(tp2["values"], tp1["values"], rtol=0, atol=value_tol)
    for a, b in zip(tp2["history"], tp1["history"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=loss_tol)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=grad_tol)
    torch.testing.assert_close(tp2["values_after"], tp1["values_after"], rtol=0, atol=value_tol)
    for layout, result in (("tp1", tp1), ("tp2", tp2)):
        export = tmp_path / f"hf-critic-{layout}"
        config = json.loads((export / "config.json").read_text())
        assert config["architectures"] == ["Qwen2ForTokenClassification"] and config["num_hidden_layers"] == 2
        # HF's attention and the head's sum against the trainer's: the same value bound as the layouts'
        torch.testing.assert_close(hf_export_values(export, ids, mask), result["values_after"], rtol=0, atol=value_tol)


def test_critic_learns_returns_that_its_prefix_determines(hf_dir):
    """The PPO critic step on rollouts of a fixed random policy that repeats its first response token:
    outcome reward = fraction of 7s in the 16 response tokens (so 1 or 0), GAE with gamma = lambda = 1
    (returns = the reward at every response token). From the second response token on, the prefix
    determines the return (only the first token's value is a guess, 1/16 of the tokens), so a critic
    that learns explains most of the variance; one that predicts the mean explains none. Explained
    variance on fresh rollouts, before and after 30 updates."""
    from rljob_api.enums import LossAggregation
    from rljob_worker.algorithms import gae

    critic = MegatronCritic.from_hf(hf_dir, parallel=ParallelConfig(), optim=OptimConfig(lr=1e-2), seed=1)

    def rollouts(seed: int, n: int = 16):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 10, (n, 20), generator=g)
        first = torch.where(torch.rand(n, generator=g) < 0.5, 7, torch.randint(0, 7, (n,), generator=g))
        ids[:, 4:] = first[:, None]
        mask = torch.ones(n, 20, dtype=torch.long)
        response = mask.clone()
        response[:, :4] = 0
        rewards = gae.token_level_rewards((ids[:, 4:] == 7).float().mean(-1), response)
        batch = {"input_ids": ids, "attention_mask": mask, "response_mask": response}
        values = critic.compute_values(batch, micro_batch_size=n)
        _, returns = gae.compute_gae(rewards, values, response, 1.0, 1.0)
        return {**batch, "old_values": values, "returns": returns}

    def loss_fn(values, mb):
        return gae.value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], 10.0,
                              LossAggregation.TOKEN_MEAN)

    def ev(batch):
        return gae.explained_variance(batch["old_values"], batch["returns"], batch["response_mask"])

    before = ev(rollouts(seed=1000))
    for step in range(30):
        critic.update(rollouts(seed=step), loss_fn, micro_batch_size=16)
    after = ev(rollouts(seed=1000))
    print(f"explained variance on fresh rollouts: {before:.2f} before, {after:.2f} after 30 critic updates")
    assert after > 0.5 and after > before + 0.4
