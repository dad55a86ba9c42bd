"""LoRA adapters on megatron-core's tensor-parallel linears (no transformer-engine needed).

An adapted linear computes ``W x + s B A x`` with ``s = alpha / rank``; ``W`` is frozen (no gradient,
no optimizer state), ``A (r, in)`` starts uniform in ``+-1/sqrt(in)`` and ``B (out, r)`` at zero, so
training starts from the base model. The adapter rides on the linear as a forward hook: parameter
names, HF weight loading and the frozen path are megatron's own.

Tensor parallelism splits each adapter like its linear, with one collective on the rank-``r``
activation only (``r`` << hidden):

- column-parallel (``linear_qkv``, ``linear_fc1``; ``W`` split along ``out``): ``A`` whole on every TP
  rank, ``B (out/tp, r)`` this rank's rows. ``h = A x`` goes through megatron's
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of ``dh`` backward: every TP
  rank's rows of ``B`` contribute to it); with sequence parallelism ``x`` is this rank's sequence
  shard and ``h`` is all-gathered instead (reduce-scatter backward), so ``A``'s gradient is a partial
  sum, tagged ``sequence_parallel`` like SP norms (summed over TP before the step).
- row-parallel (``linear_proj``, ``linear_fc2``; ``W`` split along ``in``): ``A (r, in/tp)`` this rank's
  columns, ``B`` whole. ``A x`` is a partial sum over TP: all-reduced (reduce-scattered to this rank's
  sequence shard under SP, where ``B``'s gradient is then partial and tagged the same way).

``A`` is drawn from one generator per (seed, layer, module) for the *whole* matrix and then sliced,
so every TP / PP layout starts from the same adapters and trains the same model. Pipeline and context
parallelism need nothing: adapters live in their layer's stage, and act per token.

Adapters stay fp32 beside bf16 base weights (they are a few MB) and are trained by torch AdamW with
the engine's manual reductions (:mod:`.optim_step`), on GPU too: megatron's DDP and distributed
optimizer would shard or bucket tensors too small to matter.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# megatron linear -> (where it lives in a transformer layer, how TP splits it)
TARGETS: dict[str, tuple[str, str]] = {
    "linear_qkv": ("self_attention", "column"),
    "linear_proj": ("self_attention", "row"),
    "linear_fc1": ("mlp", "column"),
    "linear_fc2": ("mlp", "row"),
}
# the HF projections inside each megatron linear (PEFT's target_modules) and the hf_weights kind that splits them
HF_PROJECTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "linear_qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "qkv"),
    "linear_proj": (("self_attn.o_proj",), "row"),
    "linear_fc1": (("mlp.gate_proj", "mlp.up_proj"), "gate_up"),
    "linear_fc2": (("mlp.down_proj",), "row"),
}


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGETS)
    seed: int = 0
    base_uri: str | None = None  # what the checkpoint records as the base model (default: the local folder)
    keep_trainable: tuple[str, ...] = ()  # parameter-name prefixes trained in full beside the adapters (a value head)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_spec(cls, lora, seed: int, base_uri: str | None = None, keep_trainable: tuple[str, ...] = ()) -> LoraConfig:
        return cls(rank=lora.rank, alpha=float(lora.alpha), dropout=lora.dropout,
                   targets=tuple(str(t) for t in lora.target_modules), seed=seed, base_uri=base_uri,
                   keep_trainable=keep_trainable)


class LoraAdapter(torch.nn.Module):
    """The adapter branch of one parallel linear: ``x -> s B A x``, shapes as the linear's (megatron's
    ``(s, b, in_local) -> (s, b, out_local)``, ``s`` this rank's sequence shard under SP where the
    linear's own sequence layout says). See the module docstring for the TP split."""

    def __init__(self, kind: str, a: torch.Tensor, b: torch.Tensor, scale: float, dropout: float,
                 sequence_parallel: bool, tp_size: int) -> None:
        super().__init__()
        self.kind, self.scale, self.sequence_parallel = kind, scale, sequence_parallel and tp_size > 1
        self.lora_a = torch.nn.Parameter(a)
        self.lora_b = torch.nn.Parameter(b)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        sharded, whole, dim = (self.lora_b, self.lora_a, 0) if kind == "column" else (self.lora_a, self.lora_b, 1)
        if tp_size > 1:
            sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = True, dim, 1
        # under SP the whole one's gradient is this rank's sequence shard's: summed over TP before the step
        whole.sequence_parallel = self.sequence_parallel
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpm

        x = x.to(self.lora_a.dtype)
        if self.dropout is not None and self.training:
            x = self._dropout(x)
        h = torch.matmul(x, self.lora_a.t())  # (s, b, r); row: a partial sum over TP
        if self.kind == "column":
            h = (tpm.gather_from_sequence_parallel_region(h) if self.sequence_parallel
                 else tpm.copy_to_tensor_model_parallel_region(h))
        else:
            h = (tpm.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                 else tpm.reduce_from_tensor_model_parallel_region(h))
        return torch.matmul(h, self.lora_b.t()) * self.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # a column adapter's input is the same on every TP rank (outside SP): the default generator, seeded
        # alike on every rank, keeps its mask the same; a sharded input takes megatron's per-TP-rank generator
        if self.kind == "column" and not self.sequence_parallel:
            return self.dropout(x)
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.dropout(x)

    def delta(self) -> torch.Tensor:
        """This rank's shard of ``s B A``, the shape of the linear's weight shard (fp32)."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale


def _hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    adapter: LoraAdapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


@dataclass
class AdaptedLinear:
    """One adapter with where it sits: ``name`` is the linear's global megatron name
    (``decoder.layers.{i}.self_attention.linear_qkv``)."""

    name: str
    target: str
    layer: int  # global layer index (HF's)
    linear: torch.nn.Module
    adapter: LoraAdapter


class LoraState:
    """The adapters of this rank's model chunks, what the engine asks of them, and the base model's identity."""

    def __init__(self, config: LoraConfig, adapted: list[AdaptedLinear], base: dict[str, Any]) -> None:
        self.config = config
        self.adapted = adapted
        self.base = base  # {"uri", "fingerprint"}
        self._by_weight = {f"{a.name}.weight": a for a in adapted}

    # the engine's questions -----------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for a in self.adapted for p in (a.adapter.lora_a, a.adapter.lora_b)]

    def weight_of(self, global_name: str, weight: torch.Tensor) -> torch.Tensor:
        """What the rollout gets for megatron weight ``global_name``: ``W + s B A`` (this rank's shard,
        in ``W``'s dtype) for an adapted linear, ``weight`` itself otherwise."""
        adapted = self._by_weight.get(global_name)
        if adapted is None:
            return weight
        return (weight.float() + adapted.adapter.delta()).to(weight.dtype)

    def changed_weight_names(self, num_layers: int) -> set[str]:
        """Global megatron names of every weight the adapters change, over the whole model (all stages):
        after an update only these differ from the base."""
        return {f"decoder.layers.{i}.{TARGETS[t][0]}.{t}.weight" for i in range(num_layers) for t in self.config.targets}

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every adapter off (the reference policy; no second copy of the weights)."""
        before = [a.adapter.enabled for a in self.adapted]
        for a in self.adapted:
            a.adapter.enabled = False
        try:
            yield
        finally:
            for a, was in zip(self.adapted, before):
                a.adapter.enabled = was

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every adapter parameter (a few MB), to measure an update against."""
        return {f"{a.name}.{k}": p.detach().clone() for a in self.adapted
                for k, p in (("lora_a", a.adapter.lora_a), ("lora_b", a.adapter.lora_b))}

    @torch.no_grad()
    def norms(self, before: dict[str, torch.Tensor], tp_group, pp_group) -> dict[str, float]:
        """``lora/adapter_norm``: the norm of every ``s B A`` over the model (how far the policy is from
        the base); ``lora/update_norm``: the norm of the adapter parameters' change since ``before``
        (:meth:`snapshot`). Collective over TP and PP (TP shards counted once: a whole factor only on
        TP rank 0)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        sq = torch.zeros(2, dtype=torch.float64, device=self.adapted[0].adapter.lora_a.device if self.adapted else "cpu")
        for a in self.adapted:
            sq[0] += a.adapter.delta().double().pow(2).sum()  # a shard of the delta: disjoint over TP
            for k, p in (("lora_a", a.adapter.lora_a), ("lora_b", a.adapter.lora_b)):
                if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                    sq[1] += (p.detach() - before[f"{a.name}.{k}"]).double().pow(2).sum()
        for group in (tp_group, pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        return {"lora/adapter_norm": float(sq[0].sqrt()), "lora/update_norm": float(sq[1].sqrt())}

    # checkpoints --------------------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict[str, Any]:
        """The adapters as megatron ShardedTensors with global names: any TP / PP layout loads them."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.utils import (
            make_sharded_tensor_for_checkpoint,
            make_tp_sharded_tensor_for_checkpoint,
        )

        out: dict[str, Any] = {}
        for a in self.adapted:
            for k, p in (("lora_a", a.adapter.lora_a), ("lora_b", a.adapter.lora_b)):
                key = f"lora.{a.name}.{k}"
                if not getattr(p, "tensor_model_parallel", False):
                    out[key] = make_sharded_tensor_for_checkpoint(p, key)
                    continue
                out[key] = make_tp_sharded_tensor_for_checkpoint(p, key, tp_axis=p.partition_dim)
                if a.target == "linear_fc1" and a.linear.config.gated_linear_unit:
                    # a TP rank's rows of fc1 are [its gate rows; its up rows]: saved as two tensors, each
                    # split over TP, so another TP size reads them back in its own order (as megatron's fc1)
                    out[key] = apply_swiglu_sharded_factory(out[key], ())
        return out

    @torch.no_grad()
    def load(self, loaded: dict[str, torch.Tensor]) -> None:
        for a in self.adapted:
            for k, p in (("lora_a", a.adapter.lora_a), ("lora_b", a.adapter.lora_b)):
                p.copy_(loaded[f"lora.{a.name}.{k}"])

    def meta(self) -> dict[str, Any]:
        c = self.config
        return {"rank": c.rank, "alpha": c.alpha, "targets": list(c.targets), "base": self.base}


