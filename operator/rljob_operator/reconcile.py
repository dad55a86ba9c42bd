"""The one level-based reconcile: what the RLJob asks for, what exists -> a plan. Pure.

Create, resume, spec updates, progress reports, PyTorchJob events and the resync timer all call
`reconcile(body, observed, settings)`; the handler applies the returned `Plan` (creates, patches,
deletes, events, then one status write). Nothing here does I/O or reads the clock: `observed.now`
is the time.

Immutability policy (README text)
    The running pods read the spec once, at start, from the `<job>-spec` ConfigMap. So every spec
    field except `suspend` is a launch-time field: the operator fingerprints the spec without
    `suspend` (`rljob.dev/spec-hash` on the ConfigMap and PyTorchJob) and compares it with the live
    PyTorchJob's.
    - Changed while NOT suspended: the change is rejected. `Accepted=False, reason
      SpecChangeRejected`, a Warning event naming the changed fields; the running PyTorchJob and
      its ConfigMap are left exactly as they are. Reverting the edit clears the condition.
    - Changed while `spec.suspend: true`, or while the child is still suspended (an apply that edits
      the spec and sets `suspend: false` at once): the change is applied. The PyTorchJob is deleted (its pods
      get SIGTERM and save a checkpoint in the grace period), the ConfigMap is rewritten, and a new
      suspended PyTorchJob is created from the new spec; `suspend: false` then starts it and
      training resumes from the last committed checkpoint (`checkpoint.resumeMode: auto`).
    - After the job finished (Succeeded or Failed), spec edits have no effect (SpecChangeRejected);
      create a new RLJob to train again.
    `suspend` itself may change at any time: it is mirrored to the PyTorchJob's `runPolicy.suspend`,
    except for a Kueue-managed PyTorchJob (see below).

Kueue
    An RLJob labelled `kueue.x-k8s.io/queue-name` (and optionally `kueue.x-k8s.io/priority-class`)
    gets a PyTorchJob with the same labels, created suspended. Kueue un-suspends it on admission and
    suspends it again to preempt it; the operator never un-suspends it (spec.suspend stays the user's
    intent: `true` suspends the PyTorchJob, `false` leaves the decision to Kueue). The `Admitted`
    condition (and `Running=False, reason Queued`) shows the queue's state; a preempted job's pods
    stop exactly as on a user suspend (SIGTERM, checkpoint) and resume from it on re-admission.

Other rules
    - Invalid spec: `Accepted=False, reason InvalidSpec`, the message lists every field with the
      fix, a Warning event, and nothing is created (existing children of an earlier valid spec keep
      it; only `suspend: true` reaches them, since stopping is always safe, while a resume waits for a
      valid spec). No exception: an invalid spec is not retried, it waits for an edit.
    - A PyTorchJob that disappears before the job finished is recreated (the worker resumes from
      the last checkpoint); after Succeeded/Failed it is not.
    - A child with our name that this RLJob does not own is never touched: the plan waits for it.

Child kinds
    `spec.childKind` picks the workload child: a PyTorchJob (the default) or a JobSet
    (`builders.build_jobset`). Everything above holds for both; only the field that suspends
    (`spec.runPolicy.suspend` / `spec.suspend`) and the status read differ (`child_phase`). The
    kind is part of the spec hash, so changing it is a launch-time edit: rejected while running,
    applied while suspended (the old child is deleted, one of the new kind created).

Kueue that ignores the child (NoKueueWorkload)
    Kueue manages a job by creating a `Workload` owned by it. When a queue-labelled child is still
    suspended and no Workload owns it `settings.kueue_workload_grace_seconds` after its creation,
    Kueue does not manage that kind (Kueue >= 0.19 leaves `kubeflow.org/pytorchjob` out of its
    default `integrations.frameworks`): `Admitted=False, reason NoKueueWorkload`, one Warning event
    naming both fixes, and back to `Queued` as soon as a Workload appears. Where the Workload API is
    not served at all (`observed.kueue_missing`: Kueue is not installed) the same condition says so and
    names those fixes instead; where it cannot be read (403, `observed.workloads` None) nothing is judged.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import Any

from rljob_api.enums import ChildKind
from rljob_api.models import RLJob
from rljob_api.validation import RLJobValidationError, name_errors, parse_rljob

from rljob_operator import builders
from rljob_operator import conditions as c
from rljob_operator.progress import ANNOTATION as PROGRESS_ANNOTATION
from rljob_operator.progress import ProgressError, decode_progress, is_newer
from rljob_operator.settings import OperatorSettings

MAX_MESSAGE = 2000
REQUEUE_WAITING = 5.0  # seconds between checks while waiting for a child to go away

# PyTorchJob phases derived from its conditions (training-operator v1 condition types).
PHASE_ABSENT = "Absent"
PHASE_DELETING = "Deleting"
PHASE_PENDING = "Pending"  # Created, no pods running yet
PHASE_RUNNING = "Running"
PHASE_RESTARTING = "Restarting"
PHASE_SUSPENDED = "Suspended"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"


@dataclasses.dataclass(frozen=True)
class ChildRef:
    api_version: str
    kind: str
    namespace: str
    name: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> ChildRef:
        meta = obj["metadata"]
        return cls(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Create:
    body: dict[str, Any]
    event: Event | None = None  # posted only when the object was really created (not 409)


@dataclasses.dataclass(frozen=True)
class Patch:
    ref: ChildRef
    body: dict[str, Any]  # a JSON merge patch


@dataclasses.dataclass(frozen=True)
class Delete:
    ref: ChildRef
    event: Event | None = None


@dataclasses.dataclass(frozen=True)
class Observed:
    """What exists: the children read from the API (None = absent) and the current time."""

    now: str
    pytorchjob: Mapping[str, Any] | None = None
    configmap: Mapping[str, Any] | None = None
    ensure_all: bool = False  # a resync: also (re)create RBAC and metrics children that may have been deleted
    jobset: Mapping[str, Any] | None = None
    # Kueue Workloads that may own the child (read only for a suspended, queue-labelled child); None:
    # not read, or the Workload CRD is not installed, so nothing is concluded from their absence.
    workloads: tuple[Mapping[str, Any], ...] | None = None
    # the judge Deployment of spec.reward.server (read only when the spec has one)
    judge: Mapping[str, Any] | None = None
    # the Workload API (kueue.x-k8s.io/v1beta2) is not served at all (404, not 403): Kueue is not installed
    # (or older than 0.15), so a queue-labelled child is never admitted
    kueue_missing: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    create: tuple[Create, ...] = ()
    patch: tuple[Patch, ...] = ()
    delete: tuple[Delete, ...] = ()
    status: dict[str, Any] | None = None  # the complete new status; None when it would not change
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None
    accepted: bool = True
    notes: tuple[str, ...] = ()  # things worth a log line (e.g. an unreadable progress annotation)

    @property
    def changes_children(self) -> bool:
        return bool(self.create or self.patch or self.delete)


# ---------------------------------------------------------------------------- helpers

def _owned_by(obj: Mapping[str, Any] | None, uid: str | None) -> bool:
    if obj is None or not uid:
        return True  # absent, or no uid to compare (rendered objects): nothing to protect
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def pytorchjob_phase(ptj: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any] | None]:
    """The phase of a PyTorchJob from its conditions, and the condition that decided it."""
    if ptj is None:
        return PHASE_ABSENT, None
    if ptj.get("metadata", {}).get("deletionTimestamp"):
        return PHASE_DELETING, None
    conds = (ptj.get("status") or {}).get("conditions") or []
    for type_, phase in (("Succeeded", PHASE_SUCCEEDED), ("Failed", PHASE_FAILED), ("Suspended", PHASE_SUSPENDED),
                         ("Restarting", PHASE_RESTARTING), ("Running", PHASE_RUNNING)):
        cond = c.get_condition(conds, type_)
        if cond is not None and cond.get("status") == c.TRUE:
            return phase, cond
    return PHASE_PENDING, c.get_condition(conds, "Created")


def jobset_phase(js: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any] | None]:
    """The phase of a JobSet from its conditions (Completed, Failed, Suspended) and, while none is
    True, from its trainer's `replicatedJobsStatus` (a JobSet has no Running condition)."""
    if js is None:
        return PHASE_ABSENT, None
    if js.get("metadata", {}).get("deletionTimestamp"):
        return PHASE_DELETING, None
    status = js.get("status") or {}
    conds = status.get("conditions") or []
    for type_, phase in (("Completed", PHASE_SUCCEEDED), ("Failed", PHASE_FAILED), ("Suspended", PHASE_SUSPENDED)):
        cond = c.get_condition(conds, type_)
        if cond is not None and cond.get("status") == c.TRUE:
            return phase, cond
    name = js.get("metadata", {}).get("name", "")
    trainer = next((r for r in status.get("replicatedJobsStatus") or () if r.get("name") == builders.TRAINER_ROLE),
                   None) or {}
    restarts = status.get("restarts") or 0
    if (trainer.get("ready") or 0) >= 1:
        return PHASE_RUNNING, {"reason": c.REASON_JOBSET_RUNNING,
                               "message": f"JobSet {name}: the {builders.TRAINER_ROLE} pods are ready."}
    if restarts:
        return PHASE_RESTARTING, {"reason": c.REASON_RESTARTING, "message": (
            f"JobSet {name} restarts all its Jobs after a failure (restart {restarts} of the restart budget "
            "spec.runPolicy.backoffLimit).")}
    return PHASE_PENDING, None


