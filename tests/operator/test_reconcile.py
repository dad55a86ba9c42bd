"""The pure level-based reconcile: tables of (stored RLJob, observed children) -> plan."""
from __future__ import annotations

import copy
import json
from typing import Any

import opschema
import pytest
import yaml
from rljob_api.models import RLJobStatus
from rljob_api.validation import parse_rljob
from rljob_operator import builders
from rljob_operator import conditions as c
from rljob_operator.progress import ANNOTATION, encode_progress
from rljob_operator.reconcile import (
    Observed,
    Plan,
    apply_failed_status,
    changed_fields,
    failure_events,
    reconcile,
)
from rljob_operator.settings import OperatorSettings

SETTINGS = OperatorSettings()
UID = "uid-1"
T0, T1, T2 = "2026-11-26T10:00:00Z", "2026-11-26T10:05:00Z", "2026-11-26T11:00:00Z"


def stored(generation: int = 1, status: dict | None = None, annotations: dict | None = None,
           **spec_changes: Any) -> dict[str, Any]:
    doc = yaml.safe_load((opschema.REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"].update({"namespace": "ns", "uid": UID, "generation": generation,
                            "resourceVersion": "7", "creationTimestamp": T0})
    if annotations:
        doc["metadata"]["annotations"] = annotations
    for path, value in spec_changes.items():
        node = doc["spec"]
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if status is not None:
        doc["status"] = status
    return doc


