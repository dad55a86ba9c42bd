"""Numeric tolerances derived from the arithmetic, not from the machine a test was tuned on.

Two evaluations of the same float expression that differ only in the order of their sums (a compiled
kernel against eager, a batched matmul against a single row, another CPU's SIMD width, a TP/DP/PP/CP
layout all-reducing partial sums) differ by at most Higham's gamma_n = n * u / (1 - n * u) per sum of
n terms, relative to the sum of the terms' magnitudes (u = eps / 2 is the unit roundoff). Two such
evaluations together: n * eps. A value that passes through several sums in a chain accumulates the sum
of their lengths. These are worst-case bounds; the typical error is ~sqrt(n) * eps, so a bound that
holds here leaves room for another CPU and still sits orders of magnitude below a real bug (a wrong
normaliser, a missing term, a factor of 2).
"""
from __future__ import annotations

import math

import torch


def reorder_bound(chain_length: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Worst-case absolute difference of two summation orders over `chain_length` chained additions of
    terms whose magnitudes add up to `magnitude`, in `dtype`."""
    eps = torch.finfo(dtype).eps
    return chain_length * eps * magnitude


def decoder_chain(config: dict, seq_len: int = 0) -> int:
    """Length of the chain of sums feeding one logit of a decoder (HF config keys).

    Per layer: the input RMSNorm's mean square (hidden), the q/k/v projections (hidden), q.k (head_dim),
    the attention softmax's denominator and the weighted sum of values (seq_len each), the output
    projection (heads * head_dim), the pre-MLP RMSNorm (hidden), gate/up (hidden), down (the widest
    intermediate size). An MoE layer adds the router's logits (hidden), its softmax over the experts,
    the top-k renormalisation (k), the weighted mixture of the k experts and the shared expert (k + 1),
    and the shared expert's sigmoid gate (hidden). Qwen3's q/k RMSNorms add head_dim. Then the final
    norm (hidden), the LM head (hidden) and the log-softmax's sum over the vocabulary.
    """
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or hidden // heads
    inter = max(config.get(k) or 0 for k in ("intermediate_size", "moe_intermediate_size",
                                              "shared_expert_intermediate_size"))
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    top_k = config.get("num_experts_per_tok") or experts
    shared_gate = hidden if config.get("shared_expert_intermediate_size") else 0
    router = hidden + experts + 2 * top_k + 1 + shared_gate if experts else 0
    qk_norm = head_dim if str(config.get("model_type", "")).startswith("qwen3") else 0
    per_layer = 4 * hidden + head_dim + qk_norm + 2 * seq_len + heads * head_dim + inter + router
    return config["num_hidden_layers"] * per_layer + 2 * hidden + vocab


def logprob_bound(config: dict, max_abs_logit: float, temperature: float = 1.0,
                  dtype: torch.dtype = torch.float32, seq_len: int = 0) -> float:
    """Bound on |log p(token)| differences between two evaluations of a decoder's forward pass and
    log-softmax that differ in summation order (decoder_chain). The magnitude is that of the log-prob's
    own terms: |z| / T + log(vocab_size) (log-sum-exp lies within log V of the largest logit)."""
    magnitude = max_abs_logit / temperature + math.log(config["vocab_size"])
    return reorder_bound(decoder_chain(config, seq_len), magnitude, dtype)


def logit_bound(config: dict, seq_len: int = 0, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound (to the largest |logit|) on two evaluations of a decoder's logits: the chain up to
    the LM head, without the log-softmax's vocabulary sum."""
    return reorder_bound(decoder_chain(config, seq_len) - config["vocab_size"], 1.0, dtype)


def entropy_bound(config: dict, max_abs_logit: float, temperature: float = 1.0,
                  dtype: torch.dtype = torch.float32, seq_len: int = 0) -> float:
    """Bound on the per-token entropy H = -sum p log p when every log p is off by at most d
    (logprob_bound): dH = -sum p (1 + log p) d_i, so |dH| <= d (1 + H) <= d (1 + log V); plus the sum
    over V terms of total magnitude H <= log V."""
    log_v = math.log(config["vocab_size"])
    d = logprob_bound(config, max_abs_logit, temperature, dtype, seq_len)
    return d * (1 + log_v) + reorder_bound(config["vocab_size"], log_v, dtype)


def mean_bound(per_term: float, n_terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Bound on a mean (a token-mean loss, a masked mean metric) of n_terms values each within per_term
    of the other evaluation and at most `magnitude` in size: the values' error plus the sum's
    reordering over n_terms (micro-batch partial sums and their all-reduce are a re-bracketing of it)."""
    return per_term + reorder_bound(n_terms, magnitude, dtype)


def hf_config(hf_dir) -> dict:
    """The config.json of a saved HF model, as the dict the bounds read."""
    import json
    from pathlib import Path

    return json.loads((Path(hf_dir) / "config.json").read_text())


def n_params(config: dict) -> int:
    """Parameter count of a dense decoder (HF config keys; an upper bound for tied embeddings)."""
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    heads, kv = config.get("num_attention_heads", 1), config.get("num_key_value_heads") or config.get(
        "num_attention_heads", 1)
    head_dim = config.get("head_dim") or hidden // heads
    attn = hidden * head_dim * (2 * heads + 2 * kv) + head_dim * (heads + 2 * kv) + 2 * head_dim
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if experts:
        mlp = experts * 3 * hidden * config["moe_intermediate_size"] + hidden * experts
        mlp = max(mlp, 3 * hidden * config["intermediate_size"]) + 3 * hidden * (
            config.get("shared_expert_intermediate_size") or 0)
    else:
        mlp = 3 * hidden * config["intermediate_size"]
    return layers * (attn + mlp + 2 * hidden) + hidden + 2 * vocab * hidden


def grad_bound(config: dict, n_tokens: int, max_abs_logit: float, seq_len: int = 0,
               dtype: torch.dtype = torch.float32) -> float:
    """Relative bound on a decoder's parameter gradient (as a vector, or its norm) between two
    evaluations whose sums run in another order: a different micro-batch split, DP/PP/CP layouts
    all-reducing partial sums, a fused kernel against the unfused one.

    The loss's gradient w.r.t. a logit is p - onehot: a log-prob off by d (logprob_bound) moves p by a
    relative d. Backpropagation runs the forward chain's sums transposed (decoder_chain again), and a
    weight's gradient sums over the n_tokens tokens of the mini-batch (micro-batch accumulation and the
    DP all-reduce re-bracket that sum). The norm adds the sum of squares over every parameter: positive
    terms, relative error <= n_params * u, halved by the square root. Relative to the gradient's own
    size: assumes its large components are not the result of cancellation (a gradient is a sum of
    per-token terms of either sign; the worst case n * eps is ~sqrt(n) times the typical error, which
    covers that)."""
    eps = torch.finfo(dtype).eps
    d = logprob_bound(config, max_abs_logit, 1.0, dtype, seq_len)
    return d + (decoder_chain(config, seq_len) + n_tokens) * eps + n_params(config) * eps / 4


def binomial_bound(n: int, p: float, sigmas: float = 5.0) -> float:
    """Half-width of a k-sigma band on a frequency of n independent Bernoulli(p) draws: k sqrt(p(1-p)/n).
    At 5 sigma a correct sampler fails one run in ~1.7 million."""
    return sigmas * math.sqrt(p * (1 - p) / n)


def adam_weight_bound(grad_tol: float, lr: float, steps: int) -> float:
    """Bound on a weight after `steps` Adam steps of learning rate `lr` when the two runs' gradients
    agree within a relative grad_tol (grad_bound). Adam's step lr * m_hat / sqrt(v_hat) is homogeneous
    of degree 0 in the gradients: a relative error d in them moves m_hat and sqrt(v_hat) by d each, the
    step by <= 2 d lr. Assumes no gradient component lies within its rounding error of zero (there the
    sign-normalised step can flip by 2 lr, which no rounding bound covers)."""
    return 2 * steps * lr * grad_tol


def value_bound(config: dict, layers: int, magnitude: float, seq_len: int = 0,
                dtype: torch.dtype = torch.float32) -> float:
    """Bound on a critic's value, a head (hidden -> 1) on the final norm of the hidden state after
    `layers` decoder layers, between two summation orders: those layers' chain, the norm and the head's
    sum (decoder_chain without the LM head's vocabulary), relative to `magnitude` = max_t sum_i
    |w_i| |h_t,i| (the head's terms: a value near 0 can be a cancelling sum of large ones)."""
    return reorder_bound(decoder_chain({**config, "num_hidden_layers": layers}, seq_len) - config["vocab_size"],
                         magnitude, dtype)


def value_grad_bound(config: dict, layers: int, n_tokens: int, seq_len: int = 0,
                     dtype: torch.dtype = torch.float32, norm_reordered: bool = True) -> float:
    """Relative bound on a critic's gradient (or its norm) between two summation orders (micro-batch
    split, TP): the forward chain to the value and its transpose in backpropagation, the weight
    gradients' sum over n_tokens, and, where the two runs sum the norm's squares in another order (a TP
    layout, not a micro-batch split of the same parameters), that sum (as grad_bound). A norm moves by
    at most the relative error of its vector."""
    cfg = {**config, "num_hidden_layers": layers}
    eps = torch.finfo(dtype).eps
    chain = decoder_chain(cfg, seq_len) - config["vocab_size"]
    return (2 * chain + n_tokens) * eps + (n_params(cfg) * eps / 4 if norm_reordered else 0.0)


def squared_error_bound(value_tol: float, max_value: float, max_target: float, n_terms: int,
                        dtype: torch.dtype = torch.float32) -> float:
    """Bound on a (clipped) squared-error value loss 0.5 (v - R)^2, averaged over n_terms, when every v
    is within value_tol: each term moves by <= (|v| + |R|) value_tol (Lipschitz, clipping included),
    the terms are at most 0.5 (|v| + |R|)^2, and the average's sum reorders (mean_bound)."""
    span = max_value + max_target
    return mean_bound(span * value_tol, n_terms, 0.5 * span * span, dtype)
