"""Pure next-token sampling: temperature, top-k, top-p, and the log-prob of the pick."""
from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits (B, V) -> processed logits (B, V) with -inf outside top-k / the top-p nucleus. ``temperature``: a
    float, or a 0-d tensor (the static engine's CUDA graph reads it from a buffer, so no recapture per value)."""
    if isinstance(temperature, torch.Tensor):
        logits = logits.float() / temperature.clamp(min=1e-6)
    else:
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


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (argmax tokens (B,), their log-probs under the raw softmax (B,))."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    tokens = logp.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) -> (tokens (B,), logprobs (B,)). temperature 0 is greedy (log-prob of the raw softmax)."""
    if temperature == 0:
        return greedy_pick(logits)
    processed = filter_logits(logits, temperature, top_k, top_p)
    logp = torch.log_softmax(processed, dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def race_sample(logits: torch.Tensor, temperature: float | torch.Tensor, uniform: torch.Tensor, top_k: int = -1,
                top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling as a race (Gumbel-max): logits (B, V), uniform (B, V) in [0, 1) -> (tokens (B,), logprobs (B,)).
    ``argmax(logp + Gumbel noise)`` picks token i with probability softmax(filtered logits / T)_i, the
    distribution `sample_next` draws from (same temperature, top-k and top-p), but in two fused reductions once
    compiled (no materialised probabilities, no multinomial, no host sync: the static engine runs it inside its
    CUDA graph). Another random stream than `sample_next`: same distribution, other draws for the same seed.
    Filtered-out tokens have logp -inf and never win."""
    z = filter_logits(logits, temperature, top_k, top_p)
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    tokens = torch.argmax(logp - torch.log(-torch.log(uniform)), dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
