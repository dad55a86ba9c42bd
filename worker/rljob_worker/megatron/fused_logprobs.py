"""Per-token log-probs and entropy straight from the last hidden state and the output layer, in
chunks of tokens, never holding fp32 logits for the whole micro-batch.

The unfused head computes ``logits = hidden @ W.T`` for every token of a micro-batch (bf16, then an
fp32 copy: 6 bytes x tokens x vocab, 16k tokens x 151,936 words = 15 GB before the backward's copies),
then log-softmax, gather and entropy over them. Here a chunk of ``chunk_tokens`` rows at a time is
projected, reduced to three numbers per token and dropped; the backward recomputes each chunk's
logits from the saved hidden state and weight (one extra GEMM per chunk, the price of the memory).

Vocab parallelism (megatron's ``ColumnParallelLinear`` output layer): each TP rank holds rows
``[vocab_start, vocab_start + V_local)`` of the (padded) output weight. Per chunk the max is
all-reduced (MAX) and the sum of exps, the exp-weighted logit sum and the target logit are
all-reduced (SUM, one call) over ``tp_group``; columns at or past ``vocab_size`` (megatron's vocab
padding) are masked out. The backward needs no collective for the logits (it saves the global
log-sum-exp and entropy) and all-reduces the hidden state's gradient over ``tp_group`` (what
megatron's ``copy_to_tensor_model_parallel_region`` does before the output layer).

Pure torch: runs on CPU (tests) and GPU alike; on a GPU the per-chunk reductions are
``torch.compile``d by default (one fused pass over the chunk's logits instead of ~8 eager passes;
RLJOB_FUSED_LOGPROBS_COMPILE=0 turns it off). Math, per token with logits ``z`` over the whole
vocab, target ``y``, ``p = softmax(z)``:
  logprob = z_y - lse(z);  entropy H = lse(z) - sum_j p_j z_j
  d logprob / d z_j = [j = y] - p_j;  d H / d z_j = -p_j (log p_j + H)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_PAD_LOGIT = -1e30  # padded vocab entries: exp() is exactly 0 and 0 * _PAD_LOGIT is finite
DEFAULT_CHUNK_ELEMENTS = 2**28  # fp32 logits per chunk (1 GiB): chunk_tokens = this // local vocab


def default_chunk_tokens(local_vocab: int) -> int:
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, local_vocab))


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
    compiled: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and entropy of softmax(hidden @ W_full.T) over the real vocab.

    hidden:  (N, H) any float dtype; cast to ``weight.dtype`` for the matmul (as the output layer does)
    weight:  (V_local, H) this TP rank's rows of the output weight, global rows
             ``[vocab_start, vocab_start + V_local)``; rows ``>= vocab_size`` are padding
    targets: (N,) long, global vocab ids in ``[0, vocab_size)``
    returns: logprobs (N,) fp32, entropy (N,) fp32 or None

    Differentiable w.r.t. ``hidden`` (gradient all-reduced over ``tp_group``: every rank gets the
    full gradient) and ``weight`` (this rank's rows). Every rank of ``tp_group`` must call it with
    the same ``hidden`` and ``targets``. ``compiled``: run the per-chunk reductions ``torch.compile``d
    (default: :func:`compile_by_default`).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, H) and weight (V_local, H) expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be (N,) = ({hidden.shape[0]},), got {tuple(targets.shape)}")
    vocab_size = vocab_start + weight.shape[0] if vocab_size is None else vocab_size
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    if compiled is None:
        compiled = compile_by_default(hidden.device)
    lp, ent = _FusedLogprobsEntropy.apply(
        hidden, weight, targets, vocab_size, vocab_start, tp_group, with_entropy, chunk, compiled
    )
    return lp, (ent if with_entropy else None)


def _masked(raw: torch.Tensor, pad_from: int) -> torch.Tensor:
    """fp32 copy of a chunk's logits ``(c, V_local)`` with the padded vocab columns at _PAD_LOGIT."""
    z = raw.float()
    if pad_from < z.shape[1]:
        cols = torch.arange(z.shape[1], device=z.device)
        z = torch.where(cols < pad_from, z, _PAD_LOGIT)
    return z


def _chunk_max(raw: torch.Tensor, pad_from: int) -> torch.Tensor:
    """(c,) local max of the real columns."""
    return _masked(raw, pad_from).amax(dim=-1)