def children_of(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    job = parse_rljob({k: v for k, v in body.items() if k != "status"} | {
        "metadata": {k: body["metadata"][k] for k in ("name", "namespace", "uid", "generation", "labels")
                     if k in body["metadata"]}})
    return {child["kind"]: child for child in builders.build_children(job, SETTINGS)}


def ptj_of(body: dict[str, Any], *conds: tuple[str, str], suspend: bool | None = None,
           **status: Any) -> dict[str, Any]:
    ptj = copy.deepcopy(children_of(body)["PyTorchJob"])
    if suspend is not None:
        ptj["spec"]["runPolicy"]["suspend"] = suspend
    ptj["status"] = {"conditions": [
        {"type": t, "status": "True", "reason": reason, "message": f"{t} message"} for t, reason in conds
    ], **status}
    return ptj


def cm_of(body: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(children_of(body)["ConfigMap"])


def cond(plan_or_status: Plan | dict, type_: str) -> dict[str, Any]:
    status = plan_or_status.status if isinstance(plan_or_status, Plan) else plan_or_status
    found = c.get_condition(status["conditions"], type_)
    assert found is not None, f"no {type_} condition in {status}"
    return dict(found)


def summary(plan: Plan) -> dict[str, Any]:
    return {t: (cond(plan, t)["status"], cond(plan, t)["reason"]) for t in c.CONDITION_TYPES}


def step(body: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The stored object after the plan's status write."""
    body = copy.deepcopy(body)
    if plan.status is not None:
        body["status"] = plan.status
    return body


def assert_valid_status(status: dict[str, Any]) -> None:
    RLJobStatus.model_validate(status)  # the status always fits the CRD's status schema
    body = stored(status=status)
    assert opschema.rljob_schema_errors(body) == []
    assert opschema.dropped_fields(body) == [], "a real API server would prune these status fields silently"


# ---------------------------------------------------------------------------- creation


def test_new_job_creates_every_child_and_reports_creating() -> None:
    body = stored()
    plan = reconcile(body, Observed(now=T0), SETTINGS)
    assert [cr.body["kind"] for cr in plan.create] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                                       "PyTorchJob"]
    assert plan.create[-1].event.reason == c.EVENT_CREATED
    assert not plan.patch and not plan.delete
    assert summary(plan) == {
        c.ACCEPTED: ("True", c.REASON_SPEC_ACCEPTED),
        c.RUNNING: ("False", c.REASON_PENDING),  # the status is written after the creates
        c.SUCCEEDED: ("False", c.REASON_NOT_COMPLETED),
        c.FAILED: ("False", c.REASON_NOT_FAILED),
        c.SUSPENDED: ("False", c.REASON_NOT_SUSPENDED),
    }
    assert plan.status["observedGeneration"] == 1
    assert plan.status["pytorchJobName"] == "quickstart"
    assert all(x["observedGeneration"] == 1 and x["lastTransitionTime"] == T0 for x in plan.status["conditions"])
    assert [e.reason for e in plan.events] == [c.REASON_SPEC_ACCEPTED]
    assert_valid_status(plan.status)


def test_invalid_spec_creates_nothing_and_names_the_field() -> None:
    body = stored(megatron__tensorModelParallelSize=3)
    plan = reconcile(body, Observed(now=T0), SETTINGS)
    assert plan.create == () and plan.patch == () and plan.delete == ()
    assert plan.accepted is False
    accepted = cond(plan, c.ACCEPTED)
    assert (accepted["status"], accepted["reason"]) == ("False", c.REASON_INVALID_SPEC)
    assert "spec.megatron.tensorModelParallelSize" in accepted["message"]
    assert cond(plan, c.RUNNING)["reason"] == c.REASON_NOT_STARTED
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", c.REASON_INVALID_SPEC)]
    assert "pytorchJobName" not in plan.status
    assert_valid_status(plan.status)
    # Level-based and idempotent: reconciling the stored result again writes nothing, posts nothing.
    again = reconcile(step(body, plan), Observed(now=T2), SETTINGS)
    assert again.status is None and again.events == () and again.create == ()


def test_schema_level_garbage_is_reported_not_raised() -> None:
    body = stored()
    body["spec"]["nnodes"] = "many"
    body["spec"]["bogus"] = 1
    plan = reconcile(body, Observed(now=T0), SETTINGS)
    message = cond(plan, c.ACCEPTED)["message"]
    assert "spec.nnodes" in message and "spec.bogus" in message
    assert plan.create == ()


def test_fixing_an_invalid_spec_accepts_it_and_creates() -> None:
    bad = stored(megatron__tensorModelParallelSize=3)
    plan = reconcile(bad, Observed(now=T0), SETTINGS)
    fixed = step(stored(generation=2), plan)
    plan = reconcile(fixed, Observed(now=T1), SETTINGS)
    assert cond(plan, c.ACCEPTED)["status"] == "True" and cond(plan, c.ACCEPTED)["lastTransitionTime"] == T1
    assert cond(plan, c.ACCEPTED)["observedGeneration"] == 2
    assert plan.status["observedGeneration"] == 2
    assert any(cr.body["kind"] == "PyTorchJob" for cr in plan.create)


def test_a_running_job_whose_spec_turned_invalid_still_suspends_and_does_not_resume() -> None:
    """An invalid edit (or an operator upgrade with stricter rules) leaves the running child on its last
    accepted spec; spec.suspend: true still stops it, and suspend: false does not restart it until the
    spec is fixed. The conditions say so instead of 'nothing was created' and 'not suspended'."""
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    running = ptj_of(body, ("Running", "PyTorchJobRunning"))
    body = step(body, reconcile(body, Observed(now=T0, pytorchjob=running, configmap=cm), SETTINGS))
    bad = stored(generation=2, status=body["status"], suspend=True, megatron__tensorModelParallelSize=3)
    plan = reconcile(bad, Observed(now=T1, pytorchjob=running, configmap=cm), SETTINGS)
    assert [(p.ref.name, p.body) for p in plan.patch] == [("quickstart", {"spec": {"runPolicy": {"suspend": True}}})]
    assert plan.create == () and plan.delete == ()
    accepted = cond(plan, c.ACCEPTED)
    assert accepted["reason"] == c.REASON_INVALID_SPEC and "spec.megatron.tensorModelParallelSize" in accepted["message"]
    assert "nothing was created" not in accepted["message"] and "PyTorchJob quickstart" in accepted["message"]
    assert summary(plan)[c.SUSPENDED] == ("False", c.REASON_SUSPENDING)
    # The training-operator stopped the pods: Suspended.
    stopped = ptj_of(body, ("Suspended", "PyTorchJobSuspended"), suspend=True)  # built from the valid spec
    body = step(bad, plan)
    plan = reconcile(body, Observed(now=T1, pytorchjob=stopped, configmap=cm), SETTINGS)
    assert plan.patch == ()
    body = step(body, plan)
    assert (cond(body["status"], c.SUSPENDED)["status"], cond(body["status"], c.SUSPENDED)["reason"]) == (
        "True", c.REASON_SUSPENDED)
    # Resuming with the spec still invalid: the child stays suspended, and no condition claims a resume.
    resumed = stored(generation=3, status=body["status"], megatron__tensorModelParallelSize=3)
    plan = reconcile(resumed, Observed(now=T2, pytorchjob=stopped, configmap=cm), SETTINGS)
    assert plan.patch == () and plan.create == () and plan.delete == ()
    after = step(resumed, plan)["status"]
    assert (cond(after, c.SUSPENDED)["status"], cond(after, c.SUSPENDED)["reason"]) == ("True", c.REASON_SUSPENDED)
    assert "invalid" in cond(after, c.SUSPENDED)["message"]
    assert cond(after, c.RUNNING)["reason"] == c.REASON_JOB_SUSPENDED
    assert c.REASON_RESUMED not in [e.reason for e in plan.events]
    assert_valid_status(after)
    # Fixed: the job resumes.
    fixed = stored(generation=4, status=after)
    plan = reconcile(fixed, Observed(now=T2, pytorchjob=stopped, configmap=cm), SETTINGS)
    assert [p.body for p in plan.patch] == [{"spec": {"runPolicy": {"suspend": False}}}]
    assert summary(plan)[c.ACCEPTED] == ("True", c.REASON_SPEC_ACCEPTED)


# ---------------------------------------------------------------------------- mirroring the PyTorchJob

PTJ_TABLE = [
    # PyTorchJob conditions, expected (Running, Succeeded, Failed) (status, reason), events
    ((("Created", "PyTorchJobCreated"),), ("False", c.REASON_PENDING), ("False", c.REASON_NOT_COMPLETED),
     ("False", c.REASON_NOT_FAILED), []),
    ((("Created", "PyTorchJobCreated"), ("Running", "PyTorchJobRunning")), ("True", c.REASON_PYTORCHJOB_RUNNING),
     ("False", c.REASON_NOT_COMPLETED), ("False", c.REASON_NOT_FAILED), [("Normal", c.EVENT_RUNNING)]),
    ((("Created", "PyTorchJobCreated"), ("Restarting", "PyTorchJobRestarting")), ("False", c.REASON_RESTARTING),
     ("False", c.REASON_NOT_COMPLETED), ("False", c.REASON_NOT_FAILED), [("Warning", c.REASON_RESTARTING)]),
    ((("Created", "PyTorchJobCreated"), ("Succeeded", "PyTorchJobSucceeded")), ("False", c.REASON_COMPLETED),
     ("True", c.REASON_PYTORCHJOB_SUCCEEDED), ("False", c.REASON_NOT_FAILED), [("Normal", c.EVENT_SUCCEEDED)]),
    ((("Created", "PyTorchJobCreated"), ("Failed", "BackoffLimitExceeded")), ("False", c.REASON_JOB_FAILED),
     ("False", c.REASON_NOT_COMPLETED), ("True", "BackoffLimitExceeded"), [("Warning", c.EVENT_FAILED)]),
    ((("Failed", "not a camel word!"),), ("False", c.REASON_JOB_FAILED),
     ("False", c.REASON_NOT_COMPLETED), ("True", c.REASON_PYTORCHJOB_FAILED), [("Warning", c.EVENT_FAILED)]),
]


@pytest.mark.parametrize(("ptj_conds", "running", "succeeded", "failed", "events"), PTJ_TABLE)
def test_conditions_mirror_the_pytorchjob(ptj_conds, running, succeeded, failed, events) -> None:
    created = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    ptj = ptj_of(created, *ptj_conds, startTime=T1, completionTime=T2)
    plan = reconcile(created, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(created)), SETTINGS)
    status = plan.status if plan.status is not None else created["status"]
    assert (cond(status, c.RUNNING)["status"], cond(status, c.RUNNING)["reason"]) == running
    assert (cond(status, c.SUCCEEDED)["status"], cond(status, c.SUCCEEDED)["reason"]) == succeeded
    assert (cond(status, c.FAILED)["status"], cond(status, c.FAILED)["reason"]) == failed
    assert [(e.type, e.reason) for e in plan.events] == events
    assert plan.create == () and plan.delete == ()
    if running[0] == "True" or succeeded[0] == "True" or failed[0] == "True" or running[1] == c.REASON_RESTARTING:
        assert status["startTime"] == T1
    if succeeded[0] == "True" or failed[0] == "True":
        assert status["completionTime"] == T2
        assert cond(status, c.SUCCEEDED if succeeded[0] == "True" else c.FAILED)["message"] == (
            f"{ptj_conds[-1][0]} message")
    assert_valid_status(status)


def test_finished_job_is_sticky_and_not_recreated() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    done = ptj_of(body, ("Succeeded", "PyTorchJobSucceeded"))
    body = step(body, reconcile(body, Observed(now=T1, pytorchjob=done, configmap=cm_of(body)), SETTINGS))
    plan = reconcile(body, Observed(now=T2), SETTINGS)  # the PyTorchJob is gone (TTL, or by hand)
    assert plan.create == ()
    assert plan.status is None  # nothing changes: still Succeeded, same transition times


def test_hand_deleted_pytorchjob_is_recreated_before_the_job_finished() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    running = ptj_of(body, ("Running", "PyTorchJobRunning"))
    body = step(body, reconcile(body, Observed(now=T1, pytorchjob=running, configmap=cm_of(body)), SETTINGS))
    plan = reconcile(body, Observed(now=T2, configmap=cm_of(body)), SETTINGS)
    kinds = [cr.body["kind"] for cr in plan.create]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "PyTorchJob"], "the ConfigMap is still there"
    assert plan.create[-1].event.reason == c.EVENT_RECREATED
    assert cond(plan, c.RUNNING)["reason"] == c.REASON_PENDING