def child_phase(child: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any] | None]:
    if child is not None and child.get("kind") == builders.JOBSET_KIND:
        return jobset_phase(child)
    return pytorchjob_phase(child)


def _hash_of(obj: Mapping[str, Any] | None) -> str | None:
    if obj is None:
        return None
    return (obj.get("metadata", {}).get("annotations") or {}).get(builders.ANNOTATION_SPEC_HASH)


def changed_fields(old: Any, new: Any, prefix: str = "spec", limit: int = 8) -> list[str]:
    """Leaf paths (camelCase) where two spec documents differ, `suspend` excluded."""
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if len(out) >= limit or a == b:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if path == "spec" and key == "suspend":
                    continue
                walk(a.get(key), b.get(key), f"{path}.{key}")
        else:
            out.append(path)

    walk(old, new, prefix)
    return out


def _launched_spec(configmap: Mapping[str, Any] | None) -> dict[str, Any] | None:
    try:
        return json.loads((configmap or {}).get("data", {}).get("spec.json", ""))
    except ValueError:
        return None


def _clip(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def parse_body(body: Mapping[str, Any]) -> tuple[RLJob | None, list[str]]:
    """The RLJob in a stored object, or the list of 'field: problem' messages."""
    doc = {k: v for k, v in body.items() if k != "status"}
    meta = doc.get("metadata") or {}
    # Only the metadata the models read; the server's bookkeeping (managedFields, ...) passes through.
    doc["metadata"] = {k: meta[k] for k in ("name", "namespace", "generation", "uid", "labels") if k in meta}
    try:
        job = parse_rljob(doc)
    except RLJobValidationError as exc:
        return None, [str(e) for e in exc.errors]
    errors = name_errors(job.metadata.name, job.spec)
    if errors:
        return None, [str(e) for e in errors]
    return job, []


# ---------------------------------------------------------------------------- reconcile

def reconcile(body: Mapping[str, Any], observed: Observed, settings: OperatorSettings) -> Plan:
    """The plan that moves the world towards `body` (a stored RLJob, as read from the API)."""
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return Plan()  # garbage collection removes the children through their ownerReferences
    name, uid = meta.get("name", ""), meta.get("uid")
    generation = meta.get("generation")
    now = observed.now
    old_status: dict[str, Any] = copy.deepcopy(body.get("status") or {})
    old_conds = old_status.get("conditions") or []
    finished_before = c.is_true(old_conds, c.SUCCEEDED) or c.is_true(old_conds, c.FAILED)

    creates: list[Create] = []
    patches: list[Patch] = []
    deletes: list[Delete] = []
    events: list[Event] = []
    notes: list[str] = []
    requeue: float | None = None

    cm = observed.configmap
    ptj_name = builders.child_name(name)
    job, errors = parse_body(body)
    by_kind = {ChildKind.PYTORCHJOB: observed.pytorchjob, ChildKind.JOBSET: observed.jobset}
    if job is not None:
        kind = job.spec.child_kind
    else:  # the kind of whatever exists (an invalid spec says nothing we can trust)
        kind = ChildKind.JOBSET if (old_status.get("jobSetName") or (
            observed.jobset is not None and observed.pytorchjob is None)) else ChildKind.PYTORCHJOB
    other = ChildKind.JOBSET if kind == ChildKind.PYTORCHJOB else ChildKind.PYTORCHJOB
    foreign = [obj for obj in (by_kind[kind], cm) if not _owned_by(obj, uid)]
    # Never act on, or report from, an object we do not control. A child of the other kind is one
    # launched before a childKind edit: its spec hash differs, so it is handled as any launch-time edit.
    ptj = by_kind[kind] if _owned_by(by_kind[kind], uid) else None
    if ptj is None and by_kind[other] is not None and _owned_by(by_kind[other], uid) and not foreign:
        ptj = by_kind[other]
    if cm is not None and not _owned_by(cm, uid):
        cm = None
    child_label = f"{ptj['kind'] if ptj is not None else kind.value} {ptj_name}"
    phase, phase_cond = child_phase(ptj)
    accepted: tuple[str, str, str]
    suspend_requested = bool((body.get("spec") or {}).get("suspend")) if job is None else job.spec.suspend
    will_create_ptj = False
    replacing = False  # deleting the PyTorchJob on purpose (a spec edit while suspended)

    if job is None:
        live = ptj is not None and not finished_before and phase not in (PHASE_DELETING, PHASE_SUCCEEDED,
                                                                          PHASE_FAILED)
        if ptj is None:
            lead = "The spec is invalid, so nothing was created: "
        elif live:
            lead = (f"The spec is invalid, so {child_label} keeps the last accepted spec (only spec.suspend: true "
                    "is applied) until it is fixed: ")
        else:
            lead = "The spec is invalid: "
        accepted = (c.FALSE, c.REASON_INVALID_SPEC, _clip(lead + "; ".join(errors)))
        # Stopping is always safe: spec.suspend (a boolean the CRD schema checks) still suspends a live
        # child whose RLJob became invalid (an edit, or an operator upgrade with stricter validation).
        # Resuming waits for a valid spec.
        if live and suspend_requested and not child_suspended(ptj):
            patches.append(Patch(ChildRef.of(ptj), _suspend_patch(ptj, True)))
    else:
        desired_hash = builders.spec_hash(job)
        finished = finished_before or phase in (PHASE_SUCCEEDED, PHASE_FAILED)
        accepted = (c.TRUE, c.REASON_SPEC_ACCEPTED,
                    f"The spec is valid; {child_label} runs it.")
        ensure_aux = observed.ensure_all or phase == PHASE_ABSENT
        if foreign:
            kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in foreign)
            notes.append(f"waiting for {kinds}, which this RLJob does not own, to go away")
            requeue = REQUEUE_WAITING
        elif phase == PHASE_DELETING:
            requeue = REQUEUE_WAITING
        elif phase == PHASE_ABSENT:
            if not finished:
                creates.extend(_creates(job, settings, cm, ensure_aux, old_status, desired_hash))
                will_create_ptj = True
        elif _hash_of(ptj) == desired_hash:
            if not finished:
                live_suspend = child_suspended(ptj)
                # Kueue owns un-suspending a queue-managed child (admission), and suspends it to
                # preempt it: the operator only ever suspends it, for the user's spec.suspend.
                wanted = job.spec.suspend or (live_suspend and builders.queue_name(ptj) is not None)
                if live_suspend != wanted:
                    patches.append(Patch(ChildRef.of(ptj), _suspend_patch(ptj, wanted)))
            creates.extend(_aux_and_configmap(job, settings, cm, ensure_aux, desired_hash))
            patches.extend(_configmap_patch(job, settings, cm, desired_hash))
        else:
            launched = _launched_spec(cm)
            changed = changed_fields(launched, builders.spec_document(job)) if launched else []
            what = ", ".join(changed) if changed else "launch-time fields"
            if finished:
                accepted = (c.FALSE, c.REASON_SPEC_CHANGE_REJECTED,
                            (f"{what} changed after the job finished; a finished RLJob does not run again, "
                            "so create a new RLJob to train with the new spec."))
            elif job.spec.suspend or _stopped(phase, ptj):
                # Suspended now, or the child still is: the edit that resumes the job (suspend: false in the
                # same apply) is applied too, and the new child starts at once.
                starts = "it starts on resume" if job.spec.suspend else "it starts now"
                deletes.append(Delete(ChildRef.of(ptj), Event(
                    "Normal", c.EVENT_SPEC_CHANGE_APPLIED,
                    f"{what} changed while suspended: replacing {child_label} with one built from the "
                    f"new spec; {starts} and continues from the last checkpoint.")))
                patches.extend(_configmap_patch(job, settings, cm, desired_hash))
                requeue = REQUEUE_WAITING
                phase = PHASE_DELETING
                replacing = True
            else:
                state = ("waits in its Kueue queue" if builders.queue_name(ptj) and child_suspended(ptj)
                         else "runs")
                accepted = (c.FALSE, c.REASON_SPEC_CHANGE_REJECTED,
                            (f"{what} changed while the job {state}; these fields are fixed at launch. Revert "
                            "the change, or set spec.suspend: true to apply it (the child is then "
                            "recreated from the new spec and resumes from the last checkpoint)."))

    # ------------------------------------------------------------------ conditions
    conds = list(old_conds)

    def put(type_: str, status: str, reason: str, message: str) -> None:
        nonlocal conds
        conds = c.set_condition(conds, type_, status, reason, _clip(message), generation=generation, now=now)

    child_msg = (phase_cond or {}).get("message") or ""
    child_reason = (phase_cond or {}).get("reason")

    # Terminal conditions are sticky: a finished job stays finished even when its PyTorchJob is gone.
    succeeded = c.is_true(old_conds, c.SUCCEEDED) or (phase == PHASE_SUCCEEDED and not c.is_true(old_conds, c.FAILED))
    failed = not succeeded and (c.is_true(old_conds, c.FAILED) or phase == PHASE_FAILED)
    if succeeded:
        old = c.get_condition(old_conds, c.SUCCEEDED)
        msg = old["message"] if old and old.get("status") == c.TRUE else (child_msg or "Training finished.")
        succeeded_cond = (c.TRUE, c.REASON_JOBSET_SUCCEEDED if child_label.startswith(builders.JOBSET_KIND)
                          else c.REASON_PYTORCHJOB_SUCCEEDED, msg)
    else:
        succeeded_cond = (c.FALSE, c.REASON_NOT_COMPLETED, "The job has not finished.")
    if failed:
        old = c.get_condition(old_conds, c.FAILED)
        if old and old.get("status") == c.TRUE:
            reason, msg = old["reason"], old["message"]
        else:
            reason = child_reason if c.is_reason(child_reason) else (
                c.REASON_JOBSET_FAILED if child_label.startswith(builders.JOBSET_KIND) else c.REASON_PYTORCHJOB_FAILED)
            msg = child_msg or f"{child_label} failed."
        failed_cond = (c.TRUE, reason, msg)
    else:
        failed_cond = (c.FALSE, c.REASON_NOT_FAILED, "The job has not failed.")
    queue = builders.queue_name(ptj) if ptj is not None else (
        builders.queue_labels(job).get(builders.LABEL_KUEUE_QUEUE) if job is not None and will_create_ptj else None)
    queued = queue is not None and not suspend_requested and (will_create_ptj or child_suspended(ptj))
    running_cond = _running_condition(phase, child_label, child_msg, succeeded, failed, job is None,
                                      will_create_ptj, suspend_requested, requeue is not None and bool(foreign),
                                      queue if queued else None, child_reason)
    suspended_cond = _suspended_condition(phase, ptj, suspend_requested, succeeded or failed, old_conds, child_label,
                                          job is None)
    for type_, (status_, reason_, message_) in zip(
            c.CONDITION_TYPES, (accepted, running_cond, succeeded_cond, failed_cond, suspended_cond)):
        put(type_, status_, reason_, message_)
    no_workload, wait = _kueue_ignores(ptj, queued, observed, settings)
    if wait is not None:
        requeue = wait if requeue is None else min(requeue, wait)
    admitted_cond = _admitted_condition(queue, queued, suspend_requested, succeeded or failed, child_label,
                                        no_workload, observed.kueue_missing)
    if admitted_cond is not None:
        put(c.ADMITTED, *admitted_cond)

    # ------------------------------------------------------------------ status fields
    status = copy.deepcopy(old_status)
    status["observedGeneration"] = generation
    status["conditions"] = conds
    # pytorchJobName names the PyTorchJob this RLJob runs; its absence while none exists tells the
    # next create that a missing PyTorchJob was removed on purpose (a replacement), not lost.
    name_key = "jobSetName" if child_label.startswith(builders.JOBSET_KIND) else "pytorchJobName"
    if replacing:
        status.pop("pytorchJobName", None)
        status.pop("jobSetName", None)
    elif (ptj is not None and phase != PHASE_DELETING) or will_create_ptj:
        status.pop("jobSetName" if name_key == "pytorchJobName" else "pytorchJobName", None)
        status[name_key] = ptj_name
    ptj_status = (ptj or {}).get("status") or {}
    if phase in (PHASE_RUNNING, PHASE_RESTARTING, PHASE_SUCCEEDED, PHASE_FAILED) and not status.get("startTime"):
        status["startTime"] = ptj_status.get("startTime") or now
    if (succeeded or failed) and not status.get("completionTime"):
        status["completionTime"] = ptj_status.get("completionTime") or now
    annotation = (meta.get("annotations") or {}).get(PROGRESS_ANNOTATION)
    if annotation and is_newer(annotation, status.get("trainer")):
        try:
            status["trainer"] = decode_progress(annotation)
        except ProgressError as exc:
            notes.append(f"ignoring the {PROGRESS_ANNOTATION} annotation: {exc}")
    events.extend(_quarantine_events(old_status.get("trainer"), status.get("trainer")))
    rewards_cond = _rewards_condition(status.get("trainer"))
    if rewards_cond is not None:
        put(c.REWARDS_HEALTHY, *rewards_cond)
        status["conditions"] = conds
    if job is not None and job.spec.reward.server is not None:
        judge = observed.judge if _owned_by(observed.judge, uid) else None
        idle = suspend_requested or succeeded or failed
        if judge is not None and (judge.get("spec") or {}).get("replicas") != (0 if idle else 1):
            # a suspended or finished job gives the judge's GPUs back; resuming brings it back
            patches.append(Patch(ChildRef.of(judge), {"spec": {"replicas": 0 if idle else 1}}))
        put(c.JUDGE_READY, *_judge_condition(judge, idle, succeeded or failed))
        status["conditions"] = conds

    # ------------------------------------------------------------------ events from transitions
    events.extend(_transition_events(old_conds, conds, child_label))
    new_status = None if status == old_status else status
    return Plan(create=tuple(creates), patch=tuple(patches), delete=tuple(deletes), status=new_status,
                events=tuple(events), requeue_after=requeue, accepted=job is not None, notes=tuple(notes))


