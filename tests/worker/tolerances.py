"""Numeric tolerances derived from the arithmetic, not from the machine a test was tuned on.

Two evaluations of the same float expression that differ only in the order of their sums (a compiled
kernel against eager, a batched matmul against a single row, another CPU's SIMD width) differ by at
most Higham's gamma_n = n * u / (1 - n * u) per sum of n terms, relative to the sum of the terms'
magnitudes (u = eps / 2 is the unit roundoff). Two such evaluations together: n * eps. A value that
passes through several sums in a chain accumulates the sum of their lengths.
"""
from __future__ import annotations

import math

import torch


def reorder_bound(chain_length: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Worst-case absolute difference of two summation orders over `chain_length` chained additions of
    terms whose magnitudes add up to `magnitude`, in `dtype`."""
    eps = torch.finfo(dtype).eps
    return chain_length * eps * magnitude


def logprob_bound(config: dict, max_abs_logit: float, temperature: float = 1.0,
                  dtype: torch.dtype = torch.float32) -> float:
    """Bound on |log p(token)| differences between two evaluations of a decoder's forward pass and
    log-softmax that differ in summation order.

    The chain feeding one logit: per layer the q/k/v and output projections (hidden_size terms each),
    the MLP's down projection (intermediate_size terms); then the LM head (hidden_size terms) and the
    log-softmax's sum over the vocabulary. The magnitude is that of the log-prob's own terms:
    |z| / T + log(vocab_size) (log-sum-exp lies within log V of the largest logit).
    """
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    chain = config["num_hidden_layers"] * (2 * hidden + inter) + hidden + vocab
    magnitude = max_abs_logit / temperature + math.log(vocab)
    return reorder_bound(chain, magnitude, dtype)