def test_pytorchjob_being_deleted_is_waited_for() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    ptj["metadata"]["deletionTimestamp"] = T1
    plan = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert plan.create == () and plan.requeue_after


def test_foreign_child_with_our_name_is_never_touched() -> None:
    body = stored()
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    ptj["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    plan = reconcile(body, Observed(now=T0, pytorchjob=ptj), SETTINGS)
    assert plan.create == () and plan.patch == () and plan.delete == ()
    assert plan.requeue_after
    assert cond(plan, c.RUNNING)["status"] == "False"  # it does not report someone else's job as ours
    assert "does not own" in cond(plan, c.RUNNING)["message"]


def test_ensure_all_recreates_missing_auxiliary_children() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    plain = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert plain.create == ()
    resync = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body), ensure_all=True), SETTINGS)
    assert [cr.body["kind"] for cr in resync.create] == ["ServiceAccount", "Role", "RoleBinding"]
    missing_cm = reconcile(body, Observed(now=T1, pytorchjob=ptj), SETTINGS)
    assert [cr.body["kind"] for cr in missing_cm.create] == ["ConfigMap"]


# ---------------------------------------------------------------------------- suspend / resume


def test_suspend_and_resume_cycle() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    running = ptj_of(body, ("Running", "PyTorchJobRunning"), suspend=False)
    body = step(body, reconcile(body, Observed(now=T0, pytorchjob=running, configmap=cm), SETTINGS))

    # 1. spec.suspend: true -> the PyTorchJob's runPolicy.suspend is patched; still running until it stops.
    suspending = stored(generation=2, status=body["status"], suspend=True)
    plan = reconcile(suspending, Observed(now=T1, pytorchjob=running, configmap=cm), SETTINGS)
    assert [p.body for p in plan.patch] == [{"spec": {"runPolicy": {"suspend": True}}}]
    assert plan.patch[0].ref.kind == "PyTorchJob"
    assert cond(plan, c.SUSPENDED)["reason"] == c.REASON_SUSPENDING
    assert cond(plan, c.RUNNING)["status"] == "True"
    assert plan.create == ()  # suspend is not a spec change: the ConfigMap stays

    # 2. The training-operator stops the pods and reports Suspended.
    body = step(suspending, plan)
    stopped = ptj_of(body, ("Suspended", "PyTorchJobSuspended"), suspend=True)
    plan = reconcile(body, Observed(now=T1, pytorchjob=stopped, configmap=cm), SETTINGS)
    assert plan.patch == ()
    assert summary(plan)[c.SUSPENDED] == ("True", c.REASON_SUSPENDED)
    assert summary(plan)[c.RUNNING] == ("False", c.REASON_JOB_SUSPENDED)
    assert [e.reason for e in plan.events] == [c.REASON_SUSPENDED]

    # 3. spec.suspend: false -> patched back; Resumed.
    body = step(body, plan)
    resuming = stored(generation=3, status=body["status"], suspend=False)
    plan = reconcile(resuming, Observed(now=T2, pytorchjob=stopped, configmap=cm), SETTINGS)
    assert [p.body for p in plan.patch] == [{"spec": {"runPolicy": {"suspend": False}}}]
    assert summary(plan)[c.SUSPENDED] == ("False", c.REASON_RESUMED)
    assert cond(plan, c.SUSPENDED)["lastTransitionTime"] == T2
    assert [e.reason for e in plan.events] == [c.REASON_RESUMED]
    assert_valid_status(plan.status)


def test_created_suspended_counts_as_suspended() -> None:
    body = stored(suspend=True)
    plan = reconcile(body, Observed(now=T0), SETTINGS)
    ptj = next(cr.body for cr in plan.create if cr.body["kind"] == "PyTorchJob")
    assert ptj["spec"]["runPolicy"]["suspend"] is True
    assert summary(plan)[c.SUSPENDED] == ("True", c.REASON_SUSPENDED)
    body = step(body, plan)
    plan = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert plan.status is None  # never started, still suspended: nothing to write


# ---------------------------------------------------------------------------- Kueue

QUEUE = {builders.LABEL_KUEUE_QUEUE: "team-a", builders.LABEL_KUEUE_PRIORITY: "low"}


def queued_job(**kwargs: Any) -> dict[str, Any]:
    body = stored(**kwargs)
    body["metadata"]["labels"] = {**QUEUE, "team": "rl"}
    return body