def _creates(job: RLJob, settings: OperatorSettings, cm: Mapping[str, Any] | None, ensure_aux: bool,
             old_status: Mapping[str, Any], desired_hash: str) -> list[Create]:
    out = _aux_and_configmap(job, settings, cm, ensure_aux, desired_hash)
    child = builders.build_child(job, settings)
    label = f"{child['kind']} {child['metadata']['name']}"
    # The name in the status means the child existed (a replacement removes it first): it went missing.
    if old_status.get("pytorchJobName") or old_status.get("jobSetName"):
        event = Event("Normal", c.EVENT_RECREATED,
                      f"{label} was missing before the job finished; created it again "
                      "(training resumes from the last committed checkpoint).")
    else:
        event = Event("Normal", c.EVENT_CREATED, f"Created {label}.")
    out.append(Create(child, event))
    return out


def _aux_and_configmap(job: RLJob, settings: OperatorSettings, cm: Mapping[str, Any] | None, ensure_aux: bool,
                       desired_hash: str) -> list[Create]:
    out: list[Create] = []
    for child in builders.build_children(job, settings):
        kind = child["kind"]
        if kind in (builders.PYTORCHJOB_KIND, builders.JOBSET_KIND):
            continue
        if kind == "ConfigMap":
            if cm is None:
                out.append(Create(child))
        elif ensure_aux:
            out.append(Create(child))
    return out


