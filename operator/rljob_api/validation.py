"""Turn a dict into a validated RLJob, collecting every problem with its field path.

`parse_rljob` is used by the CLI (`rljob validate`), the operator (Accepted=False with
these messages) and the worker (start-up). Schema errors come from pydantic; the
cross-field rules below are what a per-field schema cannot say.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rljob_api.enums import ResumeMode
from rljob_api.models import (
    API_VERSION,
    KIND,
    MODEL_URI_PATTERN,
    REWARD_FUNCTION_PATTERN,
    STORAGE_URI_PATTERN,
    RLJob,
    RLJobSpec,
)


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
}


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


def _pydantic_errors(exc: ValidationError, prefix: str = "") -> list[FieldError]:
    out = []
    for err in exc.errors(include_url=False):
        path = _loc_to_path(err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field; check the spelling (fields are camelCase) against `rljob explain`"
        elif err["type"] == "missing":
            message = "required field is missing"
        elif err["type"] == "string_pattern_mismatch":
            message = _PATTERN_HINTS.get(err.get("ctx", {}).get("pattern", ""), message) + f" (got {err['input']!r})"
        elif "input" in err and err["type"] not in {"model_type", "dict_type"}:
            message = f"{message} (got {err['input']!r})"
        out.append(FieldError(f"{prefix}{path}", message))
    return out


def parse_rljob(obj: Any) -> RLJob:
    """Validate a decoded RLJob document. Raises RLJobValidationError listing every problem."""
    if not isinstance(obj, dict):
        raise RLJobValidationError([FieldError("(root)", f"expected a mapping (an RLJob object), got {type(obj).__name__}")])
    errors: list[FieldError] = []
    if obj.get("apiVersion") != API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {API_VERSION!r}, got {obj.get('apiVersion')!r}"))
    if obj.get("kind") != KIND:
        errors.append(FieldError("kind", f"must be {KIND!r}, got {obj.get('kind')!r}"))
    if errors:
        raise RLJobValidationError(errors)
    try:
        job = RLJob.model_validate(obj)
    except ValidationError as exc:
        raise RLJobValidationError(_pydantic_errors(exc)) from None
    errors = cross_field_errors(job.spec)
    if errors:
        raise RLJobValidationError(errors)
    return job


def parse_spec(spec: Any) -> RLJobSpec:
    """Validate a bare spec (the worker reads the ConfigMap's spec.json with this)."""
    try:
        parsed = RLJobSpec.model_validate(spec)
    except ValidationError as exc:
        raise RLJobValidationError(_pydantic_errors(exc, prefix="spec.")) from None
    errors = cross_field_errors(parsed)
    if errors:
        raise RLJobValidationError(errors)
    return parsed


def data_parallel_size(spec: RLJobSpec) -> int:
    """Data-parallel ranks of the trainer: world / (TP x PP x CP). Assumes the spec is valid."""
    m = spec.megatron
    return (spec.nnodes * spec.gpus_per_node) // (
        m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    )


_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def name_errors(name: str) -> list[FieldError]:
    """The RLJob name becomes pod and service names (<name>-master-0): keep it a DNS label."""
    if not _K8S_NAME.match(name) or len(name) > 50:
        return [FieldError("metadata.name", "must be a DNS label of at most 50 characters (lowercase letters, digits, '-'), "
                           "because pods are named <name>-worker-N")]
    return []