def test_queue_labels_reach_the_pytorchjob_which_starts_suspended() -> None:
    plan = reconcile(queued_job(), Observed(now=T0), SETTINGS)
    ptj = next(cr.body for cr in plan.create if cr.body["kind"] == "PyTorchJob")
    assert QUEUE.items() <= ptj["metadata"]["labels"].items() and "team" not in ptj["metadata"]["labels"]
    assert ptj["spec"]["runPolicy"]["suspend"] is True, "Kueue admits a job by un-suspending it"
    assert all(builders.LABEL_KUEUE_QUEUE not in cr.body["metadata"]["labels"] for cr in plan.create[:-1])
    assert summary(plan)[c.RUNNING] == ("False", c.REASON_QUEUED)
    assert summary(plan)[c.SUSPENDED] == ("False", c.REASON_NOT_SUSPENDED), "spec.suspend stays the user's intent"
    assert (cond(plan, c.ADMITTED)["status"], cond(plan, c.ADMITTED)["reason"]) == ("False", c.REASON_QUEUED)
    assert "team-a" in cond(plan, c.ADMITTED)["message"]
    assert_valid_status(plan.status)
    # Without the label: no Admitted condition, a running PyTorchJob.
    plain = reconcile(stored(), Observed(now=T0), SETTINGS)
    assert c.get_condition(plain.status["conditions"], c.ADMITTED) is None
    assert plain.create[-1].body["spec"]["runPolicy"]["suspend"] is False


