"""Turn a dict into a validated RLJob, collecting every problem with its field path.

`parse_rljob` is used by the CLI (`rljob validate`), the operator (Accepted=False with
these messages) and the worker (start-up). Schema errors come from pydantic; the
cross-field rules below are what a per-field schema cannot say.
"""
from __future__ import annotations

import datetime
import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import Any

import pydantic
from pydantic import ValidationError

from rljob_api.enums import (
    AdvantageEstimator,
    AlgorithmName,
    ChildKind,
    CriticPlacement,
    RecomputeGranularity,
    RecomputeMethod,
    ResumeMode,
    RolloutEngine,
    RolloutMode,
    RolloutPlacement,
    RolloutRanks,
    SFTDataFormat,
    ToolCallFormat,
)
from rljob_api.models import (
    API_VERSION,
    BUILTIN_MODEL_NAMES,
    BUILTIN_MODEL_SHAPES,
    BUILTIN_MOE_MODEL_NAMES,
    BUILTIN_REWARD_NAMES,
    BUILTIN_TOOL_MODEL_NAMES,
    GPU_RESOURCE,
    KIND,
    MODEL_URI_PATTERN,
    REMOTE_URL_PATTERN,
    REWARD_FUNCTION_PATTERN,
    S3_ENDPOINT_PATTERN,
    SHM_SIZE_PATTERN,
    STORAGE_URI_PATTERN,
    VLLM_MIN_TP_HEAD_DIM,
    MegatronSpec,
    RLJob,
    RLJobSpec,
)
from rljob_api.pod_layout import pod_template_errors


@dataclass(frozen=True)
class FieldError:
    path: str  # camelCase path such as "spec.megatron.tensorModelParallelSize"
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class RLJobValidationError(ValueError):
    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


_PATTERN_HINTS = {
    STORAGE_URI_PATTERN: "must be s3://bucket/prefix, file:///abs/path or /abs/path",
    MODEL_URI_PATTERN: "must be s3://bucket/prefix, file:///abs/path, /abs/path or builtin://name",
    REWARD_FUNCTION_PATTERN: "must be a built-in reward name (e.g. gsm8k) or module.path:function",
    S3_ENDPOINT_PATTERN: "must be an http:// or https:// URL such as http://minio.minio.svc:9000",
    REMOTE_URL_PATTERN: "must be an http:// or https:// URL without user:password@ (put credentials in "
                        "headersSecretRef), such as http://verifier.ml.svc:8000/score",
    SHM_SIZE_PATTERN: "must be a size such as 16Gi: an integer with an optional Ki, Mi, Gi or Ti suffix",
}

_JSON_TYPE_NAMES = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
                    float: "a number", type(None): "null"}


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif str(item) in {"function-after", "function-before"} or str(item).startswith(("tagged-union", "literal[")):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(root)"


