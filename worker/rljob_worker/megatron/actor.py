"""The policy model of the GRPO and SFT trainers: the megatron engine (:mod:`.engine`) with the policy's
head, i.e. per-token log-probs and entropy over the vocab-parallel logits.

Log-prob convention, aligned with ``input_ids``: ``logprobs[b, t] = log p(input_ids[b, t] | real
tokens of input_ids[b, :t])`` where token ``t`` is real and some earlier token is real; 0 elsewhere
(padding, and the first real token of a row). ``entropy[b, t]`` is the entropy of that same
predictive distribution, with the same zeros. Both are computed vocab-parallel (no full-vocab
gather under TP); the vocab entries megatron pads to a multiple of the TP size get a logit of
``-1e30`` (probability exactly 0). With ``logit_temperature`` T != 1 every value is of the
distribution the rollout sampled from, ``softmax(logits / T)`` (verl divides the logits the same way). Under context parallelism the per-token values are all-gathered
back, so loss functions see the full ``(B, T)`` tensors exactly as with ``cp = 1``; under pipeline
parallelism they are computed on the last stage and broadcast over the pipeline group, so every
method returns the same result on every rank of a model-parallel group (call them on every rank of
it, with the same batch).

By default (``fused_head``; off with ``RLJOB_FUSED_LOGPROBS=0``) the model stops before its output
layer and :mod:`.fused_head` computes the same values from the last hidden state and the output
weight in chunks of tokens (:mod:`.fused_logprobs`), never holding the micro-batch's fp32 logits.

Parallel layouts, memory (recompute, offload), checkpoints and weight export are the engine's; see
:mod:`.engine`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .context_parallel import gather_from_cp, split_for_cp
from .engine import HeadInput, MegatronEngine
from .engine_config import (
    DEFAULT_OPTIM,
    DEFAULT_PARALLEL,
    DEFAULT_RECOMPUTE,
    OptimConfig,
    ParallelConfig,
    RecomputeConfig,
)
from .errors import MegatronConfigError
from .fused_head import fused_head_enabled, fused_token_values
from .lora import LoraConfig
from .packing import PackedMicroBatch

__all__ = [
    "LossFn",
    "MegatronActor",
    "MegatronConfigError",
    "OptimConfig",
    "ParallelConfig",
    "RecomputeConfig",
    "valid_logprob_mask",
    "vocab_parallel_entropy",
]

# loss(logprobs (b, T), entropy (b, T) | None, micro-batch on the device) -> (scalar loss, metrics)
LossFn = Callable[[torch.Tensor, "torch.Tensor | None", dict], "tuple[torch.Tensor, dict[str, Any]]"]
_PAD_LOGIT = -1e30  # logits of padded vocab entries: exp() is exactly 0 and 0 * _PAD_LOGIT is finite


def valid_logprob_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, T) bool``: positions whose log-prob is defined (a real token after a real token)."""
    m = attention_mask.bool()
    return m & (torch.cumsum(m.long(), dim=1) > 1)


