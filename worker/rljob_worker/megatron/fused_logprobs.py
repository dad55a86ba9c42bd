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

Pure torch: runs on CPU (tests) and GPU alike. Math, per token with logits ``z`` over the whole
vocab, target ``y``, ``p = softmax(z)``:
  logprob = z_y - lse(z);  entropy H = lse(z) - sum_j p_j z_j
  d logprob / d z_j = [j = y] - p_j;  d H / d z_j = -p_j (log p_j + H)
"""

from __future__ import annotations

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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and entropy of softmax(hidden @ W_full.T) over the real vocab.

    hidden:  (N, H) any float dtype; cast to ``weight.dtype`` for the matmul (as the output layer does)
    weight:  (V_local, H) this TP rank's rows of the output weight, global rows
             ``[vocab_start, vocab_start + V_local)``; rows ``>= vocab_size`` are padding
    targets: (N,) long, global vocab ids in ``[0, vocab_size)``
    returns: logprobs (N,) fp32, entropy (N,) fp32 or None

    Differentiable w.r.t. ``hidden`` (gradient all-reduced over ``tp_group``: every rank gets the
    full gradient) and ``weight`` (this rank's rows). Every rank of ``tp_group`` must call it with
    the same ``hidden`` and ``targets``.
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
    lp, ent = _FusedLogprobsEntropy.apply(
        hidden, weight, targets, vocab_size, vocab_start, tp_group, with_entropy, chunk
    )
    return lp, (ent if with_entropy else None)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, vocab_size: int, vocab_start: int) -> torch.Tensor:
    """(c, V_local) fp32 logits of one chunk, padded vocab columns at _PAD_LOGIT."""
    logits = (h.to(weight.dtype) @ weight.t()).float()
    pad_from = vocab_size - vocab_start  # local column where the padding starts
    if pad_from < logits.shape[1]:
        logits[:, max(pad_from, 0):] = _PAD_LOGIT
    return logits


def _local_targets(t: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = t - vocab_start
    mine = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), mine


class _FusedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size, vocab_start, tp_group, with_entropy, chunk):
        n, v_local = hidden.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.zeros_like(lse)
        for s in range(0, n, chunk):
            e_ = min(s + chunk, n)
            logits = _chunk_logits(hidden[s:e_], weight, vocab_size, vocab_start)
            m = logits.max(dim=-1).values
            if tp_group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            idx, mine = _local_targets(targets[s:e_], vocab_start, v_local)
            target_logit = logits.gather(1, idx[:, None])[:, 0] * mine
            logits -= m[:, None]  # z - max, in place: the chunk is not needed otherwise
            e = torch.exp(logits)
            sums = [e.sum(-1), target_logit]
            if with_entropy:
                sums.append((e * logits).sum(-1))  # sum e^(z-m) (z-m): padded columns give 0 * -1e30 = 0
            sums = torch.stack(sums)
            if tp_group is not None:
                dist.all_reduce(sums, group=tp_group)
            log_s = torch.log(sums[0])
            lse[s:e_] = m + log_s
            logprobs[s:e_] = sums[1] - lse[s:e_]
            if with_entropy:
                entropy[s:e_] = log_s - sums[2] / sums[0]
            del logits, e
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = (vocab_size, vocab_start, tp_group, with_entropy, chunk)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        vocab_size, vocab_start, tp_group, with_entropy, chunk = ctx.args
        n, v_local = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator over chunks (the unfused GEMM accumulates in fp32 inside one call)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        use_entropy = with_entropy and grad_entropy is not None
        for s in range(0, n, chunk):
            e_ = min(s + chunk, n)
            h = hidden[s:e_]
            logits = _chunk_logits(h, weight, vocab_size, vocab_start)
            logits -= lse[s:e_, None]  # log p
            p = torch.exp(logits)
            g_lp = grad_logprobs[s:e_].float()
            if use_entropy:
                # d/dz_j of g_lp * logprob + g_ent * H = g_lp ([j=y] - p_j) - g_ent p_j (log p_j + H)
                logits += entropy[s:e_, None]
                logits *= grad_entropy[s:e_, None].float()
                logits += g_lp[:, None]
                grad_logits = logits.mul_(p).neg_()
            else:
                grad_logits = p.mul_(-g_lp[:, None])
            idx, mine = _local_targets(targets[s:e_], vocab_start, v_local)
            grad_logits.scatter_add_(1, idx[:, None], (g_lp * mine)[:, None])
            g = grad_logits.to(weight.dtype)
            if need_h:
                grad_hidden[s:e_] = (g @ weight).to(hidden.dtype)
            if need_w:
                grad_weight += (g.t() @ h.to(weight.dtype)).float()
            del logits, p, grad_logits, g
        if need_h and tp_group is not None:
            dist.all_reduce(grad_hidden, group=tp_group)
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def reference_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused full-vocab reference (one process, whole weight): ``(N,)`` log-probs and entropy."""
    logits = (hidden.to(weight.dtype) @ weight.t()).float()[:, :vocab_size]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