def _did_you_mean(parent: str, key: str) -> str | None:
    """The field of `parent` (a dotted path; "rlj" is the RLJob itself) that an unknown `key` most likely meant:
    its camelCase form, a case-insensitive match, else the closest name (difflib) unless that is only the start of
    the key (namespace is not name)."""
    # here, not at the top: explain imports this module (and the schema is built only when a field is unknown)
    from rljob_api.explain import fields_of, lookup

    try:
        fields = list(fields_of(lookup(parent)))
    except KeyError:  # a parent under a field that is itself unknown
        return None
    wanted = camel_case(key)
    by_lower = {name.lower(): name for name in fields}
    found = wanted if wanted in fields else by_lower.get(key.lower()) or by_lower.get(wanted.lower())
    if found is None:
        close = difflib.get_close_matches(wanted, fields, n=1, cutoff=0.6)
        found = close[0] if close and not wanted.startswith(close[0]) else None
    return found if found != key else None


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _unquoted(error_type: str, value: Any) -> str | None:
    """A quoted number or boolean ('8' where an integer belongs) as it should be written; None for other input."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if error_type == "int_type" and re.fullmatch(r"[-+]?\d+", text):
        return str(int(text))
    if error_type == "float_type" and _NUMBER.fullmatch(text):
        return text
    if error_type == "bool_type" and text.lower() in {"true", "false"}:
        return text.lower()
    return None


def _pydantic_errors(exc: ValidationError, prefix: str = "") -> list[FieldError]:
    out = []
    for err in exc.errors(include_url=False):
        path = _loc_to_path(err["loc"])
        message = err["msg"]
        full = re.sub(r"\[\d+\]", "", f"{prefix}{path}")
        parent = full.rsplit(".", 1)[0] if "." in full else "spec"
        if err["type"] == "extra_forbidden":
            parent = parent if "." in full else "rlj"  # a top-level key: the RLJob's own fields
            message = f"unknown field; check the spelling (fields are camelCase) against `rljob explain {parent}`"
            suggestion = _did_you_mean(parent, full.rsplit(".", 1)[-1])
            if suggestion:
                message += f"; did you mean {suggestion}?"
            if full.endswith(("rollout.n", "rollout.false")):
                message = ("unknown field; the group size is rollout.samplesPerPrompt (verl's rollout.n; a bare "
                           "`n:` key is read as the boolean false by kubectl's YAML parser)")
        elif err["type"] == "missing":
            message = f"required field is missing; add it (see `rljob explain {full}`)"
        elif err["type"] in {"model_type", "model_attributes_type", "dict_type"}:
            got = _JSON_TYPE_NAMES.get(type(err.get("input")), type(err.get("input")).__name__)
            message = f"must be a mapping of fields, got {got}"
            if full.startswith(f"{RESOURCES_PATH}."):  # a quantity straight under resources (cpu: "64")
                message = _resources_key_message(full[len(RESOURCES_PATH) + 1:]) or message
        elif err["type"] == "string_pattern_mismatch":
            pattern = err.get("ctx", {}).get("pattern", "")
            got = err["input"]
            if pattern == REMOTE_URL_PATTERN and isinstance(got, str):  # never echo a password written in a URL
                got = re.sub(r"//[^/@\s]*@", "//***@", got)
            message = _PATTERN_HINTS.get(pattern, message) + f" (got {got!r})"
        elif "input" in err and err["type"] not in {"model_type", "dict_type"}:
            message = f"{message} (got {err['input']!r})"
            unquoted = _unquoted(err["type"], err["input"])
            if unquoted is not None:
                key = path.rsplit(".", 1)[-1]
                message += f"; write it without quotes ({unquoted if key.endswith(']') else f'{key}: {unquoted}'})"
        out.append(FieldError(f"{prefix}{path}", message))
    return out


def _as_json(obj: Any, path: str, errors: list[FieldError], seen: tuple[int, ...] = ()) -> Any:
    """The document as JSON would carry it (what `kubectl apply` sends): YAML timestamps become strings;
    non-finite numbers, recursive aliases and other non-JSON values are reported with their path."""
    where = path or "(root)"
    if isinstance(obj, (Mapping, list, tuple)):  # Mapping: kopf's body views too
        if id(obj) in seen:
            errors.append(FieldError(where, "refers to itself through a YAML alias; write the value out"))
            return None
        seen = (*seen, id(obj))
        if not isinstance(obj, Mapping):
            return [_as_json(v, f"{path}[{i}]", errors, seen) for i, v in enumerate(obj)]
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):  # YAML keys such as 1, true, null: kubectl sends them as strings
                key = json.dumps(key) if key is None or isinstance(key, (bool, int, float)) else str(key)
            out[key] = _as_json(value, f"{path}.{key}" if path else key, errors, seen)
        return out
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, float) and not math.isfinite(obj):
        errors.append(FieldError(where, f"must be a finite number, got {obj!r}"))
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, (datetime.date, datetime.datetime)):
        return obj.isoformat()
    errors.append(FieldError(where, f"a {type(obj).__name__} value is not allowed here; quote it as a string"))
    return None


# pydantic >= 2.11 can refuse snake_case field names in input although the models accept them in Python.
_BY_ALIAS_ONLY = {"by_alias": True, "by_name": False} if tuple(
    int(p) for p in pydantic.VERSION.split(".")[:2]) >= (2, 11) else {}


def _validate_json(model: type, obj: Any, prefix: str = "") -> Any:
    """Validate like the API server does: JSON types only, no coercion ("8" is not an integer, "yes" is
    not a boolean), camelCase names only (snake_case field names are unknown fields)."""
    errors: list[FieldError] = []
    plain = _as_json(obj, prefix.rstrip("."), errors)
    if errors:
        raise RLJobValidationError(errors)
    try:
        return model.model_validate_json(json.dumps(plain), strict=True, **_BY_ALIAS_ONLY)
    except ValidationError as exc:
        raise RLJobValidationError(_pydantic_errors(exc, prefix)) from None


def parse_rljob(obj: Any) -> RLJob:
    """Validate a decoded RLJob document. Raises RLJobValidationError listing every problem."""
    if not isinstance(obj, Mapping):
        got = _JSON_TYPE_NAMES.get(type(obj), type(obj).__name__)
        raise RLJobValidationError([FieldError("(root)", f"expected a mapping (an RLJob object), got {got}")])
    errors: list[FieldError] = []
    if obj.get("apiVersion") != API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {API_VERSION!r}, got {obj.get('apiVersion')!r}"))
    if obj.get("kind") != KIND:
        errors.append(FieldError("kind", f"must be {KIND!r}, got {obj.get('kind')!r}"))
    if errors:
        raise RLJobValidationError(errors)
    job = _validate_json(RLJob, obj)
    errors = cross_field_errors(job.spec)
    if errors:
        raise RLJobValidationError(errors)
    return job


def parse_spec(spec: Any) -> RLJobSpec:
    """Validate a bare spec (the worker reads the ConfigMap's spec.json with this)."""
    parsed = _validate_json(RLJobSpec, spec, prefix="spec.")
    errors = cross_field_errors(parsed)
    if errors:
        raise RLJobValidationError(errors)
    return parsed


def camel_case(name: str) -> str:
    """A model field's python name as the spec spells it: param_offload -> paramOffload."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


# The megatron fields that make a parallel layout (megatron-core keeps one parallel state per process).
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                 "sequence_parallel")


def critic_takes_turns(spec: RLJobSpec) -> bool:
    """A shared critic with a megatron layout of its own (Trinity's critic block): megatron's parallel state
    is one per process, so it runs in processes of its own on the actor's GPUs, one of each per GPU, and
    the two pools take turns. A shared critic at the actor's layout runs inside the actor's processes."""
    c = spec.critic
    if c is None or c.placement != CriticPlacement.SHARED:
        return False
    return any(getattr(c.megatron, name) != getattr(spec.megatron, name) for name in LAYOUT_FIELDS)


def critic_in_own_pool(spec: RLJobSpec) -> bool:
    """The critic runs in a process pool of its own: placement split, or shared taking turns."""
    c = spec.critic
    return c is not None and (c.placement == CriticPlacement.SPLIT or critic_takes_turns(spec))


def processes_per_node(spec: RLJobSpec) -> int:
    """Worker processes torchrun starts in each pod: one per GPU, two per GPU when a shared critic takes
    turns in processes of its own."""
    return spec.gpus_per_node * (2 if critic_takes_turns(spec) else 1)


def actor_gpus_per_node(spec: RLJobSpec) -> int:
    """GPUs of each node that run the actor (and a colocated rollout engine): all of them, less a split
    critic's critic.gpus and a separate rollout pool's rollout.gpus."""
    c, gpus = spec.critic, spec.gpus_per_node
    if c is not None and c.placement == CriticPlacement.SPLIT and c.gpus is not None:
        gpus -= c.gpus
    return gpus - rollout_gpus_per_node(spec)


def rollout_in_own_pool(spec: RLJobSpec) -> bool:
    """The rollout engines run in a process pool of their own (rollout.placement separate)."""
    return spec.rollout.placement == RolloutPlacement.SEPARATE


def rollout_gpus_per_node(spec: RLJobSpec) -> int:
    """GPUs of each node that run a separate rollout pool (rollout.gpus); 0 when the rollout is colocated."""
    r = spec.rollout
    return (r.gpus or 0) if rollout_in_own_pool(spec) else 0


def rollout_lookahead(spec: RLJobSpec) -> int:
    """Batches the rollout pool generates ahead of the trainer: 0 (sync), 1 (one-step), maxStaleness (async)."""
    mode = spec.rollout.mode
    return 0 if mode == RolloutMode.SYNC else 1 if mode == RolloutMode.ONE_STEP else spec.rollout.max_staleness


def token_truncation_in_effect(spec: RLJobSpec) -> bool:
    """algorithm.rolloutCorrection.tokenTruncation, or when unset: on exactly when samples may be off-policy
    (rollout.mode one-step or async)."""
    chosen = spec.algorithm.rollout_correction.token_truncation
    return chosen if chosen is not None else spec.rollout.mode != RolloutMode.SYNC


def actor_token_budget_in_effect(spec: RLJobSpec, on_gpu: bool) -> int | None:
    """The actor update's token budget (None: microBatchSizePerGpu rows per micro-batch): training.
    maxTokensPerMicroBatch when set (0: rows); unset on a GPU without pipeline stages, microBatchSizePerGpu full
    rows (the memory bound of row micro-batches, with less padding); unset elsewhere, rows. A pipeline pads
    every micro-batch of a step to the most rows x the longest row among them, so there budget micro-batches
    (many short rows in one, a few long ones in another) would run a larger tensor than rows do."""
    t, d = spec.training, spec.data
    if t.max_tokens_per_micro_batch is not None:
        return t.max_tokens_per_micro_batch or None
    if not on_gpu or spec.megatron.pipeline_model_parallel_size > 1:
        return None
    return t.micro_batch_size_per_gpu * (d.max_prompt_length + d.max_response_length)


def rollout_pool_errors(spec: RLJobSpec) -> list[FieldError]:
    """Placement and mode of the rollout: a separate pool needs rollout.gpus and leaves the trainer a GPU;
    one-step and async need it. Pure."""
    r, errs = spec.rollout, []
    if r.partial and r.mode == RolloutMode.SYNC:
        errs.append(FieldError("spec.rollout.partial", "continues responses under weights pushed while they are "
                               "generated, which happens only when the pool runs ahead: set rollout.mode: one-step or "
                               "async (with placement separate), or remove partial"))
    if not rollout_in_own_pool(spec):
        if r.gpus is not None:
            errs.append(FieldError("spec.rollout.gpus", "is only used by placement separate (a colocated engine runs "
                                   "on the trainer's GPUs); remove it or set rollout.placement: separate"))
        if r.mode != RolloutMode.SYNC:
            errs.append(FieldError("spec.rollout.mode", f"{r.mode.value} generates while the trainer trains, which "
                                   "needs GPUs that do not train: set rollout.placement: separate and rollout.gpus, "
                                   "or mode: sync"))
        return errs
    split = ((spec.critic.gpus or 0) if spec.critic is not None and spec.critic.placement == CriticPlacement.SPLIT
             else 0)
    if r.gpus is None:
        errs.append(FieldError("spec.rollout.gpus", f"placement separate needs the rollout pool's GPUs per node; set "
                               f"gpus to fewer than gpusPerNode={spec.gpus_per_node} (the trainer gets the rest)"))
    elif r.gpus + split >= spec.gpus_per_node:
        taken = f"rollout.gpus {r.gpus}" + (f" + critic.gpus {split}" if split else "")
        errs.append(FieldError("spec.rollout.gpus", f"{taken} leave no GPU of the node's {spec.gpus_per_node} to "
                               "the trainer; lower rollout.gpus, or raise gpusPerNode"))
    if r.tensor_model_parallel_size != 1:
        errs.append(FieldError("spec.rollout.tensorModelParallelSize", "placement separate runs one hf engine per "
                               "rollout GPU, each with the whole model: set it to 1, or use placement colocated"))
    if r.engine == RolloutEngine.VLLM:
        errs.append(FieldError("spec.rollout.engine", "vllm does not run in a separate rollout pool in this release; "
                               "set engine: hf (or auto), or rollout.placement: colocated"))
    if critic_in_own_pool(spec):
        errs.append(FieldError("spec.rollout.placement", "separate cannot be combined with a critic in processes of "
                               "its own (critic.placement split, or a shared critic with megatron sizes of its own) "
                               "in this release; give the critic the actor's sizes under placement shared, or use "
                               "rollout.placement: colocated"))
    if r.agent is not None and r.mode != RolloutMode.SYNC:
        errs.append(FieldError("spec.rollout.mode", f"{r.mode.value} cannot run the agent loop ahead of the trainer "
                               "(tools run on the trainer's side, turn by turn); use mode: sync with placement "
                               "separate, or remove rollout.agent"))
    return errs


def critic_gpus_per_node(spec: RLJobSpec) -> int:
    """GPUs of each node that run the critic: critic.gpus when split, else all of them (shared); 0 without one."""
    c = spec.critic
    if c is None:
        return 0
    if c.placement == CriticPlacement.SPLIT and c.gpus is not None:
        return c.gpus
    return spec.gpus_per_node


def _model_parallel(m: MegatronSpec) -> int:
    return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size


def data_parallel_size(spec: RLJobSpec) -> int:
    """Data-parallel ranks of the actor: its GPUs / (TP x PP x CP). Assumes the spec is valid."""
    return (spec.nnodes * actor_gpus_per_node(spec)) // _model_parallel(spec.megatron)


def critic_data_parallel_size(spec: RLJobSpec) -> int:
    """Data-parallel ranks of the critic: its GPUs / its TP x PP x CP. Assumes the spec is valid and has a critic."""
    return (spec.nnodes * critic_gpus_per_node(spec)) // _model_parallel(spec.critic.megatron)


def pool_ranks(spec: RLJobSpec) -> tuple[list[int], list[int]]:
    """Global ranks of the actor pool and of the critic pool in the one torchrun world of the job.

    World = nnodes x processes per node, rank = node x processes per node + local rank (the PyTorchJob
    contract). Shared placement at the actor's layout (and no critic): both pools are the whole world. Split:
    on every node the first gpusPerNode - critic.gpus local ranks are the actor's, the last critic.gpus the
    critic's, so each pool spans the nodes evenly and a pool's TP group stays inside a node whenever its TP
    divides its GPUs per node. Shared taking turns: 2 x gpusPerNode processes per node, the first
    gpusPerNode the actor's, the rest the critic's (local rank gpusPerNode + i shares GPU i).
    """
    per_node = processes_per_node(spec)
    world = list(range(spec.nnodes * per_node))
    actor_local = actor_gpus_per_node(spec)
    if not critic_in_own_pool(spec):
        return world, (world if spec.critic is not None else [])
    actor = [r for r in world if r % per_node < actor_local]
    critic = [r for r in world if r % per_node >= actor_local]
    return actor, critic


# A DNS-1035 label: the training-operator names a Service <name>-master-0, and Service names must start with a letter.
_K8S_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_MAX_LENGTH = 50
# What name_errors enforces, in words (its message, and `rljob explain metadata.name`).
NAME_RULE = (f"a DNS label of at most {NAME_MAX_LENGTH} characters: lowercase letters, digits and '-', starting with "
             "a letter and ending with a letter or digit (pods are named <name>-worker-N, and the training-operator's "
             "Service <name>-master-0 must start with a letter)")


def name_errors(name: str, spec: RLJobSpec | None = None) -> list[FieldError]:
    """The RLJob name becomes pod and service names (<name>-master-0): keep it a DNS-1035 label.

    With childKind JobSet the pods' hostnames are <name>-trainer-0-<index> (a DNS label of at most
    63 characters), which leaves less room for the name on large jobs."""
    if not _K8S_NAME.match(name) or len(name) > NAME_MAX_LENGTH:
        return [FieldError("metadata.name", f"must be {NAME_RULE}")]
    if spec is not None and spec.child_kind == ChildKind.JOBSET:
        longest = f"{name}-trainer-0-{spec.nnodes - 1}"
        if len(longest) > 63:
            return [FieldError("metadata.name", (
                f"is {len(name)} characters; with spec.childKind JobSet and {spec.nnodes} nodes the last pod's "
                f"hostname {longest} would exceed 63 characters: shorten the name to at most "
                f"{63 - len(longest) + len(name)} characters"))]
    return []


def cross_field_errors(spec: RLJobSpec) -> list[FieldError]:
    """Every rule that spans fields, each with the path to change and how. Pure."""
    errs: list[FieldError] = []
    m, t, r, a = spec.megatron, spec.training, spec.rollout, spec.algorithm
    errs.extend(critic_pool_errors(spec))
    errs.extend(rollout_pool_errors(spec))
    errs.extend(routing_replay_errors(spec))
    actor_gpus = actor_gpus_per_node(spec)
    if actor_gpus <= 0:  # critic.gpus or rollout.gpus take the whole node: reported above
        actor_gpus = spec.gpus_per_node
    pool = (" of the actor's pool (gpusPerNode - critic.gpus - rollout.gpus per node)"
            if actor_gpus != spec.gpus_per_node else "")
    dp = megatron_errors(m, spec.nnodes * actor_gpus, "spec.megatron", errs, pool)
    sft = a.name == AlgorithmName.SFT
    if spec.lora is not None and spec.lora.export_merged and not spec.checkpoint.export_hf:
        errs.append(FieldError("spec.lora.exportMerged", "writes the merged model beside the final export, which "
                               "checkpoint.exportHf false turns off: set exportHf: true, or remove exportMerged"))
    if spec.checkpoint.export_critic and spec.critic is None:
        errs.append(FieldError("spec.checkpoint.exportCritic", "exports the PPO critic, and this job has no "
                               "spec.critic; set it false (or add a critic with algorithm.advantageEstimator gae)"))
    if sft:
        errs.extend(sft_errors(spec, dp))
        if spec.critic is not None:
            errs.append(FieldError("spec.critic", "is only used by PPO (algorithm.advantageEstimator gae), not by "
                                   "algorithm.name sft; remove it"))
    elif spec.sft is not None:
        errs.append(FieldError("spec.sft", f"is only used by algorithm.name sft (this job runs {a.name.value}); "
                               "remove it or set algorithm.name: sft"))
    if spec.gpus_per_node % r.tensor_model_parallel_size:
        errs.append(FieldError(
            "spec.rollout.tensorModelParallelSize",
            f"rollout TP {r.tensor_model_parallel_size} must divide gpusPerNode={spec.gpus_per_node} "
            "(an engine instance lives inside one pod)"))
    elif actor_gpus % r.tensor_model_parallel_size and not rollout_in_own_pool(spec):
        errs.append(FieldError(
            "spec.rollout.tensorModelParallelSize",
            f"rollout TP {r.tensor_model_parallel_size} must divide the actor's {actor_gpus} GPUs per node "
            "(gpusPerNode - critic.gpus: the rollout engine runs on the actor's pool)"))
    # Batch sizes: verl's semantics (prompt counts; x n samples inside the actor).
    train = t.train_batch_size_per_node * spec.nnodes
    mini = t.ppo_mini_batch_size_per_node * spec.nnodes
    # (SFT batches are sequences, not prompt groups: sft_errors checks them.)
    if not sft and t.ppo_mini_batch_size_per_node > t.train_batch_size_per_node:
        errs.append(FieldError(
            "spec.training.ppoMiniBatchSizePerNode",
            f"{t.ppo_mini_batch_size_per_node} exceeds trainBatchSizePerNode={t.train_batch_size_per_node}; lower it"))
    elif not sft and train % mini:
        errs.append(FieldError(
            "spec.training.ppoMiniBatchSizePerNode",
            f"trainBatchSizePerNode={t.train_batch_size_per_node} must be a multiple of it ({t.ppo_mini_batch_size_per_node})"))
    if dp is not None and not sft:
        if (train * r.samples_per_prompt) % dp:
            errs.append(FieldError(
                "spec.training.trainBatchSizePerNode",
                f"global responses per step {train} x samplesPerPrompt={r.samples_per_prompt} = {train * r.samples_per_prompt} must divide evenly over {dp} data-parallel ranks"))
        mini_responses = mini * r.samples_per_prompt
        if mini_responses % dp:
            errs.append(FieldError(
                "spec.training.ppoMiniBatchSizePerNode",
                f"mini-batch responses {mini} x samplesPerPrompt={r.samples_per_prompt} = {mini_responses} must divide evenly over {dp} data-parallel ranks"))
        elif not t.max_tokens_per_micro_batch and (mini_responses // dp) % t.micro_batch_size_per_gpu:
            errs.append(FieldError(
                "spec.training.microBatchSizePerGpu",
                f"per-rank mini-batch of {mini_responses // dp} responses is not a multiple of microBatchSizePerGpu="
                f"{t.micro_batch_size_per_gpu}; pick a divisor of {mini_responses // dp}"))
    if t.max_tokens_per_micro_batch:  # 0: row micro-batches
        row = spec.data.max_prompt_length + spec.data.max_response_length
        if sft:
            errs.append(FieldError("spec.training.maxTokensPerMicroBatch",
                                   "is used by the GRPO actor update only; remove it (SFT packs rows with sft.packing)"))
        elif t.max_tokens_per_micro_batch < row:
            errs.append(FieldError(
                "spec.training.maxTokensPerMicroBatch",
                f"{t.max_tokens_per_micro_batch} is less than one full row (data.maxPromptLength + "
                f"data.maxResponseLength = {row}); raise it to at least {row}"))
    if spec.critic is not None and not sft:
        errs.extend(critic_errors(spec, mini * r.samples_per_prompt))
    elif a.advantage_estimator == AdvantageEstimator.GAE and not sft:
        errs.append(FieldError(
            "spec.critic", "algorithm.advantageEstimator gae needs a value model: add spec.critic (at least `critic: {}`, "
            "which trains one from spec.model.path on the same GPUs), or pick an outcome estimator such as grpo"))
    if not spec.data.train_files and spec.data.synthetic is None:
        errs.append(FieldError("spec.data.trainFiles", "give training parquet files or a synthetic task (data.synthetic)"))
    if spec.data.train_files and spec.data.synthetic is not None:
        errs.append(FieldError("spec.data.synthetic", "set either trainFiles or synthetic, not both"))
    errs.extend(synthetic_errors(spec))
    for field, uris in (("trainFiles", spec.data.train_files), ("valFiles", spec.data.val_files)):
        for i, uri in enumerate(uris):
            if not _is_storage_uri(uri):
                errs.append(FieldError(f"spec.data.{field}[{i}]", f"{uri!r} is not s3://bucket/key, file:///path or /path"))
            elif m := _NOT_PARQUET.search(uri):
                builder = {"json": "json", "jsonl": "json", "csv": "csv", "tsv": "csv", "txt": "text"}[m.group(1).lower()]
                name = uri.rsplit("/", 1)[-1]
                stem = name[:len(name) - len(m.group(0))]
                errs.append(FieldError(f"spec.data.{field}[{i}]", (
                    f"{uri!r} is not parquet: rljob reads parquet files (verl's format); convert it, e.g. with "
                    f"datasets: load_dataset('{builder}', data_files='{name}')['train'].to_parquet('{stem}.parquet')")))
    if spec.checkpoint.resume_mode == ResumeMode.URI and not spec.checkpoint.resume_from:
        errs.append(FieldError("spec.checkpoint.resumeFrom", "resumeMode uri needs resumeFrom (a step folder URI)"))
    if spec.checkpoint.resume_from and spec.checkpoint.resume_mode != ResumeMode.URI:
        errs.append(FieldError("spec.checkpoint.resumeMode", "resumeFrom is set; set resumeMode: uri to use it"))
    uses_s3 = any(u and u.startswith("s3://") for u in [
        spec.checkpoint.uri, spec.checkpoint.resume_from, spec.model.path, spec.model.tokenizer_path,
        *spec.data.train_files, *spec.data.val_files])
    if not sft and a.kl_coef > 0 and a.kl_placement.value == "reward" and a.kl_estimator.value == "low_var_kl":
        errs.append(FieldError(
            "spec.algorithm.klEstimator",
            "low_var_kl is a loss-side estimator; with klPlacement reward use k1 (or set klPlacement: loss)"))
    ob = a.overlong_buffer
    if not sft and ob.enable and ob.length > spec.data.max_response_length:
        errs.append(FieldError(
            "spec.algorithm.overlongBuffer.length",
            f"{ob.length} is longer than data.maxResponseLength={spec.data.max_response_length}: the penalty zone is "
            f"the last `length` tokens before maxResponseLength; set it to at most {spec.data.max_response_length}"))
    if not sft and a.importance_level.value == "sequence" and a.loss_aggregation.value != "seq-mean-token-mean":
        errs.append(FieldError(
            "spec.algorithm.lossAggregation",
            f"{a.loss_aggregation.value} is not the GSPO objective with importanceLevel sequence (every token of a "
            f"response carries its shared sequence ratio, so a token sum or token-mean weights responses by length); "
            "set lossAggregation: seq-mean-token-mean (or importanceLevel: token)"))
    if not sft and spec.device == "cpu" and r.engine == RolloutEngine.VLLM:
        errs.append(FieldError("spec.rollout.engine", "vllm needs GPUs (the worker runs vLLM's CUDA build, and the CPU "
                               "image has no vLLM); with device cpu set engine: hf (or auto, which picks hf on a CPU)"))
    hf_engine = r.engine == RolloutEngine.HF or (r.engine == RolloutEngine.AUTO and spec.device == "cpu")
    if not sft and hf_engine and r.tensor_model_parallel_size > 1 and not rollout_in_own_pool(spec):
        via = "hf" if r.engine == RolloutEngine.HF else "auto, which picks hf with device cpu"
        errs.append(FieldError("spec.rollout.tensorModelParallelSize", (
            f"{r.tensor_model_parallel_size} with rollout.engine {via}: the hf engines keep the whole model on each "
            "sampling GPU and are not sharded; set it to 1" + (", or use engine: vllm" if spec.device == "gpu" else ""))))
    # engine auto on GPUs picks vllm at rollout TP > 1 or with more than one process (rollout/factory.py)
    auto_vllm = (r.engine == RolloutEngine.AUTO and spec.device == "gpu" and not rollout_in_own_pool(spec)
                 and (r.tensor_model_parallel_size > 1 or (spec.critic is None and spec.nnodes * spec.gpus_per_node > 1)))
    if not sft and (r.engine == RolloutEngine.VLLM or auto_vllm) and r.ranks == RolloutRanks.RANK0:
        via = "the vllm engine" if r.engine == RolloutEngine.VLLM else (
            "rollout.engine auto, which picks vllm on GPUs at rollout TP > 1 or with more than one GPU process,")
        errs.append(FieldError("spec.rollout.ranks", f"rank0 is for the hf engines; {via} samples on every rollout "
                               "tensor-parallel group: use auto or every-rank, or rollout.engine: hf"))
    if (not sft and r.temperature == 0 and r.samples_per_prompt >= 2
            and a.advantage_estimator in (AdvantageEstimator.GRPO, AdvantageEstimator.RLOO)):
        errs.append(FieldError("spec.rollout.temperature", f"0 samples greedily, so the samplesPerPrompt="
                               f"{r.samples_per_prompt} responses of a prompt are identical and the group baseline "
                               f"(advantageEstimator {a.advantage_estimator.value}) gives each a zero advantage: "
                               "nothing is learned; use 1.0"))
    if not sft and r.val_n > 1 and r.val_temperature == 0:
        errs.append(FieldError("spec.rollout.valN", "valN > 1 with valTemperature 0 repeats the same greedy answer; raise valTemperature"))
    errs.extend(tool_errors(spec))
    if not sft:
        errs.extend(reward_errors(spec))
    pt = spec.pod_template
    errs.extend(FieldError(path, message) for path, message in
                pod_template_errors(pt.volumes, pt.volume_mounts, on_gpu=spec.device == "gpu"))
    errs.extend(resources_errors(pt.resources, spec.device == "gpu", spec.gpus_per_node))
    if uses_s3 and spec.s3.credentials_secret_ref is None and spec.s3.endpoint is not None:
        errs.append(FieldError(
            "spec.s3.credentialsSecretRef",
            "an S3-compatible endpoint is set but no credentials; name a Secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"))
    # Last, one message per field: a size that does not divide the GPUs (TP 3 on 8) is told that first.
    reported = {e.path for e in errs}
    errs.extend(e for e in builtin_model_errors(spec) if e.path not in reported)
    return errs


def synthetic_errors(spec: RLJobSpec) -> list[FieldError]:
    """data.synthetic's generated rows as the worker reads them at start-up: columns prompt (and response, for
    sft), at least one training batch of them (its sampler refuses fewer: data/prompts.EpochSampler), and its own
    validation prompts (valFiles are not read beside it). Pure."""
    syn, d, errs = spec.data.synthetic, spec.data, []
    if syn is None:
        return errs
    sft = spec.algorithm.name == AlgorithmName.SFT
    batch = spec.training.train_batch_size_per_node * spec.nnodes
    if syn.num_prompts < batch:
        rows = "sequences" if sft else "prompts"
        errs.append(FieldError("spec.data.synthetic.numPrompts", (
            f"{syn.num_prompts} is fewer than one training batch of {batch} {rows} (training.trainBatchSizePerNode "
            f"{spec.training.train_batch_size_per_node} x nnodes {spec.nnodes}); raise it to at least {batch} or "
            "lower trainBatchSizePerNode")))
    if d.val_files:
        errs.append(FieldError("spec.data.valFiles", "is not read with data.synthetic, which generates its own "
                               "validation prompts (synthetic.numValPrompts); remove valFiles, or give trainFiles "
                               "instead of synthetic"))
    if d.prompt_key != "prompt":
        errs.append(FieldError("spec.data.promptKey", f"{d.prompt_key!r}: data.synthetic writes the prompt under "
                               "'prompt'; remove promptKey (or give trainFiles with that column)"))
    if sft and spec.sft is not None and spec.sft.response_key != "response":
        errs.append(FieldError("spec.sft.responseKey", f"{spec.sft.response_key!r}: data.synthetic writes the "
                               "response under 'response'; remove responseKey (or give trainFiles with that column)"))
    return errs


def tool_errors(spec: RLJobSpec) -> list[FieldError]:
    """spec.rollout.agent and spec.tools: each needs the other, one source per tool, unique names."""
    errs: list[FieldError] = []
    agent, tools = spec.rollout.agent, spec.tools
    if agent is not None and spec.algorithm.name == AlgorithmName.SFT:
        errs.append(FieldError("spec.rollout.agent", "SFT has no rollout; remove rollout.agent and spec.tools"))
        return errs
    if agent is not None and not tools:
        errs.append(FieldError("spec.tools", "rollout.agent is set but there are no tools; add at least one "
                               "(function: module.path:function or builtin: python)"))
    if tools and agent is None:
        errs.append(FieldError("spec.rollout.agent", "spec.tools are only called in multi-turn rollouts; add "
                               "rollout.agent (e.g. `agent: {maxTurns: 4}`) or remove spec.tools"))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if (tool.function is None) == (tool.builtin is None):
            errs.append(FieldError(f"spec.tools[{i}]", "set exactly one of function (module.path:function) and "
                                   "builtin (python)"))
        if tool.name in seen:
            errs.append(FieldError(f"spec.tools[{i}].name", f"{tool.name!r} is used by an earlier tool; names must be unique"))
        seen.add(tool.name)
    path = spec.model.path or ""
    name = path[len("builtin://"):] if path.startswith("builtin://") and not spec.model.tokenizer_path else None
    if agent is not None and name in BUILTIN_MODEL_SHAPES and name not in BUILTIN_TOOL_MODEL_NAMES:
        errs.append(FieldError("spec.model.path", (
            f"{path}'s tokenizer has no <tool_call> tags, and rollout.agent stops a turn on </tool_call> as one "
            "token: use " + " or ".join(f"builtin://{n}" for n in BUILTIN_TOOL_MODEL_NAMES)
            + ", a model whose tokenizer has them (Qwen2.5, Qwen3), or remove rollout.agent")))
    if agent is not None and agent.tool_call_format == ToolCallFormat.BARE and len(tools) > 1:
        errs.append(FieldError("spec.rollout.agent.toolCallFormat", f"bare passes the call's text to the job's only "
                               f"tool, and spec.tools has {len(tools)}; use hermes"))
    return errs


def remote_reward_errors(remote, path: str) -> list[FieldError]:
    """One remote reward endpoint: the judge belongs to openai-chat, and only there."""
    errs = []
    if remote.protocol.value == "openai-chat" and remote.judge is None:
        errs.append(FieldError(f"{path}.judge", "protocol openai-chat needs a judge (model, promptTemplate); add it "
                               "or use protocol http-json"))
    if remote.protocol.value == "http-json" and remote.judge is not None:
        errs.append(FieldError(f"{path}.judge", "is only used by protocol openai-chat; remove it or set "
                               "protocol: openai-chat"))
    return errs


def reward_function_errors(function: str | None, path: str) -> list[FieldError]:
    """A reward function the worker resolves: a built-in name, or module.path:function (imported in the pod)."""
    if function is None or ":" in function or function in BUILTIN_REWARD_NAMES:
        return []
    return [FieldError(path, f"{function!r} is not a built-in reward; use one of {', '.join(BUILTIN_REWARD_NAMES)}, "
                       "or module.path:function for your own")]


def reward_errors(spec: RLJobSpec) -> list[FieldError]:
    """spec.reward.remote and every spec.reward.bySource route: exactly one reward each, a function the worker
    resolves (where no remote replaces it), endpoints well-formed."""
    rw = spec.reward
    errs = remote_reward_errors(rw.remote, "spec.reward.remote") if rw.remote is not None else []
    if rw.remote is None:  # with remote set, function is unused (the worker does not resolve it)
        errs.extend(reward_function_errors(rw.function, "spec.reward.function"))
    if rw.server is not None and (rw.remote is None or rw.remote.protocol.value != "openai-chat"):
        errs.append(FieldError("spec.reward.server", "the judge it runs is reached by spec.reward.remote with "
                               "protocol openai-chat and a judge; add them (url may stay unset)"))
    if rw.remote is not None and rw.remote.url is None and rw.server is None:
        errs.append(FieldError("spec.reward.remote.url", "is required (or add spec.reward.server to run the judge "
                               "for this job)"))
    for source, route in rw.by_source.items():
        path = f"spec.reward.bySource.{source}"
        if not source.strip() or len(source) > 253:
            errs.append(FieldError(path, "a data source name must be 1-253 characters, not blank"))
        if (route.function is None) == (route.remote is None):
            errs.append(FieldError(path, "give exactly one of function (a built-in or module.path:function) and "
                                   "remote (an endpoint)"))
        errs.extend(reward_function_errors(route.function, f"{path}.function"))
        if route.remote is not None:
            errs.extend(remote_reward_errors(route.remote, f"{path}.remote"))
            if route.remote.url is None:
                errs.append(FieldError(f"{path}.remote.url", "is required (spec.reward.server serves spec.reward."
                                       "remote only)"))
    a = spec.algorithm
    conflict = ("algorithm.dynamicSampling (which already drops groups)" if a.dynamic_sampling else
                "algorithm.advantageEstimator gae (the critic, not the group, makes the advantages)"
                if a.advantage_estimator == AdvantageEstimator.GAE else
                "algorithm.klPlacement reward (its advantages are computed after the reference pass)"
                if a.kl_coef > 0 and a.kl_placement.value == "reward" else None)
    if conflict:
        remotes = [("spec.reward.remote", rw.remote)] + [
            (f"spec.reward.bySource.{k}.remote", r.remote) for k, r in rw.by_source.items()]
        errs.extend(FieldError(f"{path}.onFailure", f"drop-group is not supported with {conflict}; use zero or fail")
                    for path, remote in remotes if remote is not None and remote.on_failure.value == "drop-group")
    return errs


def megatron_errors(m: MegatronSpec, gpus: int, prefix: str, errs: list[FieldError], pool: str = "") -> int | None:
    """The rules of one megatron block (the actor's spec.megatron or the critic's) over the GPUs it runs on.
    Appends to errs; returns the data-parallel size, or None when the sizes do not divide the GPUs."""
    tp, pp, cp, ep = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                      m.context_parallel_size, m.expert_model_parallel_size)
    model_parallel = tp * pp * cp
    dp = None
    if gpus % model_parallel:
        # Name the first size that breaks divisibility (TP, then TP x PP, then TP x PP x CP).
        culprit = ("tensorModelParallelSize" if gpus % tp else
                   "pipelineModelParallelSize" if gpus % (tp * pp) else "contextParallelSize")
        errs.append(FieldError(
            f"{prefix}.{culprit}",
            f"{'nnodes x gpusPerNode = ' if not pool else ''}{gpus} GPUs{pool} is not divisible by TP x PP x CP = "
            f"{tp}x{pp}x{cp} = {model_parallel}; choose parallel sizes whose product divides the GPU count"))
    elif cp > 1 and pp > 1:  # the worker's context-parallel attention runs without pipeline stages
        errs.append(FieldError(
            f"{prefix}.contextParallelSize", f"{cp} together with pipelineModelParallelSize {pp} is not supported "
            "by this worker; use one of them (more pipeline stages, or context parallelism with PP 1)"))
    else:
        dp = gpus // model_parallel
    # Experts are sharded over the data-parallel x context-parallel ranks of a TP x PP group.
    if ep > 1:
        etp = m.expert_tensor_parallel_size or tp
        if gpus % (etp * ep * pp):
            errs.append(FieldError(
                f"{prefix}.expertModelParallelSize",
                f"{gpus} GPUs{pool} is not divisible by expertTensorParallel x EP x PP = {etp}x{ep}x{pp}; reduce EP"))
    if m.virtual_pipeline_model_parallel_size is not None and pp < 2:
        errs.append(FieldError(
            f"{prefix}.virtualPipelineModelParallelSize",
            "needs pipelineModelParallelSize >= 2; unset it or raise the pipeline size"))
    if m.sequence_parallel and tp < 2:
        errs.append(FieldError(
            f"{prefix}.sequenceParallel", "needs tensorModelParallelSize > 1; set it false or raise TP"))
    return dp


def critic_pool_errors(spec: RLJobSpec) -> list[FieldError]:
    """Placement of the critic: split needs critic.gpus, leaving the actor at least one GPU per node. Pure."""
    c = spec.critic
    if c is None:
        return []
    if c.placement == CriticPlacement.SPLIT:
        if c.gpus is None:
            return [FieldError("spec.critic.gpus", f"placement split needs the critic's GPUs per node; set gpus to "
                               f"fewer than gpusPerNode={spec.gpus_per_node} (the actor and rollout get the rest)")]
        if c.gpus >= spec.gpus_per_node:
            return [FieldError("spec.critic.gpus", f"{c.gpus} leaves no GPU of the node's {spec.gpus_per_node} to the "
                               f"actor; set gpus below gpusPerNode, or use placement: shared")]
    elif c.gpus is not None:
        return [FieldError("spec.critic.gpus", "is only used by placement split (shared placement runs the critic on "
                           "all GPUs); remove it or set placement: split")]
    return []


def critic_errors(spec: RLJobSpec, mini_responses: int) -> list[FieldError]:
    """Rules of spec.critic: only with gae, its megatron block over its own GPUs, its micro-batches, and the
    intermediate-layer head (outputLayerIndex) only without pipeline stages (the seeds' rule). Pure."""
    errs: list[FieldError] = []
    c = spec.critic
    if spec.algorithm.advantage_estimator != AdvantageEstimator.GAE:
        errs.append(FieldError(
            "spec.critic", f"is only used by algorithm.advantageEstimator gae (this job uses "
            f"{spec.algorithm.advantage_estimator.value}); remove it or set advantageEstimator: gae"))
    if c.output_layer_index is not None and c.megatron.pipeline_model_parallel_size > 1:
        errs.append(FieldError(
            "spec.critic.outputLayerIndex",
            f"reads an intermediate layer, which needs the critic without pipeline stages (critic megatron."
            f"pipelineModelParallelSize is {c.megatron.pipeline_model_parallel_size}); set it to 1 or unset "
            "outputLayerIndex"))
    if c.placement == CriticPlacement.SPLIT:
        for name in ("param_offload", "grad_offload", "optimizer_offload"):
            if getattr(c.megatron, name):
                errs.append(FieldError(
                    f"spec.critic.megatron.{camel_case(name)}", "does nothing with placement split: the critic's GPUs hold "
                    "nothing else to make room for (offload frees GPU memory for the rollout engine or the actor "
                    "under placement shared); remove it"))
    if c.placement == CriticPlacement.SPLIT and (c.gpus is None or c.gpus >= spec.gpus_per_node):
        return errs  # reported by critic_pool_errors
    pool = " of the critic's pool (critic.gpus per node)" if c.placement == CriticPlacement.SPLIT else ""
    dp = megatron_errors(c.megatron, spec.nnodes * critic_gpus_per_node(spec), "spec.critic.megatron", errs, pool)
    if dp is not None:
        if mini_responses % dp:
            errs.append(FieldError(
                "spec.critic.megatron",
                f"mini-batch responses {mini_responses} must divide evenly over the critic's {dp} data-parallel "
                "ranks; change the critic's parallel sizes (or critic.gpus)"))
        elif (mini_responses // dp) % c.micro_batch_size_per_gpu:
            errs.append(FieldError(
                "spec.critic.microBatchSizePerGpu",
                f"the critic's per-rank mini-batch of {mini_responses // dp} responses is not a multiple of "
                f"microBatchSizePerGpu={c.micro_batch_size_per_gpu}; pick a divisor of {mini_responses // dp}"))
    return errs


def sft_errors(spec: RLJobSpec, dp: int | None) -> list[FieldError]:
    """Rules of algorithm sft (the GRPO-only batch, rollout and KL rules do not apply). Pure."""
    errs: list[FieldError] = []
    t, s = spec.training, spec.sft
    if s is None:
        return [FieldError("spec.sft", "algorithm.name sft needs spec.sft (at least its data format: tokenized, "
                           "prompt-response or messages); see `rljob explain spec.sft`")]
    # Global batch = trainBatchSizePerNode x nnodes sequences per optimizer step, split evenly over the
    # data-parallel ranks, each accumulating gradients over micro-batches of microBatchSizePerGpu.
    train = t.train_batch_size_per_node * spec.nnodes
    if dp is not None:
        if train % dp:
            errs.append(FieldError(
                "spec.training.trainBatchSizePerNode",
                f"the global batch of {train} sequences (x nnodes={spec.nnodes}) must divide evenly over {dp} "
                "data-parallel ranks"))
        elif (train // dp) % t.micro_batch_size_per_gpu:
            errs.append(FieldError(
                "spec.training.microBatchSizePerGpu",
                f"per-rank batch of {train // dp} sequences is not a multiple of microBatchSizePerGpu="
                f"{t.micro_batch_size_per_gpu}; pick a divisor of {train // dp}"))
    if spec.data.synthetic is not None and s.format != SFTDataFormat.PROMPT_RESPONSE:
        errs.append(FieldError("spec.sft.format", "data.synthetic generates prompt-response rows; set format: "
                               "prompt-response or give trainFiles"))
    return errs


def routing_replay_errors(spec: RLJobSpec) -> list[FieldError]:
    """algorithm.routingReplay: an RL algorithm over single-turn rollouts generated whole (not in partial chunks),
    and an MoE model where the spec says which model it is (a builtin). Pure."""
    if not spec.algorithm.routing_replay:
        return []
    field, errs = "spec.algorithm.routingReplay", []
    if spec.algorithm.name == AlgorithmName.SFT:
        errs.append(FieldError(field, "replays the rollout's expert choices, and sft has no rollout; remove it"))
    if spec.rollout.agent is not None:
        errs.append(FieldError(field, "is not supported with rollout.agent in this release (tool tokens are routed by "
                               "the next turn's prefill); remove routingReplay or rollout.agent"))
    if spec.rollout.partial:
        errs.append(FieldError(field, "is not supported with rollout.partial in this release (a response's chunks "
                               "ran under different weights); remove routingReplay or rollout.partial"))
    path = spec.model.path or ""
    if path.startswith("builtin://") and path[len("builtin://"):] not in BUILTIN_MOE_MODEL_NAMES:
        errs.append(FieldError(field, f"needs a mixture-of-experts model and {path} is dense; remove routingReplay "
                               f"or use " + ", ".join(f"builtin://{n}" for n in BUILTIN_MOE_MODEL_NAMES)))
    return errs


def _other_builtins(name: str, fits) -> str:
    """', or builtin://A or builtin://B': the other built-ins whose shape `fits`; '' when none does."""
    others = [f"builtin://{n}" for n, shape in BUILTIN_MODEL_SHAPES.items() if n != name and fits(shape)]
    return ", or " + " or ".join(others) if others else ""


def sizes_of(pp: int, vpp: int | None) -> str:
    """'PP 2' or 'PP x VPP = 2x2': the pipeline chunks the layers are split into, in words."""
    return f"PP x VPP = {pp}x{vpp}" if vpp else f"PP {pp}"


def builtin_shape_errors(name: str, m: MegatronSpec, prefix: str, layers: int | None = None) -> list[FieldError]:
    """The megatron sizes a built-in model cannot be split by, which the worker refuses at start-up (megatron/
    model_config.check_hf_config: TP divides the attention and KV heads; engine_config.check_layer_split: PP x VPP
    divides the layers; moe.check_moe_hf_config: EP divides the experts, and a dense model takes EP 1;
    model_config.recompute_kwargs: full recompute's recomputeNumLayers fits the layers of a pipeline chunk;
    moe.check_training_layout: an MoE model trains at TP > 1 only with sequence parallelism).
    ``layers``: the layers built when fewer than the model's (a critic cut at outputLayerIndex). Pure."""
    s, errs = BUILTIN_MODEL_SHAPES[name], []
    if layers is not None:
        s = s._replace(layers=layers)
    tp, pp, ep = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size
    vpp = m.virtual_pipeline_model_parallel_size if pp > 1 else None  # VPP without PP: megatron_errors says so
    if s.attention_heads % tp or s.kv_heads % tp:
        most = math.gcd(s.attention_heads, s.kv_heads)
        errs.append(FieldError(f"{prefix}.tensorModelParallelSize", (
            f"builtin://{name} has {s.attention_heads} attention heads and {s.kv_heads} KV "
            f"head{'s' if s.kv_heads > 1 else ''}, which TP {tp} does not divide: "
            + (f"use a TP that divides {most}" if most > 1 else "use TP 1") + (_other_builtins(
                name, lambda o: o.attention_heads % tp == 0 and o.kv_heads % tp == 0)
                or f", or a model of your own with heads that TP {tp} divides"))))
    chunks = pp * (vpp or 1)
    if s.layers % chunks:
        field, sizes, fix = ((f"{prefix}.virtualPipelineModelParallelSize", f"PP x VPP = {pp}x{vpp} = {chunks}",
                              f"unset virtualPipelineModelParallelSize (PP {pp} alone divides them)")
                             if vpp and s.layers % pp == 0 else
                             (f"{prefix}.pipelineModelParallelSize", f"PP {pp}" + (f" x VPP {vpp}" if vpp else ""),
                              f"use a PP that divides {s.layers}" + (" (and unset VPP)" if vpp else "")))
        errs.append(FieldError(field, (
            f"builtin://{name} has {s.layers} layers, which {sizes} does not divide: {fix}"
            + (_other_builtins(name, lambda o: o.layers % chunks == 0)
               or f", or a model of your own with a multiple of {chunks} layers"))))
    recompute_overridden = any(k.startswith("recompute_") for k in m.override_transformer_config)
    if m.recompute_granularity == RecomputeGranularity.FULL and not recompute_overridden and s.layers % chunks == 0:
        per_chunk, n = s.layers // chunks, m.recompute_num_layers  # megatron recomputes within each model chunk
        uniform = m.recompute_method == RecomputeMethod.UNIFORM
        if (per_chunk % n) if uniform else n > per_chunk:
            what = f"groups of {n} layers" if uniform else f"{n} layers of each stage"
            errs.append(FieldError(f"{prefix}.recomputeNumLayers", (
                f"{n}: full recompute with recomputeMethod {m.recompute_method.value} recomputes {what}, and "
                f"builtin://{name}" + (f" cut at outputLayerIndex {layers}" if layers is not None else "")
                + f" has {per_chunk} layer{'s' if per_chunk > 1 else ''} per pipeline {'chunk' if vpp else 'stage'} "
                f"({s.layers} layer{'s' if s.layers > 1 else ''} / {sizes_of(pp, vpp)}): set it to "
                + ("a divisor of" if uniform else "at most") + f" {per_chunk}")))
    if s.experts and tp > 1 and not m.sequence_parallel:
        errs.append(FieldError(f"{prefix}.sequenceParallel", (
            f"must be true to train builtin://{name}, a mixture-of-experts model, at tensorModelParallelSize {tp} "
            "(megatron's MoE layer requires it): set it, or use TP 1 with expertModelParallelSize for the experts")))
    if ep > 1 and not s.experts:
        errs.append(FieldError(f"{prefix}.expertModelParallelSize", (
            f"builtin://{name} is dense (no experts to spread): set it to 1"
            + _other_builtins(name, lambda o: o.experts and o.experts % ep == 0))))
    elif ep > 1 and s.experts % ep:
        errs.append(FieldError(f"{prefix}.expertModelParallelSize", (
            f"builtin://{name} has {s.experts} experts, which EP {ep} does not divide: use an EP that divides "
            f"{s.experts}" + _other_builtins(name, lambda o: o.experts and o.experts % ep == 0))))
    return errs


def builtin_rollout_errors(name: str, spec: RLJobSpec) -> list[FieldError]:
    """A vLLM rollout (rollout.engine vllm, or auto on GPUs, which picks vllm at rollout TP > 1) of a built-in at
    rollout TP > 1: vLLM splits the attention heads over the TP ranks, and the worker refuses heads narrower than
    VLLM_MIN_TP_HEAD_DIM (vLLM 0.26 hangs in its warm-up on them: rollout/vllm_engine.check_tensor_parallel_shape).
    Pure."""
    r, s = spec.rollout, BUILTIN_MODEL_SHAPES[name]
    rtp, field = r.tensor_model_parallel_size, "spec.rollout.tensorModelParallelSize"
    engine = r.engine == RolloutEngine.VLLM or (r.engine == RolloutEngine.AUTO and spec.device == "gpu")
    if rtp == 1 or not engine or spec.algorithm.name == AlgorithmName.SFT or rollout_in_own_pool(spec):
        return []  # (a separate pool runs hf engines at TP 1: rollout_pool_errors)
    via = "rollout.engine vllm" if r.engine == RolloutEngine.VLLM else "rollout.engine auto (vllm at rollout TP > 1)"
    if s.head_dim < VLLM_MIN_TP_HEAD_DIM:
        return [FieldError(field, (
            f"{rtp} with {via}: builtin://{name}'s attention heads are {s.head_dim} wide and vLLM needs at least "
            f"{VLLM_MIN_TP_HEAD_DIM} at tensor-parallel > 1 (it hangs in its start-up warm-up): set it to 1 (the "
            "model fits one GPU)" + _other_builtins(
                name, lambda o: o.head_dim >= VLLM_MIN_TP_HEAD_DIM and o.attention_heads % rtp == 0)))]
    if s.attention_heads % rtp:
        return [FieldError(field, (
            f"{rtp} with {via}: builtin://{name} has {s.attention_heads} attention heads, which vLLM splits over the "
            f"rollout TP ranks: use a rollout TP that divides {s.attention_heads}"))]
    return []


def builtin_model_errors(spec: RLJobSpec) -> list[FieldError]:
    """A builtin://NAME model source must name a model the worker builds, and the actor's and the critic's megatron
    sizes (and a vLLM rollout's TP) must fit its shape. Pure."""
    errs = []
    models = [("spec.model.path", spec.model.path, spec.megatron, "spec.megatron")]
    if spec.critic is not None:
        models.append(("spec.critic.model.path", spec.critic.model.path or spec.model.path, spec.critic.megatron,
                       "spec.critic.megatron"))
    for where, path, megatron, prefix in models:
        if not path or not path.startswith("builtin://"):
            continue
        name, layers = path[len("builtin://"):], None
        if name not in BUILTIN_MODEL_SHAPES:
            if where == "spec.critic.model.path" and spec.critic.model.path is None:
                continue  # the actor's path, reported above
            errs.append(FieldError(where, f"{path} is not a built-in model; choose one of "
                                   + ", ".join(f"builtin://{n}" for n in BUILTIN_MODEL_NAMES)
                                   + ", or give an s3:// or local Hugging Face folder"))
            continue
        cut = spec.critic.output_layer_index if prefix == "spec.critic.megatron" else None
        if cut is not None and cut > BUILTIN_MODEL_SHAPES[name].layers:
            most = BUILTIN_MODEL_SHAPES[name].layers
            errs.append(FieldError("spec.critic.outputLayerIndex", f"{cut} is past {path}'s {most} decoder layers: pick "
                                   f"1..{most} (or unset it for the last layer)"))
        elif cut is not None:
            layers = cut  # the critic is built from the first outputLayerIndex layers
        errs.extend(builtin_shape_errors(name, megatron, prefix, layers))
        if prefix == "spec.megatron":
            errs.extend(builtin_rollout_errors(name, spec))
    return errs


# Data files the worker cannot read (it reads parquet only, with pyarrow), optionally compressed.
_NOT_PARQUET = re.compile(r"\.(jsonl?|csv|tsv|txt)(\.(gz|bz2|xz|zst))?$", re.IGNORECASE)


def _is_storage_uri(uri: str) -> bool:
    if uri.startswith("s3://"):
        return bool(re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]/.+", uri))
    return uri.startswith(("file:///", "/"))


# ---------------------------------------------------------------------------- podTemplate.resources

RESOURCES_PATH = "spec.podTemplate.resources"
# apimachinery's resource.Quantity: a signed decimal number, then a binary or decimal SI suffix or an exponent.
QUANTITY_PATTERN = r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)
_SUFFIX = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
           **{s: Fraction(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
           **{f"{s}i": Fraction(1024) ** (i + 1) for i, s in enumerate("KMGTPE")}}
# A resource name, not a section: cpu, memory, ephemeral-storage, hugepages-2Mi, vendor.com/gpu.
_RESOURCE_NAME = re.compile(r"^(cpu|memory|ephemeral-storage|storage|hugepages-.+|gpus?|.+/.+)$", re.IGNORECASE)


def parse_quantity(value: str) -> Fraction | None:
    """The exact value of a Kubernetes quantity ('500m' -> 1/2, '1Gi' -> 2**30, '1e3' -> 1000); None if it is not one."""
    m = _QUANTITY.match(value)
    if m is None:
        return None
    number, suffix = Fraction(m.group(1)), m.group(2) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number * Fraction(10) ** int(suffix[1:])
    return number * _SUFFIX[suffix]


def _quantity_hint(value: str) -> str:
    """The quantity most likely meant by an invalid one: '800GB' -> '800G' or '800Gi', '64gi' -> '64Gi'."""
    m = re.fullmatch(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*([A-Za-z]*)\s*", value)
    if m is None:
        return "such as 500m, 64, 800G or 800Gi"
    number, unit = m.group(1), m.group(2).lower()
    unit = unit[:-1] if unit.endswith("b") and len(unit) > 1 else unit  # bytes: GB, GiB, kb
    if _QUANTITY.fullmatch(number + m.group(2)):  # only spaces were wrong
        return f"'{number}{m.group(2)}'"
    if len(unit) == 1 and unit in "kmgtpe":
        decimal = "k" if unit == "k" else unit.upper()
        return f"'{number}{decimal}' or '{number}{unit.upper()}i'"
    if len(unit) == 2 and unit[0] in "kmgtpe" and unit[1] == "i":
        return f"'{number}{unit[0].upper()}i'"
    return "such as 500m, 64, 800G or 800Gi"


def _resources_key_message(key: str) -> str | None:
    """Why `key` cannot stand directly under podTemplate.resources, and where it belongs; None for a section."""
    if key in ("requests", "limits"):
        return None
    if key == "claims":
        return ("container resource claims (dynamic resource allocation) need the pod's spec.resourceClaims, which "
                "podTemplate does not set; remove it")
    if _RESOURCE_NAME.match(key):
        return (f"{key} is a resource name, not a section of resources: put it under requests (and limits), "
                f"e.g. resources: {{requests: {{{key}: ...}}, limits: {{{key}: ...}}}}")
    close = difflib.get_close_matches(key.lower(), ["requests", "limits"], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "resources takes requests and limits"
    return f"unknown field; {hint}"


def resources_errors(resources: dict[str, dict[str, str]], on_gpu: bool, gpus_per_node: int,
                     path: str = RESOURCES_PATH) -> list[FieldError]:
    """spec.podTemplate.resources as Kubernetes and the operator read it: only requests and limits, every value a
    quantity, no GPU count other than the one the operator sets from gpusPerNode (rljob_operator.builders._resources),
    no request above its limit."""
    errs: list[FieldError] = []
    parsed: dict[str, dict[str, Fraction]] = {}
    for key, section in resources.items():
        message = _resources_key_message(key)
        if message is not None:
            errs.append(FieldError(f"{path}.{key}", message))
        for name, value in section.items():
            where = f"{path}.{key}.{name}"
            amount = parse_quantity(value)
            if amount is None:
                errs.append(FieldError(where, f"{value!r} is not a Kubernetes quantity (a number with an optional "
                                       "suffix m, k, M, G, T, P, E or Ki, Mi, Gi, Ti, Pi, Ei); write "
                                       f"{_quantity_hint(value)}"))
            elif message is not None:  # the section itself is reported above
                continue
            elif amount < 0:
                errs.append(FieldError(where, f"{value!r} is negative; a resource quantity must be 0 or more"))
            elif name == GPU_RESOURCE and not on_gpu:
                errs.append(FieldError(where, f"device cpu runs without GPUs and the operator drops {GPU_RESOURCE}; "
                                       "remove it (or set device: gpu and gpusPerNode)"))
            elif name == GPU_RESOURCE and amount != gpus_per_node:
                fix = (f"set gpusPerNode: {amount} instead of a GPU {key[:-1]}" if amount.denominator == 1 and amount > 0
                       else "remove it and set gpusPerNode")
                errs.append(FieldError(where, f"the operator sets {GPU_RESOURCE} from spec.gpusPerNode "
                                       f"({gpus_per_node}); {fix}"))
            else:
                parsed.setdefault(key, {})[name] = amount
    for name, request in parsed.get("requests", {}).items():
        limit = parsed.get("limits", {}).get(name)
        if limit is not None and request > limit:
            errs.append(FieldError(f"{path}.requests.{name}", (
                f"{resources['requests'][name]} is more than limits.{name} {resources['limits'][name]}; "
                "Kubernetes refuses a request above its limit: raise the limit or lower the request")))
    return errs
