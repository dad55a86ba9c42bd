"""RLJob condition types and reasons, and pure helpers to set conditions.

Conditions follow the Kubernetes API conventions: one entry per type, ``status`` True/False/
Unknown, ``reason`` one CamelCase word (a constant below), ``message`` a sentence,
``lastTransitionTime`` that changes only when ``status`` changes, and ``observedGeneration``.
The operator writes all five types from the first status write on, so printer columns and
``kubectl wait --for=condition=...`` never see an absent condition.

Types
    Accepted   the spec is valid and the operator acts on it (False: InvalidSpec, SpecChangeRejected).
    Running    training pods run (mirrors the PyTorchJob's Running condition, or a JobSet's ready trainer).
    Succeeded  training finished successfully (terminal).
    Failed     training failed (terminal; reason and message come from the PyTorchJob).
    Suspended  spec.suspend is true and the pods are gone.
    Admitted   only for a job in a Kueue queue (label kueue.x-k8s.io/queue-name): True once Kueue
               admitted (un-suspended) its PyTorchJob or JobSet; False with reason Queued while it
               waits for admission or after Kueue preempted it, NoKueueWorkload when no Kueue Workload
               owns the child after a grace period (Kueue does not manage that kind).
    RewardsHealthy  only once the worker reports non-finite rewards: False with reason
               NonFiniteRewards (those samples are scored 0; the message names the count).
    JudgeReady only with spec.reward.server: True (Ready) once the judge's Deployment has an available
               replica; False while it starts (Starting; ProgressDeadlineExceeded when Kubernetes gave
               up), while it is scaled to zero for a suspended or finished job (ScaledDown), or while its
               Deployment is missing (Missing).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# ---------------------------------------------------------------------------- types

ACCEPTED = "Accepted"
RUNNING = "Running"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
SUSPENDED = "Suspended"
ADMITTED = "Admitted"
REWARDS_HEALTHY = "RewardsHealthy"
JUDGE_READY = "JudgeReady"
CONDITION_TYPES = (ACCEPTED, RUNNING, SUCCEEDED, FAILED, SUSPENDED)  # always written; ADMITTED only with a queue

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"

# ---------------------------------------------------------------------------- reasons
# Accepted
REASON_SPEC_ACCEPTED = "SpecAccepted"  # True: the spec is valid; children exist or are being created
REASON_INVALID_SPEC = "InvalidSpec"  # False: validation failed; the message names every field; nothing created
REASON_SPEC_CHANGE_REJECTED = "SpecChangeRejected"  # False: a launch-time field changed while not suspended
# Running
REASON_CREATING = "Creating"  # False: waiting for an old or foreign object with the PyTorchJob's name to go
REASON_PENDING = "Pending"  # False: the PyTorchJob exists (or was just created); pods are not running yet
REASON_PYTORCHJOB_RUNNING = "PyTorchJobRunning"  # True: the PyTorchJob reports Running
REASON_JOBSET_RUNNING = "JobSetRunning"  # True: the JobSet's trainer Job has all its pods ready
REASON_RESTARTING = "Restarting"  # False: the PyTorchJob restarts failed pods
REASON_JOB_SUSPENDED = "JobSuspended"  # False: suspended
REASON_COMPLETED = "Completed"  # False: the job succeeded
REASON_JOB_FAILED = "JobFailed"  # False: the job failed
REASON_NOT_STARTED = "NotStarted"  # False: nothing was created (invalid spec)
REASON_CREATE_FAILED = "CreateFailed"  # False: an API error while creating children; retried with backoff
# Succeeded / Failed
REASON_NOT_COMPLETED = "NotCompleted"  # Succeeded False
REASON_PYTORCHJOB_SUCCEEDED = "PyTorchJobSucceeded"  # Succeeded True
REASON_JOBSET_SUCCEEDED = "JobSetSucceeded"  # Succeeded True (the JobSet's Completed condition)
REASON_NOT_FAILED = "NotFailed"  # Failed False
REASON_PYTORCHJOB_FAILED = "PyTorchJobFailed"  # Failed True, when the PyTorchJob gives no usable reason
REASON_JOBSET_FAILED = "JobSetFailed"  # Failed True, when the JobSet gives no usable reason
# Suspended
REASON_SUSPENDED = "Suspended"  # True
REASON_SUSPENDING = "Suspending"  # False: spec.suspend is true; waiting for the PyTorchJob to stop its pods
REASON_NOT_SUSPENDED = "NotSuspended"  # False
REASON_RESUMED = "Resumed"  # False: was suspended, resumed

# Admitted (and Running False while queued)
REASON_QUEUED = "Queued"  # False: the PyTorchJob waits for Kueue's admission (or was preempted by Kueue)
REASON_ADMITTED = "Admitted"  # True: Kueue admitted (un-suspended) the PyTorchJob
# False: no Kueue Workload owns the queue-labelled child after the grace period: Kueue does not manage
# that kind (settings.kueue_workload_grace_seconds; see reconcile's docstring)
REASON_NO_KUEUE_WORKLOAD = "NoKueueWorkload"

# RewardsHealthy
REASON_NONFINITE_REWARDS = "NonFiniteRewards"  # False: the reward function returned nan/inf (scored 0)
REASON_JUDGE_READY = "Ready"  # JudgeReady True: an available replica serves the judge
REASON_JUDGE_STARTING = "Starting"  # False: the pod is scheduled, pulling, or loading the model (readiness probe)
REASON_JUDGE_STUCK = "ProgressDeadlineExceeded"  # False: the Deployment's Progressing condition gave up
REASON_JUDGE_SCALED_DOWN = "ScaledDown"  # False: 0 replicas while the job is suspended or finished
REASON_JUDGE_MISSING = "Missing"  # False: the Deployment does not exist (yet, or was deleted: recreated on resync)

# ---------------------------------------------------------------------------- event reasons
# Events reuse condition reasons where one fits; these are the extra ones.
EVENT_CREATED = "Created"  # a child object was created
EVENT_RECREATED = "PyTorchJobRecreated"  # the PyTorchJob vanished before the job finished and was recreated
EVENT_SPEC_CHANGE_APPLIED = "SpecChangeApplied"  # a suspended job's PyTorchJob is replaced by one from the new spec
EVENT_RUNNING = "Running"
EVENT_SUCCEEDED = "Succeeded"
EVENT_FAILED = "Failed"
EVENT_API_ERROR = "ApiError"
EVENT_PREEMPTED = "Preempted"  # Kueue suspended an admitted PyTorchJob
EVENT_KUEUE_WORKLOAD_FOUND = "KueueWorkloadFound"  # a Workload appeared after NoKueueWorkload
EVENT_CHECKPOINT_QUARANTINED = "CheckpointQuarantined"  # a corrupt checkpoint step was moved to quarantine/

_CAMEL_WORD = re.compile(r"^[A-Z][A-Za-z0-9]{0,63}$")


def is_reason(value: Any) -> bool:
    """A usable condition reason: one CamelCase word (what the API conventions ask for)."""
    return isinstance(value, str) and bool(_CAMEL_WORD.match(value))


def get_condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return None


def is_true(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == TRUE


def set_condition(
    conditions: Iterable[Mapping[str, Any]] | None,
    type_: str,
    status: str,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
) -> list[dict[str, Any]]:
    """A new condition list with `type_` set; lastTransitionTime is kept unless status changes.

    Order is stable: an existing condition keeps its place, a new one is appended.
    """
    if status not in (TRUE, FALSE, UNKNOWN):
        raise ValueError(f"condition status must be True, False or Unknown, got {status!r}")
    if not is_reason(reason):
        raise ValueError(f"condition reason must be one CamelCase word, got {reason!r}")
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions or ():
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        changed = cond.get("status") != status
        out.append(_condition(type_, status, reason, message, generation,
                              now if changed or not cond.get("lastTransitionTime") else cond["lastTransitionTime"]))
    if not found:
        out.append(_condition(type_, status, reason, message, generation, now))
    return out


def _condition(type_: str, status: str, reason: str, message: str, generation: int | None,
               time: str) -> dict[str, Any]:
    cond: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message,
                            "lastTransitionTime": time}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond
