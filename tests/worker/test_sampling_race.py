"""race_sample (Gumbel-max temperature sampling, the compiled static engine's sampler) draws from
softmax(logits / T), as sample_next does, and reports the log-prob of its pick."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from rljob_worker.rollout.sampling import race_sample

sys.path.insert(0, str(Path(__file__).parent))
from tolerances import binomial_bound


def test_race_sample_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(40_000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = race_sample(logits, 0.7, torch.rand(logits.shape, generator=gen))
    want = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    # each frequency within 5 binomial standard errors of its probability over 40k draws
    band = torch.tensor([binomial_bound(tokens.numel(), p) for p in want.double().tolist()], dtype=torch.float64)
    assert ((freq - want.double()).abs() <= band).all(), (freq, want, band)
    assert int((tokens == 4).sum()) == 0  # probability ~1e-18
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1))


def test_race_sample_is_a_pure_function_of_its_noise():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    u = torch.rand(8, 100, generator=torch.Generator().manual_seed(2))
    a, b = race_sample(logits, 1.0, u), race_sample(logits.clone(), 1.0, u.clone())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # near-zero temperature: the race is won by the argmax
    assert torch.equal(race_sample(logits, 1e-4, u)[0], logits.argmax(-1))