def cross_field_errors(spec: RLJobSpec) -> list[FieldError]:
    """Every rule that spans fields, each with the path to change and how. Pure."""
    errs: list[FieldError] = []
    m, t, r, a = spec.megatron, spec.training, spec.rollout, spec.algorithm
    world = spec.nnodes * spec.gpus_per_node
    tp, pp, cp, ep = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                      m.context_parallel_size, m.expert_model_parallel_size)
    model_parallel = tp * pp * cp
    if world % model_parallel:
        errs.append(FieldError(
            "spec.megatron.tensorModelParallelSize",
            f"nnodes x gpusPerNode = {world} GPUs is not divisible by TP x PP x CP = {tp}x{pp}x{cp} = {model_parallel}; "
            "choose parallel sizes whose product divides the GPU count"))
        dp = None
    else:
        dp = world // model_parallel
    # Experts are sharded over the data-parallel x context-parallel ranks of a TP x PP group.
    if ep > 1:
        etp = m.expert_tensor_parallel_size or tp
        if world % (etp * ep * pp):
            errs.append(FieldError(
                "spec.megatron.expertModelParallelSize",
                f"{world} GPUs is not divisible by expertTensorParallel x EP x PP = {etp}x{ep}x{pp}; reduce EP"))
    if m.virtual_pipeline_model_parallel_size is not None and pp < 2:
        errs.append(FieldError(
            "spec.megatron.virtualPipelineModelParallelSize",
            "needs pipelineModelParallelSize >= 2; unset it or raise the pipeline size"))
    if m.sequence_parallel and tp < 2:
        errs.append(FieldError(
            "spec.megatron.sequenceParallel", "needs tensorModelParallelSize > 1; set it false or raise TP"))
    if spec.gpus_per_node % r.tensor_model_parallel_size:
        errs.append(FieldError(
            "spec.rollout.tensorModelParallelSize",
            f"rollout TP {r.tensor_model_parallel_size} must divide gpusPerNode={spec.gpus_per_node} "
            "(an engine instance lives inside one pod)"))
    # Batch sizes: verl's semantics (prompt counts; x n samples inside the actor).
    train = t.train_batch_size_per_node * spec.nnodes
    mini = t.ppo_mini_batch_size_per_node * spec.nnodes
    if t.ppo_mini_batch_size_per_node > t.train_batch_size_per_node:
        errs.append(FieldError(
            "spec.training.ppoMiniBatchSizePerNode",
            f"{t.ppo_mini_batch_size_per_node} exceeds trainBatchSizePerNode={t.train_batch_size_per_node}; lower it"))
    elif train % mini:
        errs.append(FieldError(
            "spec.training.ppoMiniBatchSizePerNode",
            f"trainBatchSizePerNode={t.train_batch_size_per_node} must be a multiple of it ({t.ppo_mini_batch_size_per_node})"))
    if dp is not None:
        if (train * r.n) % dp:
            errs.append(FieldError(
                "spec.training.trainBatchSizePerNode",
                f"global responses per step {train} x n={r.n} = {train * r.n} must divide evenly over {dp} data-parallel ranks"))
        mini_responses = mini * r.n
        if mini_responses % dp:
            errs.append(FieldError(
                "spec.training.ppoMiniBatchSizePerNode",
                f"mini-batch responses {mini} x n={r.n} = {mini_responses} must divide evenly over {dp} data-parallel ranks"))
        elif (mini_responses // dp) % t.micro_batch_size_per_gpu:
            errs.append(FieldError(
                "spec.training.microBatchSizePerGpu",
                f"per-rank mini-batch of {mini_responses // dp} responses is not a multiple of microBatchSizePerGpu="
                f"{t.micro_batch_size_per_gpu}; pick a divisor of {mini_responses // dp}"))
    if not spec.data.train_files and spec.data.synthetic is None:
        errs.append(FieldError("spec.data.trainFiles", "give training parquet files or a synthetic task (data.synthetic)"))
    if spec.data.train_files and spec.data.synthetic is not None:
        errs.append(FieldError("spec.data.synthetic", "set either trainFiles or synthetic, not both"))
    for field, uris in (("trainFiles", spec.data.train_files), ("valFiles", spec.data.val_files)):
        for i, uri in enumerate(uris):
            if not _is_storage_uri(uri):
                errs.append(FieldError(f"spec.data.{field}[{i}]", f"{uri!r} is not s3://bucket/key, file:///path or /path"))
    if spec.checkpoint.resume_mode == ResumeMode.URI and not spec.checkpoint.resume_from:
        errs.append(FieldError("spec.checkpoint.resumeFrom", "resumeMode uri needs resumeFrom (a step folder URI)"))
    if spec.checkpoint.resume_from and spec.checkpoint.resume_mode != ResumeMode.URI:
        errs.append(FieldError("spec.checkpoint.resumeMode", "resumeFrom is set; set resumeMode: uri to use it"))
    uses_s3 = any(u.startswith("s3://") for u in [spec.checkpoint.uri, spec.model.path, *spec.data.train_files])
    if a.kl_coef > 0 and a.kl_placement.value == "reward" and a.kl_estimator.value == "low_var_kl":
        errs.append(FieldError(
            "spec.algorithm.klEstimator",
            "low_var_kl is a loss-side estimator; with klPlacement reward use k1 (or set klPlacement: loss)"))
    if r.val_n > 1 and r.val_temperature == 0:
        errs.append(FieldError("spec.rollout.valN", "valN > 1 with valTemperature 0 repeats the same greedy answer; raise valTemperature"))
    if uses_s3 and spec.s3.credentials_secret_ref is None and spec.s3.endpoint is not None:
        errs.append(FieldError(
            "spec.s3.credentialsSecretRef",
            "an S3-compatible endpoint is set but no credentials; name a Secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"))
    return errs


def _is_storage_uri(uri: str) -> bool:
    if uri.startswith("s3://"):
        return bool(re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]/.+", uri))
    return uri.startswith("file:///") or uri.startswith("/")