def _configmap_patch(job: RLJob, settings: OperatorSettings, cm: Mapping[str, Any] | None,
                     desired_hash: str) -> list[Patch]:
    if cm is None or _hash_of(cm) == desired_hash:
        return []
    want = builders.build_spec_configmap(job, settings)
    body = {"metadata": {"annotations": want["metadata"]["annotations"]}, "data": want["data"]}
    return [Patch(ChildRef.of(want), body)]


def _stopped(phase: str, child: Mapping[str, Any] | None) -> bool:
    """A child the user suspended that has no pods: reported Suspended, or suspended before it ever ran.
    Not a Kueue-managed one: replacing it would give up its place in the queue."""
    if builders.queue_name(child) is not None:
        return False
    return phase == PHASE_SUSPENDED or (phase == PHASE_PENDING and child_suspended(child))


def child_suspended(child: Mapping[str, Any] | None) -> bool:
    spec = (child or {}).get("spec") or {}
    if (child or {}).get("kind") == builders.JOBSET_KIND:
        return bool(spec.get("suspend"))
    return bool((spec.get("runPolicy") or {}).get("suspend"))


def _suspend_patch(child: Mapping[str, Any], suspend: bool) -> dict[str, Any]:
    if child.get("kind") == builders.JOBSET_KIND:
        return {"spec": {"suspend": suspend}}
    return {"spec": {"runPolicy": {"suspend": suspend}}}


