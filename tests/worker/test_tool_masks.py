"""Tool-response tokens are context, not actions: no loss, advantage, KL, entropy or count in any normaliser.

A multi-turn row carries them with response_mask 0 (data.batching.pad_batch's loss_masks). Every check compares
the masked row with the same row whose tool tokens are deleted (a plain single-turn row of the model's tokens):
the loss, its parts and the gradients of the model's tokens must agree, and the tool tokens' inputs can be
anything."""
from __future__ import annotations

import pytest
import torch
from rljob_api.enums import AdvantageEstimator, ImportanceLevel, KLEstimator, KLPlacement, LossAggregation
from rljob_worker import algorithms as algo
from rljob_worker.algorithms import gae

# one row: 2 prompt columns, then model, model, tool, tool, tool, model, model (eos)
MASK = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1, 1]])
TOOL = (MASK == 0) & (torch.arange(9) >= 2)
KEEP = [0, 1, 2, 3, 7, 8]  # the same row with the tool tokens deleted


def config(aggregation, kl_coef=0.1, entropy_coef=0.01):
    return algo.LossConfig(clip_low=0.2, clip_high=0.2, dual_clip_c=None, kl_coef=kl_coef,
                           kl_estimator=KLEstimator.K3, kl_placement=KLPlacement.LOSS, entropy_coef=entropy_coef,
                           aggregation=aggregation, importance=ImportanceLevel.TOKEN, norm_length=16)


def loss_and_grads(logprobs, old, ref, entropy, advantages, mask, cfg):
    lp, ent = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    loss, metrics = algo.grpo_loss(lp, old, advantages, mask, cfg, ref_logprobs=ref, entropy=ent)
    loss.backward()
    return loss.detach(), metrics, lp.grad, ent.grad


def test_hand_computed_token_mean_loss_counts_model_tokens_only():
    """ratio 1, advantage 2 on the 4 model tokens, no KL or entropy: loss = -2 (mean over 4 tokens, not 7), and
    d loss / d logprob = -2 / 4 on each model token, 0 on each tool token."""
    logprobs = torch.log(torch.tensor([[0.9, 0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.6, 0.7]]))
    adv = algo.broadcast_to_tokens(torch.tensor([2.0]), MASK)
    assert adv.tolist() == [[0, 0, 2, 2, 0, 0, 0, 2, 2]]
    loss, _, grad, _ = loss_and_grads(logprobs, logprobs, logprobs, torch.ones(1, 9), adv, MASK,
                                      config(LossAggregation.TOKEN_MEAN, kl_coef=0.0, entropy_coef=0.0))
    assert float(loss) == pytest.approx(-2.0, abs=1e-6)
    assert grad[0].tolist() == pytest.approx([0, 0, -0.5, -0.5, 0, 0, 0, -0.5, -0.5], abs=1e-6)


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_loss_kl_entropy_and_grads_equal_the_row_without_tool_tokens(aggregation):
    gen = torch.Generator().manual_seed(0)
    logprobs, old, ref = (-torch.rand(1, 9, generator=gen) * 2 for _ in range(3))
    entropy = torch.rand(1, 9, generator=gen)
    adv = algo.broadcast_to_tokens(torch.tensor([0.7]), MASK)
    cfg = config(aggregation)
    loss, metrics, grad, ent_grad = loss_and_grads(logprobs, old, ref, entropy, adv, MASK, cfg)
    k = KEEP
    loss_c, metrics_c, grad_c, ent_grad_c = loss_and_grads(logprobs[:, k], old[:, k], ref[:, k], entropy[:, k],
                                                           adv[:, k], MASK[:, k], cfg)
    # float32, 4 terms: a few ulps
    assert float(loss) == pytest.approx(float(loss_c), rel=1e-6, abs=1e-7)
    for key in ("kl", "entropy", "pg_loss"):
        assert metrics[key] == pytest.approx(metrics_c[key], rel=1e-6, abs=1e-7)
    assert torch.allclose(grad[:, k], grad_c, rtol=1e-6, atol=1e-8) and (grad[TOOL] == 0).all()
    assert torch.allclose(ent_grad[:, k], ent_grad_c, rtol=1e-6, atol=1e-8) and (ent_grad[TOOL] == 0).all()
    # anything in the tool columns (log-probs, old, reference, entropy, advantages) changes nothing
    noisy = [t.masked_fill(TOOL, v) for t, v in ((logprobs, -30.0), (old, 0.0), (ref, -9.0), (entropy, 99.0), (adv, 5.0))]
    loss_n, _, grad_n, ent_grad_n = loss_and_grads(*noisy, MASK, cfg)
    assert float(loss_n) == float(loss) and torch.equal(grad_n, grad) and torch.equal(ent_grad_n, ent_grad)


