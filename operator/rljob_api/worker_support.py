"""What the worker of this release cannot run of a valid spec: the API accepts more (it describes the
recipes), the worker refuses these at start-up with the same words, and `rljob validate` says so beforehand.
Pure."""
from __future__ import annotations

from rljob_api.enums import CriticPlacement


def camel_case(name: str) -> str:
    """A model field's python name as the spec spells it: param_offload -> paramOffload."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


_LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                  "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                  "sequence_parallel")


def critic_layout_errors(spec) -> list[str]:
    """A shared critic runs with the actor's parallel layout (megatron's parallel state is one per process);
    a split critic is its own megatron world and may differ. One line per field."""
    c, m = spec.critic, spec.megatron
    if c is None or c.placement == CriticPlacement.SPLIT:
        return []
    errors = []
    for name in _LAYOUT_FIELDS:
        if getattr(c.megatron, name) != getattr(m, name):
            camel = camel_case(name)
            errors.append(f"spec.critic.megatron.{camel}: a shared critic runs with the actor's parallel layout in "
                          f"this worker ({getattr(m, name)!r}, got {getattr(c.megatron, name)!r}); set it equal to "
                          f"spec.megatron.{camel}, or use placement: split")
    return errors


def worker_refusals(spec) -> list[str]:
    """Every setting of a valid spec this worker refuses at start-up, one line each."""
    return critic_layout_errors(spec)
