"""The value model of PPO: the megatron engine (:mod:`.engine`) with a scalar value head.

Built from an HF checkpoint like the policy, at its own parallel layout, with two differences:

- the output layer is a :class:`ValueHead` (hidden -> 1, replicated over TP, initialised
  N(0, 1/(H+1)) from its own seeded generator, so every layout starts from the same head), never
  loaded from ``lm_head``; the embedding is never tied to it;
- ``output_layer_index`` k builds only the first k decoder layers: the final norm then reads layer
  k's output, so the head sees ``norm(HF hidden_states[k])`` (k = the layer count: the usual
  last-layer critic). It needs one pipeline stage (the seeds' rule).

Value convention, aligned with ``input_ids`` like the log-probs: ``values[b, t]`` is the value of the
state in which token t is generated, i.e. the head's output at the previous real token (real tokens
of ``input_ids[b, :t]``); 0 at padding and at a row's first real token. GAE reads it at the response
tokens.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .context_parallel import gather_from_cp
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
from .lora import LoraConfig

# loss(values (b, T), micro-batch on the device) -> (scalar loss, metrics)
ValueLossFn = Callable[[torch.Tensor, dict], "tuple[torch.Tensor, dict[str, Any]]"]

OUTPUT_LAYER = "output_layer.weight"


class ValueHead(torch.nn.Module):
    """``hidden (s, b, H) -> values (s, b, 1)`` fp32, in place of GPTModel's output layer (same call
    signature, returns ``(values, None)``). Under sequence parallelism the hidden state is this TP
    rank's sequence shard: the values are gathered over TP, and the weight's gradient, partial per
    TP rank, is summed over TP like a sequence-parallel norm's (``sequence_parallel`` tag)."""

    def __init__(self, hidden_size: int, seed: int, sequence_parallel: bool = False):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=generator) / (hidden_size + 1)
        self.weight = torch.nn.Parameter(weight)
        self.sequence_parallel = sequence_parallel
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        values = torch.nn.functional.linear(hidden_states, self.weight).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Replicated over TP and DP (megatron's default for a module without TP sharding)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)


def critic_hf_config(hf_config, output_layer_index: int | None):
    """The HF config the critic is built from: untied, cut to ``output_layer_index`` layers."""
    cfg = copy.deepcopy(hf_config)
    layers = cfg.num_hidden_layers
    if output_layer_index is not None:
        if not 1 <= output_layer_index <= layers:
            raise MegatronConfigError(
                f"spec.critic.outputLayerIndex={output_layer_index} is outside the model's {layers} decoder layers; "
                f"pick 1..{layers} (or unset it for the last layer)")
        cfg.num_hidden_layers = output_layer_index
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[:output_layer_index]
    cfg.tie_word_embeddings = False
    return cfg


def value_model_config(critic_config):
    """The config.json of an exported critic: the critic's (its layers, untied) as a one-label token classifier."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    cfg = copy.deepcopy(critic_config)
    causal = (getattr(cfg, "architectures", None) or [""])[0]
    cfg.architectures = [MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(cfg.model_type)
                         or causal.replace("ForCausalLM", "ForTokenClassification")]
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0
    return cfg


class MegatronCritic(MegatronEngine):
    """The critic: :class:`MegatronEngine` with :class:`ValueHead` as its output layer. Build with
    :meth:`from_hf`; :meth:`compute_values` and :meth:`update` as the actor's log-prob methods."""

    @classmethod
    def from_hf(
        cls,
        hf_dir: str | os.PathLike,
        parallel: ParallelConfig = DEFAULT_PARALLEL,
        optim: OptimConfig = DEFAULT_OPTIM,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        recompute: RecomputeConfig = DEFAULT_RECOMPUTE,
        transformer_overrides: Mapping[str, Any] | None = None,
        output_layer_index: int | None = None,
        lora: LoraConfig | None = None,
    ) -> MegatronCritic:
        """Build the critic from an HF checkpoint directory (see :meth:`MegatronEngine.from_hf`):
        the first ``output_layer_index`` layers (all when None) and the final norm loaded from it, a
        fresh value head."""
        if output_layer_index is not None and parallel.pp > 1:
            raise MegatronConfigError(
                f"spec.critic.outputLayerIndex={output_layer_index} reads an intermediate layer, which needs the "
                f"critic on one pipeline stage (critic megatron.pipelineModelParallelSize is {parallel.pp}); set it "
                "to 1 or unset outputLayerIndex")

        def attach_heads(chunks: list[torch.nn.Module], mcfg) -> None:
            for chunk in chunks:
                if getattr(chunk, "output_layer", None) is not None:  # the last stage's last chunk
                    chunk.output_layer = ValueHead(mcfg.transformer_config.hidden_size, seed,
                                                   parallel.sequence_parallel)

        try:
            built = cls.build_from_hf(hf_dir, parallel=parallel, optim=optim, dtype=dtype, seed=seed, trainable=True,
                                      recompute=recompute, transformer_overrides=transformer_overrides,
                                      hf_config_fn=lambda c: critic_hf_config(c, output_layer_index),
                                      prepare_chunks=attach_heads, skip_hf_weights=(OUTPUT_LAYER,), lora=lora)
        except MegatronConfigError as exc:  # the engine names the actor's block; these are the critic's sizes
            raise MegatronConfigError(str(exc).replace("spec.megatron.", "spec.critic.megatron.")) from None
        return cls(**built)

    # ----------------------------------------------------------------------------------------------
    # the value head

    def value_head(self, x: HeadInput) -> torch.Tensor:
        """The engine head: values ``(b, T)`` of one micro-batch (see the module's convention)."""
        packed = x.packed
        per_token = gather_from_cp(x.output[..., 0], self.cp_group)  # (b, Tc): value after each packed token
        shifted = torch.nn.functional.pad(per_token[:, :-1], (1, 0))  # value before each packed token
        return packed.unpack(shifted)

    @torch.no_grad()
    def save_hf_value_model(self, out_dir: str | os.PathLike, tokenizer=None) -> None:
        """The critic as a Hugging Face token-classification model with one label (``<Model>ForTokenClassification``,
        the class verl's FSDP critic uses): the transformer's weights (its ``outputLayerIndex`` layers; with LoRA,
        merged) and the value head as the classifier ``score`` (bias 0). HF's ``logits[b, t, 0]`` is the value of
        the state after token t, i.e. the trainer's ``values[b, t + 1]`` (:meth:`value_head`'s convention).
        Collective over the critic's ranks; global rank 0 writes."""
        from . import hf_weights

        self._require_onloaded("save_hf_value_model")
        head = None
        if self.is_last_stage:
            head = next(c.output_layer for c in self.chunks if getattr(c, "output_layer", None) is not None).weight
        hidden = self.hf_config.hidden_size
        head = self.broadcast_from_last_stage(head.detach() if head is not None else None, (1, hidden),
                                              dtype=self.dtype).to(self.dtype).cpu()
        hf_weights.save_hf_checkpoint(
            self.chunks, self.hf_config, out_dir, tokenizer=tokenizer, skip=frozenset({OUTPUT_LAYER}),
            weight_of=self.lora.weight_of if self.lora is not None else None,
            extra_tensors={"score.weight": head.clone(), "score.bias": torch.zeros(1, dtype=self.dtype)},
            saved_config=value_model_config(self.hf_config))

    @torch.no_grad()
    def compute_values(self, batch: Mapping[str, torch.Tensor], micro_batch_size: int) -> torch.Tensor:
        """``(B, T)`` fp32 values on the CPU, no grad; the same on every rank of a model-parallel group."""
        self._require_onloaded("compute_values")
        results = self.forward(batch, micro_batch_size, self.value_head)
        if self.pp_size == 1:
            return torch.cat([r.cpu() for r in results])
        shape = tuple(batch["input_ids"].shape)
        return self.broadcast_from_last_stage(torch.cat(results) if self.is_last_stage else None, shape)

    def update(self, batch: Mapping[str, torch.Tensor], loss_fn: ValueLossFn, micro_batch_size: int,
               normalise_by: str | None = None) -> dict[str, float]:
        """One optimizer step over ``batch``: ``loss, metrics = loss_fn(values (b, T), micro_batch)`` per
        micro-batch (see :meth:`MegatronEngine.train_step`). ``normalise_by``: as the actor's (the key of
        the ``(B, T)`` mask the loss runs over): the mini-batch's token and sequence counts over the
        data-parallel ranks go to ``loss_fn`` as ``num_tokens=`` / ``num_sequences=``, each micro-batch's
        loss is its share of the mini-batch loss, and ``loss`` is the mini-batch loss."""
        self._require_onloaded("update")
        if normalise_by is None:
            return self.train_step(batch, micro_batch_size, self.value_head, loss_fn)
        counts = self.mini_batch_counts(batch[normalise_by])
        return self.train_step(batch, micro_batch_size, self.value_head,
                               lambda values, micro: loss_fn(values, micro, **counts), loss_reduction="sum")