def _chunk_sums(raw, m, local_t, mine, pad_from: int, with_entropy: bool) -> torch.Tensor:
    """(3, c): local sum exp(z - m), target logit (0 off this shard), sum exp(z - m) (z - m)."""
    z = _masked(raw, pad_from) - m[:, None]
    e = torch.exp(z)
    target = raw.gather(1, local_t[:, None])[:, 0].float() * mine
    ez = (e * z).sum(-1) if with_entropy else torch.zeros_like(target)  # padding: 0 * -1e30 = 0
    return torch.stack([e.sum(-1), target, ez])


def _chunk_grad(raw, lse, ent, g_lp, g_ent, local_t, mine, pad_from: int, with_entropy: bool) -> torch.Tensor:
    """(c, V_local) d(sum g_lp * logprob + g_ent * entropy) / d logits, in ``raw``'s dtype."""
    logp = _masked(raw, pad_from) - lse[:, None]
    p = torch.exp(logp)
    if with_entropy:  # p * logp before scaling: padded columns give 0 * -1e30 = 0, never 0 * inf
        g = -(p * (g_lp + g_ent * ent)[:, None] + g_ent[:, None] * (p * logp))
    else:
        g = -p * g_lp[:, None]
    cols = torch.arange(raw.shape[1], device=raw.device)
    g = g + torch.where((cols[None, :] == local_t[:, None]) & mine[:, None], g_lp[:, None], 0.0)
    return g.to(raw.dtype)


_COMPILED: dict[str, object] = {}


def _kernels(compiled: bool):
    """The three per-chunk functions, eager or ``torch.compile``d (one fused kernel each on a GPU)."""
    if not compiled:
        return _chunk_max, _chunk_sums, _chunk_grad
    if not _COMPILED:
        for fn in (_chunk_max, _chunk_sums, _chunk_grad):
            _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)
    return _COMPILED["_chunk_max"], _COMPILED["_chunk_sums"], _COMPILED["_chunk_grad"]


def compile_by_default(device: torch.device) -> bool:
    """Compiled chunk functions on GPUs unless RLJOB_FUSED_LOGPROBS_COMPILE=0; eager on CPU."""
    return device.type == "cuda" and os.environ.get("RLJOB_FUSED_LOGPROBS_COMPILE", "1") != "0"


def _local_targets(t: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = t - vocab_start
    mine = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), mine


class _FusedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size, vocab_start, tp_group, with_entropy, chunk, compiled):
        n, v_local = hidden.shape[0], weight.shape[0]
        pad_from = vocab_size - vocab_start  # local column where the vocab padding starts
        chunk_max, chunk_sums, _ = _kernels(compiled)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.zeros_like(lse)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            raw = hidden[s:e].to(weight.dtype) @ weight.t()  # (c, V_local), the output layer's dtype
            m = chunk_max(raw, pad_from)
            if tp_group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            local_t, mine = _local_targets(targets[s:e], vocab_start, v_local)
            sums = chunk_sums(raw, m, local_t, mine, pad_from, with_entropy)
            if tp_group is not None:
                dist.all_reduce(sums, group=tp_group)
            log_s = torch.log(sums[0])
            lse[s:e] = m + log_s
            logprobs[s:e] = sums[1] - lse[s:e]
            if with_entropy:
                entropy[s:e] = log_s - sums[2] / sums[0]
            del raw
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = (vocab_size, vocab_start, tp_group, with_entropy, chunk, compiled)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        vocab_size, vocab_start, tp_group, with_entropy, chunk, compiled = ctx.args
        n, v_local = hidden.shape[0], weight.shape[0]
        pad_from = vocab_size - vocab_start
        _, _, chunk_grad = _kernels(compiled)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator over chunks (the unfused GEMM accumulates in fp32 inside one call)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_lp = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.float()
        use_entropy = with_entropy and grad_entropy is not None
        g_ent = grad_entropy.float() if use_entropy else g_lp  # unused without entropy
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e].to(weight.dtype)
            raw = h @ weight.t()
            local_t, mine = _local_targets(targets[s:e], vocab_start, v_local)
            g = chunk_grad(raw, lse[s:e], entropy[s:e], g_lp[s:e], g_ent[s:e], local_t, mine, pad_from, use_entropy)
            del raw
            if need_h:
                grad_hidden[s:e] = (g @ weight).to(hidden.dtype)
            if need_w:
                grad_weight += (g.t() @ h).float()
            del g
        if need_h and tp_group is not None:
            dist.all_reduce(grad_hidden, group=tp_group)
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def reference_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused full-vocab reference (one process, whole weight): ``(N,)`` log-probs and entropy."""
    logits = (hidden.to(weight.dtype) @ weight.t()).float()[:, :vocab_size]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