class MegatronActor(MegatronEngine):
    """The policy: :class:`MegatronEngine` plus log-probs, entropy and vocab padding. Build with
    :meth:`from_hf`. ``with_entropy``: whether :meth:`update` hands the loss function the entropy
    unless told otherwise."""

    def __init__(self, *args: Any, with_entropy: bool = False, fused_head: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_fn_needs_entropy = with_entropy
        # The sampling temperature: log-probs and entropy are of softmax(logits / T), the distribution the
        # rollout drew from, so the ratio to the rollout's log-probs is 1 at the first epoch (T = 1: the raw model).
        self.logit_temperature = 1.0
        # log-probs and entropy from the hidden state in token chunks (no (b, T, V) fp32 logits)
        self.fused_head = fused_head_enabled() if fused_head is None else fused_head

    @classmethod
    def from_hf(
        cls,
        hf_dir: str | os.PathLike,
        parallel: ParallelConfig = DEFAULT_PARALLEL,
        optim: OptimConfig = DEFAULT_OPTIM,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        with_entropy: bool = False,
        trainable: bool = True,
        recompute: RecomputeConfig = DEFAULT_RECOMPUTE,
        transformer_overrides: Mapping[str, Any] | None = None,
        fused_head: bool | None = None,
        fused_elementwise: bool | None = None,
        lora: LoraConfig | None = None,
    ) -> MegatronActor:
        """Build the policy from an HF checkpoint directory (see :meth:`MegatronEngine.from_hf`);
        ``trainable=False`` builds a frozen reference policy (:meth:`update` refuses).
        ``fused_head``: log-probs and entropy by :mod:`.fused_head` (default: on unless
        ``RLJOB_FUSED_LOGPROBS=0``). ``fused_elementwise``: compiled RMSNorm / RoPE / SwiGLU (default:
        on with a GPU unless ``RLJOB_FUSED_ELEMENTWISE=0``). ``lora``: train low-rank adapters on the
        frozen weights (:mod:`.lora`)."""
        built = cls.build_from_hf(hf_dir, parallel=parallel, optim=optim, dtype=dtype, seed=seed, trainable=trainable,
                                  recompute=recompute, transformer_overrides=transformer_overrides,
                                  fused_elementwise=fused_elementwise, lora=lora)
        return cls(**built, with_entropy=with_entropy, fused_head=fused_head)

    # ----------------------------------------------------------------------------------------------
    # the policy head

    def policy_head(self, with_entropy: bool) -> Callable[[HeadInput], tuple[torch.Tensor, torch.Tensor | None]]:
        """The engine head: ``(logprobs (b, T), entropy (b, T) | None)`` of one micro-batch. Fused
        (:attr:`fused_head`): from the hidden state (the engine runs with ``output_hidden``)."""
        scale = self._temperature_scale
        if self.fused_head:  # logits / T = (hidden / T) @ W: the output layer has no bias
            return lambda x: self._fused_token_values(scale(x.output), x.packed, with_entropy)
        return lambda x: self._token_values(self._mask_vocab_padding(scale(x.output)), x.packed, with_entropy)

    def _temperature_scale(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.logit_temperature == 1.0 else x / self.logit_temperature

    def _fused_token_values(self, hidden: torch.Tensor, packed: PackedMicroBatch, with_entropy: bool):
        """:meth:`_token_values` from the final-norm hidden state ``(b, Tc / cp, H)`` (``/ tp`` more
        columns under sequence parallelism) by :func:`.fused_head.fused_token_values`."""
        targets = torch.nn.functional.pad(packed.ids[:, 1:], (0, 1))
        local_targets = split_for_cp(targets, self.cp_size, self.cp_rank)  # CP
        lp_next, ent_next = fused_token_values(hidden, self.chunks[-1], local_targets, self.mcfg.hf_vocab_size,
                                               with_entropy, self.parallel.sequence_parallel)
        entropy = None
        if with_entropy:
            ent_next = gather_from_cp(ent_next, self.cp_group)  # CP: (b, Tc)
            entropy = packed.unpack(torch.nn.functional.pad(ent_next[:, :-1], (1, 0)))
        lp_next = gather_from_cp(lp_next, self.cp_group)
        logprobs = packed.unpack(torch.nn.functional.pad(lp_next[:, :-1], (1, 0)))
        return logprobs, entropy

    def _token_values(self, logits: torch.Tensor, packed: PackedMicroBatch, with_entropy: bool):
        """(logprobs, entropy | None), ``(b, T)`` each, from the vocab-parallel logits of ``packed``
        (under CP: of this rank's columns, ``(b, Tc / cp, V / tp)``)."""
        from megatron.core import tensor_parallel

        # next-token targets aligned with the logits that predict them (the last column, and in the
        # concatenated layout each row's last token, predict a dummy: unpack drops what they give)
        targets = torch.nn.functional.pad(packed.ids[:, 1:], (0, 1))
        local_targets = split_for_cp(targets, self.cp_size, self.cp_rank)  # CP
        entropy = None
        if with_entropy:  # before the cross entropy, which overwrites its input in place
            ent_next = gather_from_cp(vocab_parallel_entropy(logits), self.cp_group)  # CP: (b, Tc)
            entropy = packed.unpack(torch.nn.functional.pad(ent_next[:, :-1], (1, 0)))
        lp_next = -tensor_parallel.vocab_parallel_cross_entropy(logits, local_targets)
        lp_next = gather_from_cp(lp_next, self.cp_group)  # CP: (b, Tl) -> (b, Tc)
        logprobs = packed.unpack(torch.nn.functional.pad(lp_next[:, :-1], (1, 0)))
        return logprobs, entropy

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        if self.mcfg.padded_vocab_size == self.mcfg.hf_vocab_size:
            return logits
        chunk = logits.shape[-1]
        cols = torch.arange(chunk, device=logits.device) + self.tp_rank * chunk
        return logits.masked_fill(cols >= self.mcfg.hf_vocab_size, _PAD_LOGIT)

    # ----------------------------------------------------------------------------------------------
    # forward

    @torch.no_grad()
    def compute_logprobs(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int, with_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """``{"logprobs": (B, T) fp32, "entropy": (B, T) fp32 if with_entropy}`` on CPU, no grad."""
        self._require_onloaded("compute_logprobs")
        results = self.forward(batch, micro_batch_size, self.policy_head(with_entropy), output_hidden=self.fused_head)
        keys = ["logprobs", "entropy"] if with_entropy else ["logprobs"]
        if self.pp_size == 1:
            return {key: torch.cat([r[i].cpu() for r in results]) for i, key in enumerate(keys)}
        shape = tuple(batch["input_ids"].shape)
        return {
            key: self.broadcast_from_last_stage(
                torch.cat([r[i] for r in results]) if self.is_last_stage else None, shape
            )
            for i, key in enumerate(keys)
        }

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits ``(B, T, V)`` (HF vocab, gathered over TP) at the original positions;
        zeros at padding. For tests and debugging: it gathers the vocab."""
        self._require_onloaded("forward_logits")

        def head(x: HeadInput) -> torch.Tensor:
            logits = gather_from_cp(self._mask_vocab_padding(x.output), self.cp_group)
            return self._full_vocab_logits(logits, x.packed)

        mb = {"input_ids": input_ids, "attention_mask": attention_mask}
        results = self.forward_micro_batches([mb], head)
        shape = (*input_ids.shape, self.mcfg.hf_vocab_size)
        return self.broadcast_from_last_stage(results[0] if self.is_last_stage else None, shape)

    def _full_vocab_logits(self, logits, packed: PackedMicroBatch) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)[..., : self.mcfg.hf_vocab_size]
        return packed.unpack(logits, drop_first=False).cpu()

    @torch.no_grad()
    def eval_loss(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, micro_batch_size: int = 8
    ) -> float:
        """Mean next-token NLL over the positions of :func:`valid_logprob_mask`."""
        lp = self.compute_logprobs(
            {"input_ids": input_ids, "attention_mask": attention_mask}, micro_batch_size
        )
        mask = valid_logprob_mask(attention_mask)
        return float(-(lp["logprobs"] * mask).sum() / mask.sum().clamp(min=1))

    # ----------------------------------------------------------------------------------------------
    # update

    def update(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        micro_batch_size: int,
        with_entropy: bool | None = None,
        max_tokens_per_micro_batch: int | None = None,
        normalise_by: str | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's share of the mini-batch).

        For each micro-batch: ``loss, metrics = loss_fn(logprobs (b, T), entropy (b, T) | None,
        micro_batch)``. Gradients are clipped to ``grad_clip`` by their global norm (TP shards
        counted once), then AdamW steps. Returns the micro-batch mean of each metric, averaged over
        DP ranks, ``loss``, ``grad_norm`` and ``lr``; a non-finite grad norm skips the step
        (``skipped`` = 1).

        ``normalise_by``: the key of a ``(B, T)`` mask of the tokens the loss runs over (the GRPO
        trainer's ``"response_mask"``). Given, the loss is normalised over the whole mini-batch:
        before any forward pass, this rank's tokens and sequences with at least one token are
        counted and summed over the data-parallel ranks (one all-reduce of two integers), and
        ``loss_fn`` is called with ``num_tokens=`` and ``num_sequences=`` those totals and returns
        its micro-batch's share of the mini-batch loss (``algorithms.aggregate_loss``); the engine
        back-propagates the sum of the shares over micro-batches and DP ranks
        (``train_step(loss_reduction="sum")``), and ``loss`` is that sum. The count runs over DP,
        not DP x CP: the ranks of a context-parallel group hold the same rows. Unset: the mean of
        the micro-batch losses over micro-batches and DP ranks (``loss_reduction="mean"``). ``max_tokens_per_micro_batch``: micro-batches of at most this many
        packed tokens (rows x longest row) instead of ``micro_batch_size`` rows.
        """
        if self.optimizer is None:
            raise RuntimeError("this actor was built with trainable=False (a frozen reference model)")
        self._require_onloaded("update")
        with_entropy = self.loss_fn_needs_entropy if with_entropy is None else with_entropy
        counts = {} if normalise_by is None else self.mini_batch_counts(batch[normalise_by])

        def engine_loss(values, micro_batch):
            logprobs, entropy = values
            return loss_fn(logprobs, entropy, micro_batch, **counts)

        return self.train_step(batch, micro_batch_size, self.policy_head(with_entropy), engine_loss,
                               loss_reduction="mean" if normalise_by is None else "sum",
                               output_hidden=self.fused_head, max_tokens_per_micro_batch=max_tokens_per_micro_batch)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocab from TP-sharded ``logits (..., V/tp)`` (fp32).

    H = log S - T / S with S = sum exp(z), T = sum exp(z) z, z = logits - max; S and T are
    all-reduced over the TP group (forward all-reduce, identity backward), so no rank gathers the
    vocab. Differentiable.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    m = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - m
    e = torch.exp(z)
    s = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    t = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1))
    return torch.log(s) - t / s
