"""Pure next-token sampling: temperature, top-k, top-p, and the log-prob of the pick."""
from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits (B, V) -> processed logits (B, V) with -inf outside top-k / the top-p nucleus."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (tokens (B,), logprobs (B,)). temperature 0 is greedy (log-prob of the raw softmax)."""
    if temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    processed = filter_logits(logits, temperature, top_k, top_p)
    logp = torch.log_softmax(processed, dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def race_sample(logits: torch.Tensor, temperature: float, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature sampling as a race (Gumbel-max): logits (B, V), uniform (B, V) in [0, 1) -> (tokens (B,),
    logprobs (B,)). ``argmax(logp + Gumbel noise)`` picks token i with probability softmax(logits / T)_i, the
    distribution `sample_next` draws from without top-k / top-p, but in two fused reductions once compiled
    (no materialised probabilities, no multinomial). Another random stream than `sample_next`: same
    distribution, other draws for the same seed."""
    z = logits.float() / max(temperature, 1e-6)
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    tokens = torch.argmax(logp - torch.log(-torch.log(uniform)), dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