def test_changing_a_tool_tokens_logit_changes_no_gradient():
    """Logits (1, 9, V) -> log-probs of the row's tokens -> GRPO loss. Rows of logits that score tool tokens get
    zero gradient, and replacing them changes no gradient anywhere."""
    vocab = 11
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (1, 9), generator=gen)
    base = torch.randn(1, 9, vocab, generator=gen)
    adv = algo.broadcast_to_tokens(torch.tensor([-1.3]), MASK)
    cfg = config(LossAggregation.SEQ_MEAN_TOKEN_MEAN)

    def grad_of(logits):
        logits = logits.clone().requires_grad_(True)
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)  # (1, 9)
        probs = torch.softmax(logits, -1)
        entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
        loss, _ = algo.grpo_loss(logp, logp.detach(), adv, MASK, cfg, ref_logprobs=logp.detach() - 0.1, entropy=entropy)
        loss.backward()
        return logits.grad

    g = grad_of(base)
    assert (g[TOOL] == 0).all() and g[MASK.bool()].abs().sum() > 0
    changed = base.clone()
    changed[TOOL] = torch.randn(int(TOOL.sum()), vocab, generator=gen) * 10
    assert torch.equal(grad_of(changed), g)


def test_outcome_advantages_normalise_by_model_tokens():
    """Every estimator's length input is the model tokens (response_mask), so a tool response changes nothing."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    masks = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 1, 0, 1]])
    for est in (AdvantageEstimator.GRPO, AdvantageEstimator.RLOO, AdvantageEstimator.REINFORCE_PLUS_PLUS):
        a, _ = algo.compute_outcome_advantages(rewards, 4, est, response_lengths=masks.sum(-1))
        b, _ = algo.compute_outcome_advantages(rewards, 4, est, response_lengths=torch.tensor([3, 1, 3, 3]))
        assert torch.equal(a, b)
        assert (algo.broadcast_to_tokens(a, masks)[masks == 0] == 0).all()


def test_gae_skips_tool_tokens_in_the_recursion():
    """PPO: the critic's values at tool positions are never read, and GAE over the masked row equals GAE over
    the row without them (the token before an observation bootstraps from the next model token)."""
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(1, 9, generator=gen)
    rewards = gae.token_level_rewards(torch.tensor([1.0]), MASK)
    adv, ret = gae.compute_gae(rewards, values, MASK, gamma=0.99, lam=0.95)
    adv_c, ret_c = gae.compute_gae(rewards[:, KEEP], values[:, KEEP], MASK[:, KEEP], gamma=0.99, lam=0.95)
    # float32 recursion over 4 steps
    assert torch.allclose(adv[:, KEEP], adv_c, atol=1e-6) and torch.allclose(ret[:, KEEP], ret_c, atol=1e-6)
    assert (adv[TOOL] == 0).all()
    adv_n, _ = gae.compute_gae(rewards, values.masked_fill(TOOL, 100.0), MASK, gamma=0.99, lam=0.95)
    assert torch.equal(adv_n, adv)
