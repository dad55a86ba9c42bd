"""The engine's settings and its process groups: parallel layout, optimizer, activation recompute; the
checks that reject a layout megatron cannot run (``MegatronConfigError`` naming the spec field), and
megatron's model-parallel state for a layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from . import moe
from .errors import MegatronConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel layout (sizes multiply: world = tp * pp * cp * dp; ``vpp``: model chunks per
    pipeline stage, interleaved schedule, needs ``pp`` > 1). Experts: ``ep`` expert parallel x ``etp``
    expert tensor parallel (default ``tp``) ranks share a layer's experts; megatron carves them out of
    the same ranks (``etp * ep * pp`` divides the world)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    @classmethod
    def from_spec(cls, megatron_spec: Any) -> ParallelConfig:
        """From ``spec.megatron`` (the RLJob API's megatron section)."""
        m = megatron_spec
        return cls(
            tp=m.tensor_model_parallel_size,
            pp=m.pipeline_model_parallel_size,
            vpp=m.virtual_pipeline_model_parallel_size,
            cp=m.context_parallel_size,
            ep=m.expert_model_parallel_size,
            etp=m.expert_tensor_parallel_size,
            sequence_parallel=m.sequence_parallel,
            use_distributed_optimizer=m.use_distributed_optimizer,
        )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping and linear warm-up to ``lr``."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # <= 0 disables clipping (the norm is still reported)
    lr_warmup_steps: int = 0


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute: megatron's ``recompute_granularity`` / ``recompute_method`` /
    ``recompute_num_layers``. ``granularity``: ``none``, ``selective`` (core attention, or the
    ``recompute_modules`` of ``overrideTransformerConfig``) or ``full`` (whole layers; ``method``
    ``uniform``: groups of ``num_layers`` layers, ``block``: the first ``num_layers`` layers of each
    pipeline stage). ``method`` and ``num_layers`` only apply to ``full``."""

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    @classmethod
    def from_spec(cls, megatron_spec: Any, gradient_checkpointing: bool = False) -> RecomputeConfig:
        """From ``spec.megatron`` (any object with ``recompute_granularity``, ``recompute_method``,
        ``recompute_num_layers``, enum or str); ``spec.model.gradientCheckpointing`` is shorthand for
        full / uniform / 1 layer when the granularity is ``none``."""

        def value(name: str, default: Any) -> Any:
            v = getattr(megatron_spec, name, default) if megatron_spec is not None else default
            return getattr(v, "value", v)

        granularity = value("recompute_granularity", "none") or "none"
        if granularity == "none" and gradient_checkpointing:
            return cls("full", "uniform", 1)
        return cls(
            str(granularity), str(value("recompute_method", "uniform")), int(value("recompute_num_layers", 1))
        )


# defaults of the engine's constructors (frozen, so one instance serves every call)
DEFAULT_PARALLEL = ParallelConfig()
DEFAULT_OPTIM = OptimConfig(lr=1e-6)
DEFAULT_RECOMPUTE = RecomputeConfig()


def check_parallel(p: ParallelConfig, on_gpu: bool) -> None:
    if p.pp < 1:
        raise MegatronConfigError(f"spec.megatron.pipelineModelParallelSize must be >= 1, got {p.pp}")
    if p.vpp is not None and p.vpp < 1:
        raise MegatronConfigError(f"spec.megatron.virtualPipelineModelParallelSize must be >= 1, got {p.vpp}")
    if p.vpp not in (None, 1) and p.pp < 2:
        raise MegatronConfigError(
            f"spec.megatron.virtualPipelineModelParallelSize={p.vpp} needs pipeline parallelism: set "
            "spec.megatron.pipelineModelParallelSize >= 2 or unset virtualPipelineModelParallelSize"
        )
    if p.tp < 1:
        raise MegatronConfigError(f"spec.megatron.tensorModelParallelSize must be >= 1, got {p.tp}")
    if p.cp < 1:
        raise MegatronConfigError(f"spec.megatron.contextParallelSize must be >= 1, got {p.cp}")
    if p.cp > 1 and p.pp > 1:
        raise MegatronConfigError(
            f"spec.megatron.contextParallelSize={p.cp} together with pipelineModelParallelSize={p.pp} is not "
            "supported yet; use one of them (e.g. more pipeline stages, or context parallelism with PP=1)"
        )
    if p.sequence_parallel and p.tp == 1:
        raise MegatronConfigError(
            "spec.megatron.sequenceParallel=true needs spec.megatron.tensorModelParallelSize > 1 "
            "(sequence parallelism splits activations over the TP ranks); set it to false or raise TP"
        )
    if p.ep < 1 or (p.etp is not None and p.etp < 1):
        raise MegatronConfigError(
            f"spec.megatron.expertModelParallelSize={p.ep} / expertTensorParallelSize={p.etp} must be >= 1"
        )
    if p.use_distributed_optimizer and not on_gpu:
        log.warning("use_distributed_optimizer is ignored on CPU (torch AdamW over local shards)")


def check_layer_split(num_layers: int, p: ParallelConfig) -> None:
    """Every pipeline stage (and each of its virtual chunks) gets the same number of layers."""
    chunks = p.pp * (p.vpp or 1)
    if num_layers % chunks == 0:
        return
    if p.vpp is None:
        raise MegatronConfigError(
            f"spec.megatron.pipelineModelParallelSize={p.pp} does not divide the model's {num_layers} layers; "
            "choose a pipeline size that divides the layer count"
        )
    raise MegatronConfigError(
        f"spec.megatron.pipelineModelParallelSize={p.pp} x spec.megatron.virtualPipelineModelParallelSize="
        f"{p.vpp} = {chunks} model chunks does not divide the model's {num_layers} layers; choose sizes whose "
        "product divides the layer count (or unset virtualPipelineModelParallelSize)"
    )


def init_model_parallel(p: ParallelConfig) -> None:
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % (p.tp * p.pp * p.cp) != 0:
        raise MegatronConfigError(
            f"world size {world} is not divisible by spec.megatron.tensorModelParallelSize={p.tp} x "
            f"spec.megatron.pipelineModelParallelSize={p.pp} x spec.megatron.contextParallelSize={p.cp}"
        )
    moe.check_expert_layout(world, p.tp, p.pp, p.cp, p.ep, p.etp)
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() == p.tp
            and ps.get_pipeline_model_parallel_world_size() == p.pp
            and ps.get_virtual_pipeline_model_parallel_world_size() == p.vpp
            and ps.get_context_parallel_world_size() == p.cp
            and ps.get_expert_model_parallel_world_size() == p.ep
            and ps.get_expert_tensor_parallel_world_size() == (p.etp or p.tp)
        ):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
    )