def _parse_time(value: Any) -> datetime.datetime | None:
    try:
        return datetime.datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return None


def owned_workloads(child: Mapping[str, Any] | None,
                    workloads: tuple[Mapping[str, Any], ...]) -> list[Mapping[str, Any]]:
    """The Kueue Workloads among `workloads` whose ownerReferences name `child` (by uid)."""
    uid = ((child or {}).get("metadata") or {}).get("uid")
    return [w for w in workloads if uid and any(
        r.get("uid") == uid for r in (w.get("metadata") or {}).get("ownerReferences") or ())]


def _kueue_ignores(child: Mapping[str, Any] | None, queued: bool, observed: Observed,
                   settings: OperatorSettings) -> tuple[bool, float | None]:
    """(whether Kueue has ignored the queued child past the grace period, seconds until that is decided)."""
    workloads = () if observed.kueue_missing else observed.workloads
    if not queued or child is None or workloads is None or owned_workloads(child, workloads):
        return False, None
    created = _parse_time((child.get("metadata") or {}).get("creationTimestamp"))
    now = _parse_time(observed.now)
    if created is None or now is None:
        return False, None
    left = settings.kueue_workload_grace_seconds - (now - created).total_seconds()
    if left > 0:
        return False, left + 1.0  # the timestamps have whole seconds
    return True, None