# --------------------------------------------------------------------------------------------------
# attaching


def attach_lora(chunks: list[torch.nn.Module], config: LoraConfig, hf_dir: str | os.PathLike,
                device: torch.device) -> LoraState:
    """Freeze every parameter of ``chunks`` (but ``config.keep_trainable``), put an fp32 adapter on each
    target linear of every dense layer, and return their state. MoE layers' experts and routers are
    left alone (an MoE layer's ``mlp`` is not a dense MLP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from .errors import MegatronConfigError

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            p.requires_grad_(any(name.startswith(prefix) for prefix in config.keep_trainable))
    adapted: list[AdaptedLinear] = []
    skipped_moe = 0
    for chunk in chunks:
        sp = bool(chunk.config.sequence_parallel)
        for layer in chunk.decoder.layers:
            i = layer.layer_number - 1
            for target in config.targets:
                parent_name, kind = TARGETS[target]
                linear = getattr(getattr(layer, parent_name), target, None)
                if linear is None:
                    skipped_moe += parent_name == "mlp"
                    continue
                expected = ColumnParallelLinear if kind == "column" else RowParallelLinear
                if not isinstance(linear, expected):
                    raise MegatronConfigError(
                        f"spec.lora.targetModules: {target} of layer {i} is a {type(linear).__name__}, not megatron's "
                        f"{expected.__name__}; LoRA adapts megatron-core's own linears (the local layer spec)")
                out_local, in_local = linear.weight.shape
                a_full = _initial_a(config, i, target, in_local * (tp_size if kind == "row" else 1))
                a = a_full.chunk(tp_size, dim=1)[tp_rank] if kind == "row" else a_full
                b = torch.zeros(out_local, config.rank)  # column: this rank's rows; row: every row
                adapter = LoraAdapter(kind, a.contiguous().to(device), b.to(device), config.scale, config.dropout,
                                      sp, tp_size)
                linear.lora = adapter
                linear.register_forward_hook(_hook, with_kwargs=True)
                adapted.append(AdaptedLinear(f"decoder.layers.{i}.{parent_name}.{target}", target, i, linear, adapter))
    if skipped_moe:
        log.info("LoRA: %d MoE layer MLPs left without adapters (routers and experts are never adapted)", skipped_moe)
    if not adapted:
        raise MegatronConfigError(f"spec.lora.targetModules {list(config.targets)}: no such linear in this model "
                                  "(an MoE model's MLPs are experts: add linear_qkv or linear_proj)")
    # megatron's recompute and pipeline input need an input that requires grad for adapters in a frozen model
    for chunk in chunks:
        if chunk.pre_process:
            chunk.embedding.register_forward_hook(_inputs_require_grad)
    base = {"uri": config.base_uri or os.fspath(hf_dir), "fingerprint": base_model_fingerprint(hf_dir)}
    return LoraState(config, adapted, base)


def _inputs_require_grad(_module, _args, output):
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _initial_a(config: LoraConfig, layer: int, target: str, in_features: int) -> torch.Tensor:
    """The whole ``A (r, in)`` of one adapter, the same on every rank and layout (PEFT's kaiming-uniform
    bound ``1/sqrt(in)``)."""
    digest = hashlib.sha256(f"{config.seed}/{layer}/{target}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(config.rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound


# --------------------------------------------------------------------------------------------------
# the base model's identity


def base_model_fingerprint(hf_dir: str | os.PathLike, samples_per_file: int = 16, block: int = 1 << 16) -> str:
    """A sha256 over ``config.json`` and every safetensors file's name, size, header (tensor names, dtypes,
    shapes, offsets) and ``samples_per_file`` blocks spread over its data: another checkpoint (another
    fine-tune of the same architecture included) differs in the sampled bytes, and a 15 GB model is
    fingerprinted in milliseconds, not by reading it all."""
    root = Path(hf_dir)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.exists():
        h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
            data_start = 8 + header_len
            span = max(size - data_start - block, 0)
            for k in range(samples_per_file):
                f.seek(data_start + (span * k) // max(samples_per_file - 1, 1))
                h.update(f.read(block))
    return h.hexdigest()


def check_base(checkpoint_meta: dict[str, Any] | None, state: LoraState, ckpt_dir: str) -> None:
    """Refuse a LoRA checkpoint whose adapters were trained on another base model, or a checkpoint
    without adapters (a full fine-tuning step) for a LoRA job."""
    from .errors import MegatronConfigError

    if not checkpoint_meta:
        raise MegatronConfigError(
            f"checkpoint {ckpt_dir} holds full weights, not LoRA adapters; a job with spec.lora resumes from steps "
            "saved with spec.lora (checkpoint.resumeMode: disable starts fresh, or remove spec.lora)")
    saved = checkpoint_meta.get("base", {})
    if saved.get("fingerprint") != state.base["fingerprint"]:
        raise MegatronConfigError(
            f"checkpoint {ckpt_dir}: its adapters were trained on base model {saved.get('uri')!r} (fingerprint "
            f"{str(saved.get('fingerprint'))[:12]}), this job's spec.model.path {state.base['uri']!r} is another "
            f"model (fingerprint {state.base['fingerprint'][:12]}); set spec.model.path back to that base, or start "
            "fresh (checkpoint.resumeMode: disable)")
    if saved and (checkpoint_meta.get("rank") != state.config.rank
                  or sorted(checkpoint_meta.get("targets", [])) != sorted(state.config.targets)):
        raise MegatronConfigError(
            f"checkpoint {ckpt_dir} has LoRA rank {checkpoint_meta.get('rank')} on {checkpoint_meta.get('targets')}, "
            f"this job rank {state.config.rank} on {list(state.config.targets)}; set spec.lora.rank and "
            "spec.lora.targetModules as saved, or start fresh (checkpoint.resumeMode: disable)")


# --------------------------------------------------------------------------------------------------
# PEFT export


def peft_tensors(state: LoraState, chunks: list[torch.nn.Module], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT key, full tensor)`` of every adapter of the whole model, on every rank (collective over TP
    and PP). A fused megatron linear's adapter becomes one PEFT adapter per HF projection: they share
    ``A`` (the fused input), and each takes its rows of ``B`` (``s B_q A = s (B A)_q``)."""
    from . import hf_weights as hw

    _, t, tp_group = hw._tp()
    pp_rank, pp_size, pp_group = hw._pp()
    geo = hw._Geometry(chunks[0], hf_config.vocab_size)

    def local() -> Iterator[tuple[str, torch.Tensor]]:
        for a in state.adapted:
            projections, kind = HF_PROJECTIONS[a.target]
            col = a.adapter.kind == "column"
            a_full = a.adapter.lora_a.detach() if col else hw._gather(a.adapter.lora_a.detach(), 1, t, tp_group)
            b_full = hw._gather(a.adapter.lora_b.detach(), 0, t, tp_group) if col else a.adapter.lora_b.detach()
            hf_names = tuple(f"model.layers.{a.layer}.{p}" for p in projections)
            parts = hw._split_full(b_full, hf_names, kind if col else "row", geo, t)
            for hf_name, b_part in parts:
                yield f"base_model.model.{hf_name}.lora_A.weight", a_full.float().contiguous().clone()
                yield f"base_model.model.{hf_name}.lora_B.weight", b_part.float().contiguous().clone()

    if pp_size == 1:
        yield from local()
        return
    device = state.parameters()[0].device if state.adapted else torch.device("cpu")
    yield from hw._broadcast_stream_over_pp(local(), pp_rank, pp_size, pp_group, device)


def peft_config(state: LoraState, hf_config) -> dict[str, Any]:
    c = state.config
    modules = sorted({p.split(".")[-1] for t in c.targets for p in HF_PROJECTIONS[t][0]})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": c.rank, "lora_alpha": c.alpha, "lora_dropout": c.dropout,
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "use_rslora": False, "init_lora_weights": True, "modules_to_save": None,
        "base_model_name_or_path": state.base["uri"],
        "revision": None,
    }


def save_peft_adapter(state: LoraState, chunks, hf_config, out_dir: str | os.PathLike, writer: bool) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` (what ``peft.PeftModel.from_pretrained``
    loads onto the HF base model). Collective; ``writer`` writes."""
    from safetensors.torch import save_file

    tensors = {name: tensor.cpu() for name, tensor in peft_tensors(state, chunks, hf_config)}
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump(peft_config(state, hf_config), f, indent=2)