def test_kueue_admits_preempts_and_readmits_without_the_operator_fighting_it() -> None:
    body = queued_job()
    body = step(body, reconcile(body, Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    waiting = ptj_of(body, ("Created", "PyTorchJobCreated"), suspend=True)
    plan = reconcile(body, Observed(now=T0, pytorchjob=waiting, configmap=cm), SETTINGS)
    assert plan.patch == (), "a queued PyTorchJob is never un-suspended by the operator"
    body = step(body, plan)

    # Kueue admits: it un-suspends the PyTorchJob; the training-operator runs it.
    admitted = ptj_of(body, ("Running", "PyTorchJobRunning"), suspend=False)
    plan = reconcile(body, Observed(now=T1, pytorchjob=admitted, configmap=cm), SETTINGS)
    assert plan.patch == ()
    assert summary(plan)[c.RUNNING] == ("True", c.REASON_PYTORCHJOB_RUNNING)
    assert (cond(plan, c.ADMITTED)["status"], cond(plan, c.ADMITTED)["reason"]) == ("True", c.REASON_ADMITTED)
    assert [e.reason for e in plan.events] == [c.EVENT_RUNNING, c.REASON_ADMITTED]
    body = step(body, plan)

    # Kueue preempts: it suspends the PyTorchJob again. The operator leaves it suspended.
    preempted = ptj_of(body, ("Running", "PyTorchJobRunning"), suspend=True)
    plan = reconcile(body, Observed(now=T1, pytorchjob=preempted, configmap=cm), SETTINGS)
    assert plan.patch == ()
    assert (cond(plan, c.ADMITTED)["status"], cond(plan, c.ADMITTED)["reason"]) == ("False", c.REASON_QUEUED)
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", c.EVENT_PREEMPTED)]
    body = step(body, plan)
    stopped = ptj_of(body, ("Suspended", "PyTorchJobSuspended"), suspend=True)
    plan = reconcile(body, Observed(now=T2, pytorchjob=stopped, configmap=cm), SETTINGS)
    assert plan.patch == () and summary(plan)[c.RUNNING] == ("False", c.REASON_QUEUED)
    assert summary(plan)[c.SUSPENDED] == ("False", c.REASON_NOT_SUSPENDED)
    body = step(body, plan)

    # Re-admitted: Admitted again, no patch.
    plan = reconcile(body, Observed(now=T2, pytorchjob=admitted, configmap=cm), SETTINGS)
    assert plan.patch == () and cond(plan, c.ADMITTED)["reason"] == c.REASON_ADMITTED


def test_user_suspend_of_a_queued_job_suspends_and_resume_leaves_it_to_kueue() -> None:
    body = queued_job()
    body = step(body, reconcile(body, Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    admitted = ptj_of(body, ("Running", "PyTorchJobRunning"), suspend=False)
    body = step(body, reconcile(body, Observed(now=T0, pytorchjob=admitted, configmap=cm), SETTINGS))
    suspending = queued_job(generation=2, status=body["status"], suspend=True)
    plan = reconcile(suspending, Observed(now=T1, pytorchjob=admitted, configmap=cm), SETTINGS)
    assert [p.body for p in plan.patch] == [{"spec": {"runPolicy": {"suspend": True}}}]
    assert cond(plan, c.ADMITTED)["reason"] == c.REASON_SUSPENDED
    body = step(suspending, plan)
    stopped = ptj_of(body, ("Suspended", "PyTorchJobSuspended"), suspend=True)
    body = step(body, reconcile(body, Observed(now=T1, pytorchjob=stopped, configmap=cm), SETTINGS))
    assert summary({"conditions": body["status"]["conditions"]} | {})[c.SUSPENDED] == ("True", c.REASON_SUSPENDED)
    resuming = queued_job(generation=3, status=body["status"], suspend=False)
    plan = reconcile(resuming, Observed(now=T2, pytorchjob=stopped, configmap=cm), SETTINGS)
    assert plan.patch == (), "Kueue, not the operator, un-suspends a queue-managed PyTorchJob"
    assert summary(plan)[c.SUSPENDED] == ("False", c.REASON_RESUMED)
    assert summary(plan)[c.RUNNING] == ("False", c.REASON_QUEUED)
    assert cond(plan, c.ADMITTED)["reason"] == c.REASON_QUEUED


# ---------------------------------------------------------------------------- spec changes


def test_spec_change_while_running_is_rejected_and_names_the_fields() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    running = ptj_of(body, ("Running", "PyTorchJobRunning"))
    body = step(body, reconcile(body, Observed(now=T0, pytorchjob=running, configmap=cm), SETTINGS))
    edited = stored(generation=2, status=body["status"], training__lr=0.5, model__path="/models/other")
    plan = reconcile(edited, Observed(now=T1, pytorchjob=running, configmap=cm), SETTINGS)
    assert plan.create == () and plan.patch == () and plan.delete == ()
    accepted = cond(plan, c.ACCEPTED)
    assert (accepted["status"], accepted["reason"]) == ("False", c.REASON_SPEC_CHANGE_REJECTED)
    assert "spec.model.path" in accepted["message"] and "spec.training.lr" in accepted["message"]
    assert "suspend" in accepted["message"]
    assert cond(plan, c.RUNNING)["status"] == "True", "the running job is left alone"
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", c.REASON_SPEC_CHANGE_REJECTED)]
    # Reverting clears it.
    reverted = stored(generation=3, status=plan.status)
    plan = reconcile(reverted, Observed(now=T2, pytorchjob=running, configmap=cm), SETTINGS)
    assert summary(plan)[c.ACCEPTED] == ("True", c.REASON_SPEC_ACCEPTED)


def test_spec_change_while_suspended_recreates_the_pytorchjob() -> None:
    body = step(stored(suspend=True), reconcile(stored(suspend=True), Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    old_ptj = ptj_of(body, ("Suspended", "PyTorchJobSuspended"), suspend=True)
    edited = stored(generation=2, status=body["status"], suspend=True, training__lr=0.25)
    plan = reconcile(edited, Observed(now=T1, pytorchjob=old_ptj, configmap=cm), SETTINGS)
    assert [d.ref.kind for d in plan.delete] == ["PyTorchJob"]
    assert plan.delete[0].event.reason == c.EVENT_SPEC_CHANGE_APPLIED
    assert "spec.training.lr" in plan.delete[0].event.message
    assert [p.ref.kind for p in plan.patch] == ["ConfigMap"]
    new_spec = json.loads(plan.patch[0].body["data"]["spec.json"])
    assert new_spec["training"]["lr"] == 0.25
    assert cond(plan, c.ACCEPTED)["status"] == "True"
    assert summary(plan)[c.SUSPENDED] == ("True", c.REASON_SUSPENDED)
    # Next round: the old PyTorchJob is gone -> a new, still suspended one from the new spec.
    body = step(edited, plan)
    new_cm = cm_of(body)
    plan = reconcile(body, Observed(now=T2, configmap=new_cm), SETTINGS)
    ptj = next(cr.body for cr in plan.create if cr.body["kind"] == "PyTorchJob")
    assert ptj["spec"]["runPolicy"]["suspend"] is True
    assert ptj["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH] == new_cm["metadata"]["annotations"][
        builders.ANNOTATION_SPEC_HASH]
    # It was replaced on purpose: no "was missing before the job finished" event.
    assert plan.create[-1].event.reason == c.EVENT_CREATED and "missing" not in plan.create[-1].event.message
    assert plan.status["pytorchJobName"] == "quickstart"


def test_an_edit_that_also_resumes_is_applied_and_the_new_child_starts() -> None:
    """The usual `kubectl apply` of an edited manifest: a launch-time field changed and suspend: false in
    one apply. The child is still suspended (no pods), so the edit is applied rather than rejected as a
    change 'while the job runs' (which left the job suspended while Suspended claimed it had resumed)."""
    body = step(stored(suspend=True), reconcile(stored(suspend=True), Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    for old_ptj in (ptj_of(body, ("Suspended", "PyTorchJobSuspended"), suspend=True),
                    ptj_of(body, ("Created", "PyTorchJobCreated"), suspend=True)):  # suspended before it ran
        edited = stored(generation=2, status=body["status"], suspend=False, training__lr=0.25)
        plan = reconcile(edited, Observed(now=T1, pytorchjob=old_ptj, configmap=cm), SETTINGS)
        assert summary(plan)[c.ACCEPTED] == ("True", c.REASON_SPEC_ACCEPTED)
        assert [d.ref.kind for d in plan.delete] == ["PyTorchJob"]
        event = plan.delete[0].event
        assert event.reason == c.EVENT_SPEC_CHANGE_APPLIED and "spec.training.lr" in event.message
        assert "starts now" in event.message
        assert json.loads(plan.patch[0].body["data"]["spec.json"])["training"]["lr"] == 0.25
    # Next round: the replacement is created running, from the new spec.
    after = step(edited, plan)
    new_cm = cm_of(after)
    plan = reconcile(after, Observed(now=T2, configmap=new_cm), SETTINGS)
    ptj = next(cr.body for cr in plan.create if cr.body["kind"] == "PyTorchJob")
    assert ptj["spec"]["runPolicy"]["suspend"] is False
    assert ptj["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH] == new_cm["metadata"]["annotations"][
        builders.ANNOTATION_SPEC_HASH]
    # A child with pods is still protected: the same apply against a running child is rejected.
    running = ptj_of(body, ("Running", "PyTorchJobRunning"))
    plan = reconcile(edited, Observed(now=T1, pytorchjob=running, configmap=cm), SETTINGS)
    assert plan.delete == () and summary(plan)[c.ACCEPTED] == ("False", c.REASON_SPEC_CHANGE_REJECTED)
    # A child waiting in a Kueue queue is not replaced (it would lose its place); the message says where it is.
    queued = queued_job()
    queued = step(queued, reconcile(queued, Observed(now=T0), SETTINGS))
    waiting = ptj_of(queued, ("Suspended", "PyTorchJobSuspended"), suspend=True)
    edited = stored(generation=2, status=queued["status"], training__lr=0.25)
    edited["metadata"]["labels"] = queued["metadata"]["labels"]
    plan = reconcile(edited, Observed(now=T1, pytorchjob=waiting, configmap=cm_of(queued)), SETTINGS)
    assert plan.delete == () and summary(plan)[c.ACCEPTED] == ("False", c.REASON_SPEC_CHANGE_REJECTED)
    assert "while the job waits in its Kueue queue" in cond(plan, c.ACCEPTED)["message"]


def test_replacement_still_deleting_then_hand_deletion_is_reported_as_missing() -> None:
    body = step(stored(suspend=True), reconcile(stored(suspend=True), Observed(now=T0), SETTINGS))
    old_ptj = ptj_of(body, ("Suspended", "PyTorchJobSuspended"), suspend=True)
    edited = stored(generation=2, status=body["status"], suspend=True, training__lr=0.25)
    body = step(edited, reconcile(edited, Observed(now=T1, pytorchjob=old_ptj, configmap=cm_of(body)), SETTINGS))
    assert "pytorchJobName" not in body["status"]
    going = copy.deepcopy(old_ptj)
    going["metadata"]["deletionTimestamp"] = T1  # e.g. a finalizer holds it a while
    plan = reconcile(body, Observed(now=T1, pytorchjob=going, configmap=cm_of(body)), SETTINGS)
    assert plan.create == () and "pytorchJobName" not in (plan.status or body["status"])
    body = step(body, plan)
    body = step(body, reconcile(body, Observed(now=T2, configmap=cm_of(body)), SETTINGS))
    # Later, a hand deletion of the replacement IS a missing PyTorchJob.
    plan = reconcile(body, Observed(now=T2, configmap=cm_of(body)), SETTINGS)
    assert plan.create[-1].event.reason == c.EVENT_RECREATED


def test_spec_change_after_finishing_has_no_effect() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    done = ptj_of(body, ("Succeeded", "PyTorchJobSucceeded"))
    body = step(body, reconcile(body, Observed(now=T1, pytorchjob=done, configmap=cm_of(body)), SETTINGS))
    edited = stored(generation=2, status=body["status"], training__lr=0.5)
    plan = reconcile(edited, Observed(now=T2, pytorchjob=done, configmap=cm_of(body)), SETTINGS)
    assert plan.create == () and plan.patch == () and plan.delete == ()
    assert summary(plan)[c.ACCEPTED] == ("False", c.REASON_SPEC_CHANGE_REJECTED)
    assert summary(plan)[c.SUCCEEDED] == ("True", c.REASON_PYTORCHJOB_SUCCEEDED)


def test_hand_edited_configmap_is_restored() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    cm = cm_of(body)
    cm["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH] = "edited"
    cm["data"]["spec.json"] = "{}"
    plan = reconcile(body, Observed(now=T1, pytorchjob=ptj_of(body), configmap=cm), SETTINGS)
    assert [p.ref.kind for p in plan.patch] == ["ConfigMap"]
    assert plan.patch[0].body["data"] == cm_of(body)["data"]


def test_changed_fields_lists_leaf_paths_without_suspend() -> None:
    old = {"suspend": False, "training": {"lr": 1, "seed": 1}, "image": "a"}
    new = {"suspend": True, "training": {"lr": 2, "seed": 1}, "image": "b", "extra": {"x": 1}}
    assert changed_fields(old, new) == ["spec.extra", "spec.image", "spec.training.lr"]


# ---------------------------------------------------------------------------- status bookkeeping


def test_transition_times_change_only_with_status() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    ptj = ptj_of(body, ("Created", "PyTorchJobCreated"))
    first = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    # Seeing the PyTorchJob it created changes nothing: no second status write.
    assert first.status is None
    assert cond(body["status"], c.RUNNING)["reason"] == c.REASON_PENDING
    again = reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert again.status is None
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    running = reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert cond(running, c.RUNNING)["lastTransitionTime"] == T2
    assert cond(running, c.ACCEPTED)["lastTransitionTime"] == T0


def test_new_generation_is_observed_on_every_condition() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    body = step(body, reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS))
    body["metadata"]["generation"] = 5  # e.g. a label-free metadata edit that bumped nothing else
    plan = reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert plan.status["observedGeneration"] == 5
    assert {x["observedGeneration"] for x in plan.status["conditions"]} == {5}
    assert plan.events == ()


def test_deleted_job_plans_nothing() -> None:
    body = stored()
    body["metadata"]["deletionTimestamp"] = T1
    assert reconcile(body, Observed(now=T1), SETTINGS) == Plan()


def test_progress_annotation_is_folded_into_trainer_status() -> None:
    value = encode_progress(45, total_steps=90, reward_mean=0.5, val_reward_mean=0.25,
                            last_checkpoint={"step": 40, "uri": "s3://b/ns/quickstart/step_000040", "time": T1},
                            time=T1)
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    body["metadata"]["annotations"] = {ANNOTATION: value}
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    plan = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert plan.status["trainer"] == {
        "step": 45, "totalSteps": 90, "progressPercentage": 50, "rewardMean": 0.5, "valRewardMean": 0.25,
        "lastCheckpoint": {"step": 40, "uri": "s3://b/ns/quickstart/step_000040", "time": T1},
        "lastUpdatedTime": T1,
    }
    assert_valid_status(plan.status)
    body = step(body, plan)
    assert reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS).status is None
    body["metadata"]["annotations"] = {ANNOTATION: '{"step": "x", "time": "later"}'}
    plan = reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert plan.status is None and plan.notes and "step must be" in plan.notes[0]


def test_nonfinite_rewards_set_rewards_healthy_false_and_warn_once() -> None:
    T3 = "2026-11-26T11:30:00Z"
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    body["metadata"]["annotations"] = {ANNOTATION: encode_progress(5, total_steps=90, time=T1)}
    plan = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert c.get_condition(plan.status["conditions"], c.REWARDS_HEALTHY) is None  # none while all rewards are finite
    body = step(body, plan)
    body["metadata"]["annotations"] = {ANNOTATION: encode_progress(6, total_steps=90, nonfinite_rewards=3, time=T2)}
    plan = reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    rewards = cond(plan.status, c.REWARDS_HEALTHY)
    assert (rewards["status"], rewards["reason"]) == (c.FALSE, c.REASON_NONFINITE_REWARDS)
    assert "3 non-finite" in rewards["message"] and "reward function" in rewards["message"]
    assert rewards["observedGeneration"] == body["metadata"]["generation"]
    warnings = [e for e in plan.events if e.reason == c.REASON_NONFINITE_REWARDS]
    assert len(warnings) == 1 and warnings[0].type == "Warning"
    assert_valid_status(plan.status)
    body = step(body, plan)
    body["metadata"]["annotations"] = {ANNOTATION: encode_progress(7, total_steps=90, nonfinite_rewards=5, time=T3)}
    plan = reconcile(body, Observed(now=T3, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    rewards = cond(plan.status, c.REWARDS_HEALTHY)
    assert "5 non-finite" in rewards["message"] and rewards["lastTransitionTime"] == T2
    assert not [e for e in plan.events if e.reason == c.REASON_NONFINITE_REWARDS]  # not again on a later report


def test_quarantined_checkpoint_warns_once_per_step() -> None:
    body = step(stored(), reconcile(stored(), Observed(now=T0), SETTINGS))
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    moved = {"step": 40, "uri": "s3://b/ns/quickstart/quarantine/step_000040-20261126T100500Z",
             "reason": "checkpoint step 40 is corrupt"}
    body["metadata"]["annotations"] = {ANNOTATION: encode_progress(30, quarantined=[moved], time=T1)}
    plan = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    [event] = [e for e in plan.events if e.reason == c.EVENT_CHECKPOINT_QUARANTINED]
    assert event.type == "Warning" and "step 40" in event.message and moved["uri"] in event.message
    assert plan.status["trainer"]["quarantinedCheckpoints"] == [moved]
    assert_valid_status(plan.status)
    body = step(body, plan)
    assert reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS).events == ()
    body["metadata"]["annotations"] = {ANNOTATION: encode_progress(31, quarantined=[moved], time=T2)}
    plan = reconcile(body, Observed(now=T2, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert plan.status["trainer"]["step"] == 31 and not plan.events  # a later report: no second event


def test_apply_failed_status_marks_only_jobs_not_yet_created() -> None:
    body = stored()
    plan = reconcile(body, Observed(now=T0), SETTINGS)
    status = apply_failed_status(body, plan, "500 Internal Server Error", T1)
    assert cond(status, c.RUNNING)["reason"] == c.REASON_CREATE_FAILED
    assert "500 Internal Server Error" in cond(status, c.RUNNING)["message"]
    assert_valid_status(status)
    body = step(body, plan)
    ptj = ptj_of(body, ("Running", "PyTorchJobRunning"))
    running_plan = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm_of(body)), SETTINGS)
    assert apply_failed_status(step(body, running_plan), running_plan, "boom", T2) is None


def test_create_failed_then_created_is_a_create_with_spec_accepted_not_a_recreation() -> None:
    """The status written after a failed create must not claim the child existed (the retry was reported as
    `PyTorchJobRecreated ... was missing`), and its events are posted with it (SpecAccepted was lost)."""
    body = stored()
    plan = reconcile(body, Observed(now=T0), SETTINGS)
    status = apply_failed_status(body, plan, "403 Forbidden", T1)
    assert "pytorchJobName" not in status
    assert [(e.type, e.reason) for e in failure_events(body, status)] == [
        ("Normal", c.REASON_SPEC_ACCEPTED), ("Warning", c.REASON_CREATE_FAILED)]
    body = step(body, Plan(status=status))
    assert failure_events(body, status) == [], "a second failure posts nothing new"
    retry = reconcile(body, Observed(now=T2, configmap=cm_of(body)), SETTINGS)
    assert retry.create[-1].event.reason == c.EVENT_CREATED
    assert "Created PyTorchJob quickstart." == retry.create[-1].event.message
    assert retry.status["pytorchJobName"] == "quickstart"
    assert c.REASON_SPEC_ACCEPTED not in [e.reason for e in retry.events], "posted once, with the failure"


# ---------------------------------------------------------------------------- the JobSet child


def js_of(body: dict[str, Any], *conds: tuple[str, str], suspend: bool | None = None, ready: int = 0,
          restarts: int = 0, created: str = T0) -> dict[str, Any]:
    js = copy.deepcopy(children_of(body)["JobSet"])
    js["metadata"].update(uid="js-uid", creationTimestamp=created)
    if suspend is not None:
        js["spec"]["suspend"] = suspend
    js["status"] = {"conditions": [
        {"type": t, "status": "True", "reason": reason, "message": f"{t} message"} for t, reason in conds],
        "restarts": restarts,
        "replicatedJobsStatus": [{"name": "trainer", "ready": ready, "succeeded": 0, "failed": 0, "active": 1,
                                  "suspended": 0}]}
    return js


def test_jobset_child_is_created_and_its_status_mirrored() -> None:
    body = stored(childKind="JobSet")
    plan = reconcile(body, Observed(now=T0), SETTINGS)
    assert [cr.body["kind"] for cr in plan.create][-1] == "JobSet"
    assert plan.create[-1].event.message == "Created JobSet quickstart."
    assert plan.status["jobSetName"] == "quickstart" and "pytorchJobName" not in plan.status
    assert "JobSet quickstart runs it" in cond(plan, c.ACCEPTED)["message"]
    assert_valid_status(plan.status)
    body = step(body, plan)
    pending = reconcile(body, Observed(now=T1, jobset=js_of(body), configmap=cm_of(body)), SETTINGS)
    body = step(body, pending)
    assert cond(body["status"], c.RUNNING)["reason"] == c.REASON_PENDING
    running = reconcile(body, Observed(now=T1, jobset=js_of(body, ready=1), configmap=cm_of(body)), SETTINGS)
    assert (cond(running, c.RUNNING)["status"], cond(running, c.RUNNING)["reason"]) == ("True", c.REASON_JOBSET_RUNNING)
    body = step(body, running)
    restarting = reconcile(body, Observed(now=T1, jobset=js_of(body, restarts=1), configmap=cm_of(body)), SETTINGS)
    assert cond(restarting, c.RUNNING)["reason"] == c.REASON_RESTARTING
    done = reconcile(body, Observed(now=T2, jobset=js_of(body, ("Completed", "AllJobsCompleted"), ready=1),
                                    configmap=cm_of(body)), SETTINGS)
    assert (cond(done, c.SUCCEEDED)["status"], cond(done, c.SUCCEEDED)["reason"]) == ("True", c.REASON_JOBSET_SUCCEEDED)
    failed = reconcile(body, Observed(now=T2, jobset=js_of(body, ("Failed", "ReachedMaxRestarts")),
                                      configmap=cm_of(body)), SETTINGS)
    assert cond(failed, c.FAILED)["reason"] == "ReachedMaxRestarts"
    assert_valid_status(done.status)


def test_jobset_suspend_is_patched_on_spec_suspend() -> None:
    body = stored(childKind="JobSet", suspend=True)
    body["status"] = reconcile(body, Observed(now=T0), SETTINGS).status
    plan = reconcile(body, Observed(now=T1, jobset=js_of(body, suspend=False, ready=1), configmap=cm_of(body)),
                     SETTINGS)
    assert [(p.ref.kind, p.body) for p in plan.patch] == [("JobSet", {"spec": {"suspend": True}})]
    suspended = reconcile(body, Observed(now=T1, jobset=js_of(body, ("Suspended", "JobSetSuspended"), suspend=True),
                                         configmap=cm_of(body)), SETTINGS)
    assert cond(step(body, suspended)["status"], c.SUSPENDED)["status"] == "True" and suspended.patch == ()


def test_child_kind_edit_while_suspended_replaces_the_pytorchjob_with_a_jobset() -> None:
    body = stored(suspend=True)
    body["status"] = reconcile(body, Observed(now=T0), SETTINGS).status
    ptj, cm = ptj_of(body, suspend=True), cm_of(body)
    body["spec"]["childKind"] = "JobSet"
    body["metadata"]["generation"] = 2
    plan = reconcile(body, Observed(now=T1, pytorchjob=ptj, configmap=cm), SETTINGS)
    assert [(d.ref.kind, d.event.reason) for d in plan.delete] == [("PyTorchJob", c.EVENT_SPEC_CHANGE_APPLIED)]
    assert "spec.childKind" in plan.delete[0].event.message
    body = step(body, plan)
    assert "pytorchJobName" not in body["status"]
    after = reconcile(body, Observed(now=T2, configmap=cm_of(body)), SETTINGS)
    assert after.create[-1].body["kind"] == "JobSet" and after.create[-1].event.reason == c.EVENT_CREATED
    running = stored(childKind="JobSet")
    running["status"] = reconcile(running, Observed(now=T0), SETTINGS).status
    rejected = reconcile(running, Observed(now=T1, pytorchjob=ptj_of(stored(), ("Running", "PyTorchJobRunning")),
                                           configmap=cm_of(stored())), SETTINGS)
    assert cond(rejected, c.ACCEPTED)["reason"] == c.REASON_SPEC_CHANGE_REJECTED and rejected.delete == ()


QUEUE = {builders.LABEL_KUEUE_QUEUE: "team-a"}


def queued_body(kind: str = "PyTorchJob") -> dict[str, Any]:
    body = stored(childKind=kind)
    body["metadata"]["labels"] = dict(QUEUE)
    body["status"] = reconcile(body, Observed(now=T0), SETTINGS).status
    return body


def workload_for(child: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": f"{child['kind'].lower()}-x", "ownerReferences": [{
                "apiVersion": child["apiVersion"], "kind": child["kind"], "name": child["metadata"]["name"],
                "uid": child["metadata"]["uid"], "controller": True}]}}


@pytest.mark.parametrize("kind", ["PyTorchJob", "JobSet"])
def test_no_kueue_workload_after_the_grace_period_is_reported_and_cleared(kind: str) -> None:
    settings = OperatorSettings(kueue_workload_grace_seconds=60)
    body = queued_body(kind)
    if kind == "JobSet":
        child = js_of(body, suspend=True)
    else:
        child = ptj_of(body, suspend=True)
        child["metadata"].update(uid="ptj-uid", creationTimestamp=T0)
    seen = dict(now="2026-11-26T10:00:30Z", configmap=cm_of(body), **{kind.lower(): child})
    # Within the grace period: Queued, and a cycle is due when it ends.
    early = reconcile(body, Observed(workloads=(), **seen), settings)
    assert cond(step(body, early)["status"], c.ADMITTED)["reason"] == c.REASON_QUEUED
    assert early.requeue_after == pytest.approx(31.0)
    # Unknown (the Workloads cannot be read): nothing is concluded, nothing requeued.
    unknown = reconcile(body, Observed(workloads=None, **{**seen, "now": T1}), settings)
    assert cond(step(body, unknown)["status"], c.ADMITTED)["reason"] == c.REASON_QUEUED and unknown.requeue_after is None
    # No Workload API at all (Kueue not installed): the same wait, then NoKueueWorkload saying so.
    no_kueue = reconcile(body, Observed(workloads=None, kueue_missing=True, **seen), settings)
    assert cond(step(body, no_kueue)["status"], c.ADMITTED)["reason"] == c.REASON_QUEUED
    assert no_kueue.requeue_after == pytest.approx(31.0)
    no_kueue = reconcile(body, Observed(workloads=None, kueue_missing=True, **{**seen, "now": T1}), settings)
    admitted = cond(no_kueue, c.ADMITTED)
    assert (admitted["status"], admitted["reason"]) == ("False", c.REASON_NO_KUEUE_WORKLOAD)
    assert "Kueue is not installed" in admitted["message"] and "without the kueue.x-k8s.io labels" in admitted["message"]
    assert [(e.type, e.reason) for e in no_kueue.events] == [("Warning", c.REASON_NO_KUEUE_WORKLOAD)]
    # Past it with no Workload owning the child (another job's does not count): NoKueueWorkload, one Warning.
    other = workload_for({**child, "metadata": {**child["metadata"], "uid": "someone-else"}})
    late = reconcile(body, Observed(workloads=(other,), **{**seen, "now": T1}), settings)
    admitted = cond(late, c.ADMITTED)
    assert (admitted["status"], admitted["reason"]) == ("False", c.REASON_NO_KUEUE_WORKLOAD)
    framework = {"PyTorchJob": "kubeflow.org/pytorchjob", "JobSet": "jobset.x-k8s.io/jobset"}[kind]
    assert framework in admitted["message"] and "spec.childKind: JobSet" in admitted["message"]
    assert [(e.type, e.reason) for e in late.events] == [("Warning", c.REASON_NO_KUEUE_WORKLOAD)]
    assert late.events[0].message == admitted["message"]
    body = step(body, late)
    again = reconcile(body, Observed(workloads=(), **{**seen, "now": T2}), settings)
    assert again.events == () and again.status is None, "posted once"
    # A Workload appears: back to Queued, with a Normal event.
    found = reconcile(body, Observed(workloads=(workload_for(child),), **{**seen, "now": T2}), settings)
    assert cond(found, c.ADMITTED)["reason"] == c.REASON_QUEUED
    assert [(e.type, e.reason) for e in found.events] == [("Normal", c.EVENT_KUEUE_WORKLOAD_FOUND)]