# Kueue's integrations.frameworks names of the child kinds.
KUEUE_FRAMEWORKS = {builders.PYTORCHJOB_KIND: "kubeflow.org/pytorchjob", builders.JOBSET_KIND: "jobset.x-k8s.io/jobset"}


def _admitted_condition(queue: str | None, queued: bool, suspend: bool, finished: bool,
                        ptj_name: str, no_workload: bool = False,
                        kueue_missing: bool = False) -> tuple[str, str, str] | None:
    """Kueue's admission of a queue-managed job; None (condition left as it is) otherwise or once finished."""
    if queue is None or finished:
        return None
    if suspend:
        return (c.FALSE, c.REASON_SUSPENDED,
                f"spec.suspend is true; Kueue (LocalQueue {queue}) admits {ptj_name} after a resume.")
    if queued and no_workload and kueue_missing:
        return (c.FALSE, c.REASON_NO_KUEUE_WORKLOAD, (
            f"{ptj_name} carries the kueue.x-k8s.io/queue-name label {queue}, but this cluster serves no Kueue "
            "Workloads (kueue.x-k8s.io/v1beta2): Kueue is not installed (or is older than 0.15), so nothing will "
            "un-suspend it. Fix: install Kueue, or delete this RLJob and create it again without the kueue.x-k8s.io "
            "labels (they are read when the child is created)."))
    if queued and no_workload:
        kind = ptj_name.split(" ", 1)[0]
        return (c.FALSE, c.REASON_NO_KUEUE_WORKLOAD, (
            f"{ptj_name} carries the kueue.x-k8s.io/queue-name label {queue} but no Kueue Workload owns it, "
            f"so Kueue does not manage {kind}s on this cluster and nothing will un-suspend it (Kueue >= 0.19 "
            "leaves kubeflow.org/pytorchjob out of its default integrations). Fix: enable "
            f"{KUEUE_FRAMEWORKS.get(kind, kind)} in Kueue's integrations.frameworks, or set spec.childKind: "
            "JobSet (which Kueue manages by default) while the job is suspended."))
    if queued:
        return (c.FALSE, c.REASON_QUEUED,
                (f"{ptj_name} waits in Kueue LocalQueue {queue} for admission; it stays suspended "
                 "until Kueue admits it."))
    return c.TRUE, c.REASON_ADMITTED, f"Kueue admitted {ptj_name} from LocalQueue {queue}."


def _quarantine_events(old_trainer: Mapping[str, Any] | None,
                       new_trainer: Mapping[str, Any] | None) -> list[Event]:
    """One Warning per quarantined step the status did not list yet (so not again on every reconcile)."""
    seen = {(q.get("step"), q.get("uri")) for q in (old_trainer or {}).get("quarantinedCheckpoints") or ()}
    out = []
    for q in (new_trainer or {}).get("quarantinedCheckpoints") or ():
        if (q["step"], q["uri"]) in seen:
            continue
        why = f" ({q['reason']})" if q.get("reason") else ""
        out.append(Event("Warning", c.EVENT_CHECKPOINT_QUARANTINED, _clip(
            f"Checkpoint step {q['step']} failed its checksums{why}; moved to {q['uri']} for inspection and "
            "training resumed from the previous committed step.")))
    return out


def _rewards_condition(trainer: Mapping[str, Any] | None) -> tuple[str, str, str] | None:
    """RewardsHealthy False once the worker has counted non-finite rewards; None while it has not."""
    count = (trainer or {}).get("nonfiniteRewards")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    return (c.FALSE, c.REASON_NONFINITE_REWARDS,
            (f"The reward function returned {count} non-finite (nan/inf) reward(s) so far; they were scored 0. "
             "Check the reward function for divisions by zero or unbounded values (metric rljob_reward_nonfinite)."))


def _judge_condition(judge: Mapping[str, Any] | None, idle: bool, finished: bool) -> tuple[str, str, str]:
    """JudgeReady from the judge Deployment's status (conditions.py lists the reasons)."""
    if judge is None:
        return (c.FALSE, c.REASON_JUDGE_MISSING,
                ("The judge Deployment of spec.reward.server does not exist yet; "
                 "the operator creates it with the job (and again on its next resync if it was deleted)."))
    name = judge["metadata"]["name"]
    if idle:
        why = "finished" if finished else "suspended"
        return (c.FALSE, c.REASON_JUDGE_SCALED_DOWN,
                f"Deployment {name} is scaled to 0 while the job is {why}" +
                ("." if finished else "; it starts again when spec.suspend is false."))
    status = judge.get("status") or {}
    available = int(status.get("availableReplicas") or 0)
    if available > 0:
        return (c.TRUE, c.REASON_JUDGE_READY,
                (f"Deployment {name} has {available} available replica(s) serving "
                 "the judge on its Service."))
    progressing = next((x for x in status.get("conditions") or () if x.get("type") == "Progressing"), None)
    if progressing and progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded":
        return (c.FALSE, c.REASON_JUDGE_STUCK,
                (f"Deployment {name} made no progress: {progressing.get('message', '')} "
                 f"Check its pods (kubectl describe deploy {name}): image, GPU quota, model download."))
    return (c.FALSE, c.REASON_JUDGE_STARTING,
            (f"Deployment {name} has no ready replica yet (the pod is scheduled, "
             "pulling its image or loading the model until its /health probe passes); scoring waits for it."))


def _running_condition(phase: str, ptj_name: str, child_msg: str, succeeded: bool, failed: bool, invalid: bool,
                       will_create: bool, suspend: bool, waiting_foreign: bool,
                       queue: str | None = None, child_reason: str | None = None) -> tuple[str, str, str]:
    if succeeded:
        return c.FALSE, c.REASON_COMPLETED, "The job succeeded."
    if failed:
        return c.FALSE, c.REASON_JOB_FAILED, "The job failed."
    if phase == PHASE_RUNNING:  # until the PyTorchJob reports otherwise, even while suspending
        reason = c.REASON_JOBSET_RUNNING if child_reason == c.REASON_JOBSET_RUNNING else c.REASON_PYTORCHJOB_RUNNING
        return c.TRUE, reason, child_msg or f"{ptj_name} is running."
    if phase == PHASE_RESTARTING:
        return c.FALSE, c.REASON_RESTARTING, child_msg or f"{ptj_name} is restarting failed pods."
    if suspend and phase in (PHASE_SUSPENDED, PHASE_PENDING, PHASE_ABSENT, PHASE_DELETING):
        return c.FALSE, c.REASON_JOB_SUSPENDED, "The job is suspended (spec.suspend is true)."
    if invalid and queue is None and phase == PHASE_SUSPENDED:
        return c.FALSE, c.REASON_JOB_SUSPENDED, "The job stays suspended while the spec is invalid (see Accepted)."
    if queue is not None and phase in (PHASE_SUSPENDED, PHASE_PENDING, PHASE_ABSENT):
        return (c.FALSE, c.REASON_QUEUED,
                (f"{ptj_name} waits for Kueue to admit it from LocalQueue {queue} (after a preemption, "
                 "training resumes from the last committed checkpoint)."))
    if waiting_foreign:
        return (c.FALSE, c.REASON_CREATING,
                f"Waiting for an object named after this RLJob ({ptj_name}) that it does not own to be deleted.")
    if phase == PHASE_DELETING:
        return c.FALSE, c.REASON_CREATING, f"Waiting for the previous {ptj_name} to be deleted."
    if phase == PHASE_ABSENT:
        if invalid:
            return c.FALSE, c.REASON_NOT_STARTED, "Nothing runs because the spec is invalid."
        if will_create:  # the status is written after the creates succeeded
            return c.FALSE, c.REASON_PENDING, f"{ptj_name} exists; waiting for its pods to run."
        return c.FALSE, c.REASON_NOT_STARTED, f"No {ptj_name} exists."
    if phase == PHASE_SUSPENDED:
        return c.FALSE, c.REASON_PENDING, f"Resuming {ptj_name}."
    return c.FALSE, c.REASON_PENDING, f"{ptj_name} exists; waiting for its pods to run."


def _suspended_condition(phase: str, ptj: Mapping[str, Any] | None, suspend: bool, finished: bool,
                         old_conds: list[Mapping[str, Any]], ptj_name: str, invalid: bool) -> tuple[str, str, str]:
    was = c.get_condition(old_conds, c.SUSPENDED)
    if finished:
        return c.FALSE, c.REASON_NOT_SUSPENDED, "The job has finished."
    if suspend and not (invalid and ptj is None):
        never_started = phase == PHASE_PENDING and child_suspended(ptj)
        if phase in (PHASE_SUSPENDED, PHASE_ABSENT, PHASE_DELETING) or never_started:
            return c.TRUE, c.REASON_SUSPENDED, "spec.suspend is true: the pods are gone; set it false to resume."
        return c.FALSE, c.REASON_SUSPENDING, f"Waiting for {ptj_name} to stop its pods."
    if invalid and ptj is not None and child_suspended(ptj) and builders.queue_name(ptj) is None:
        return (c.TRUE, c.REASON_SUSPENDED,
                "spec.suspend is false, but the spec is invalid (see Accepted): the job stays suspended until it is fixed.")
    if was is not None and (was.get("status") == c.TRUE or was.get("reason") == c.REASON_RESUMED):
        return c.FALSE, c.REASON_RESUMED, "The job was resumed; training continues from the last checkpoint."
    return c.FALSE, c.REASON_NOT_SUSPENDED, "The job is not suspended."


def _transition_events(old: list[Mapping[str, Any]], new: list[Mapping[str, Any]],
                       child_label: str = "PyTorchJob") -> list[Event]:
    out: list[Event] = []
    for cond in new:
        before = c.get_condition(old, cond["type"])
        b_status = None if before is None else before.get("status")
        b_reason = None if before is None else before.get("reason")
        t, status, reason, message = cond["type"], cond["status"], cond["reason"], cond["message"]
        if t == c.ACCEPTED:
            if status == c.TRUE and b_status != c.TRUE:
                out.append(Event("Normal", reason, message))
            elif status == c.FALSE and (b_status != c.FALSE or b_reason != reason
                                        or (before or {}).get("message") != message):
                out.append(Event("Warning", reason, message))
        elif t == c.RUNNING:
            if status == c.TRUE and b_status != c.TRUE:
                out.append(Event("Normal", c.EVENT_RUNNING, message))
            elif reason == c.REASON_RESTARTING and b_reason != c.REASON_RESTARTING:
                out.append(Event("Warning", c.REASON_RESTARTING, message))
        elif t == c.SUSPENDED:
            if status == c.TRUE and b_status != c.TRUE:
                out.append(Event("Normal", c.REASON_SUSPENDED, message))
            elif status == c.FALSE and b_status == c.TRUE:
                out.append(Event("Normal", c.REASON_RESUMED, message))
        elif t == c.ADMITTED:
            if status == c.TRUE and b_status != c.TRUE:
                out.append(Event("Normal", c.REASON_ADMITTED, message))
            elif reason == c.REASON_NO_KUEUE_WORKLOAD and b_reason != reason:
                out.append(Event("Warning", reason, message))
            elif b_reason == c.REASON_NO_KUEUE_WORKLOAD and reason == c.REASON_QUEUED:
                out.append(Event("Normal", c.EVENT_KUEUE_WORKLOAD_FOUND,
                                 "A Kueue Workload now owns the job; it waits for Kueue's admission."))
            elif reason == c.REASON_QUEUED and b_status == c.TRUE:
                out.append(Event("Warning", c.EVENT_PREEMPTED, (
                    f"Kueue suspended the admitted {child_label.split(' ', 1)[0]} (preemption or eviction): its pods get SIGTERM and "
                    "save a checkpoint, as on spec.suspend; training resumes from it when Kueue admits the job "
                    "again.")))
        elif t == c.REWARDS_HEALTHY and status == c.FALSE and b_status != c.FALSE:
            out.append(Event("Warning", reason, message))  # once, when the first non-finite reward is reported
        elif t == c.SUCCEEDED and status == c.TRUE and b_status != c.TRUE:
            out.append(Event("Normal", c.EVENT_SUCCEEDED, message))
        elif t == c.FAILED and status == c.TRUE and b_status != c.TRUE:
            out.append(Event("Warning", c.EVENT_FAILED, f"{reason}: {message}"))
    return out


def apply_failed_status(body: Mapping[str, Any], plan: Plan, error: str, now: str) -> dict[str, Any] | None:
    """The status to write when applying `plan` failed with a (retried) API error, or None to write nothing.

    Post `failure_events(body, status)` with it: the conditions it writes (Accepted) do not change
    again on the successful retry, so their events are due now.

    Only a job whose PyTorchJob or JobSet is being created gets `Running=False, reason CreateFailed`; for a
    running job the error is logged and retried without touching its conditions.
    """
    old_status = body.get("status") or {}
    status = copy.deepcopy(plan.status if plan.status is not None else old_status)
    creating = any(item.body.get("kind") in (builders.PYTORCHJOB_KIND, builders.JOBSET_KIND) for item in plan.create)
    if not creating:
        return None
    # The child's name in the status says it existed; it does not yet (else the next successful create
    # would be reported as a recreation of a missing child).
    for key in ("pytorchJobName", "jobSetName"):
        if key not in old_status:
            status.pop(key, None)
    generation = (body.get("metadata") or {}).get("generation")
    status["observedGeneration"] = generation
    status["conditions"] = c.set_condition(
        status.get("conditions"), c.RUNNING, c.FALSE, c.REASON_CREATE_FAILED,
        _clip(f"Creating the children failed and is retried with backoff: {error}"),
        generation=generation, now=now)
    return status


def failure_events(body: Mapping[str, Any], status: Mapping[str, Any]) -> list[Event]:
    """The events of writing `status` (from `apply_failed_status`) over the stored one: the transitions
    it makes (e.g. SpecAccepted) and one Warning when Running first becomes CreateFailed."""
    old = (body.get("status") or {}).get("conditions") or []
    new = status.get("conditions") or []
    out = [e for e in _transition_events(old, new) if e.reason != c.EVENT_RUNNING]
    was = c.get_condition(old, c.RUNNING)
    now = c.get_condition(new, c.RUNNING)
    if now is not None and now.get("reason") == c.REASON_CREATE_FAILED and (was or {}).get("reason") != now["reason"]:
        out.append(Event("Warning", c.REASON_CREATE_FAILED, now["message"]))
    return out
