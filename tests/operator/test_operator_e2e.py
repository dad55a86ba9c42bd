"""The real operator process (`python -m rljob_operator`) against the test API server over HTTP.

The tests play the user (kubectl-like HTTP calls), the training-operator (patching PyTorchJob
status) and the worker (the progress annotation), and assert what the RLJob shows.
"""
from __future__ import annotations

import time
from typing import Any

import opschema
import pytest
import yaml
from cluster import (
    CONFIGMAPS,
    DEPLOYMENTS,
    JOBSETS,
    KUEUE_GRACE_SECONDS,
    PYTORCHJOBS,
    RESYNC_SECONDS,
    RLJOBS,
    ROLEBINDINGS,
    ROLES,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICES,
    KubeClient,
    wait_until,
)
from rljob_operator import builders
from rljob_operator import conditions as c
from rljob_operator.progress import encode_progress, patch_progress

pytestmark = pytest.mark.timeout(120)

# Event-driven reactions must land well within the resync period (conftest.RESYNC_SECONDS = 10 s),
# so a test cannot pass because the resync timer covered for a missing watch or handler.
EVENT_DRIVEN = 8.0
# the controller-manager's garbage collector learns a new kind (the RLJob CRD) at its discovery resync, every 30 s:
# a test that deletes an RLJob soon after the CRD was created waits up to that long (8 s ran out in a CI rehearsal)
GARBAGE_COLLECTED = 75.0
CHILD_KINDS = [(SERVICEACCOUNTS, "{}-worker"), (ROLES, "{}-progress"), (ROLEBINDINGS, "{}-progress"),
               (CONFIGMAPS, "{}-spec"), (PYTORCHJOBS, "{}")]


def rljob(name: str = "job", **spec_changes: Any) -> dict[str, Any]:
    doc = yaml.safe_load((opschema.REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"] = {"name": name}
    for path, value in spec_changes.items():
        node = doc["spec"]
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return doc


class Eventually:
    def __init__(self, kube: KubeClient, operator: Any):
        self.kube, self.operator = kube, operator

    def __call__(self, check, what: str, timeout: float = EVENT_DRIVEN):
        return wait_until(check, timeout=timeout, what=what, on_timeout=lambda: self.operator.logs()[-6000:])

    def condition(self, ns: str, name: str, type_: str, status: str, reason: str | None = None,
                  timeout: float = EVENT_DRIVEN) -> dict[str, Any]:
        def check():
            cond = self.kube.condition(ns, name, type_)
            return cond if cond and cond["status"] == status and (reason is None or cond["reason"] == reason) else None

        return self(check, f"{name}: {type_}={status} {reason or ''}", timeout)

    def event(self, ns: str, name: str, reason: str, timeout: float = EVENT_DRIVEN) -> dict[str, Any]:
        def check():
            return next((e for e in self.kube.events_for(ns, name) if e["reason"] == reason), None)

        return self(check, f"{name}: event {reason}", timeout)


@pytest.fixture
def eventually(kube: KubeClient, operator) -> Eventually:
    return Eventually(kube, operator)


def start_running(kube: KubeClient, eventually: Eventually, ns: str, name: str, **spec: Any) -> dict[str, Any]:
    kube.create(RLJOBS, ns, rljob(name, **spec))
    eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, name), "the PyTorchJob")
    kube.set_pytorchjob_conditions(ns, name, ("Created", "True", "PyTorchJobCreated"),
                                   ("Running", "True", "PyTorchJobRunning"), startTime="2026-11-26T10:00:00Z")
    eventually.condition(ns, name, c.RUNNING, "True", c.REASON_PYTORCHJOB_RUNNING)
    return kube.get(PYTORCHJOBS, ns, name)


# ---------------------------------------------------------------------------- creation and status


def test_rljob_becomes_a_pytorchjob_with_owned_children(kube: KubeClient, operator, eventually: Eventually,
                                                        ns: str) -> None:
    job = kube.create(RLJOBS, ns, rljob("alpha"))
    ptj = eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "alpha"), "the PyTorchJob")
    for resource, pattern in CHILD_KINDS:
        child = kube.get(resource, ns, pattern.format("alpha"))
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "name": "alpha", "uid": job["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}]
        assert child["metadata"]["labels"][builders.LABEL_JOB] == "alpha"
    assert opschema.pytorchjob_schema_errors(ptj) == [] and opschema.pytorchjob_webhook_errors(ptj) == []
    assert ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"] == [
        "python", "-m", "rljob_worker.runtime.launch", "-m", "rljob_worker", "--spec", "/etc/rljob/spec.json"]
    accepted = eventually.condition(ns, "alpha", c.ACCEPTED, "True", c.REASON_SPEC_ACCEPTED)
    assert accepted["observedGeneration"] == 1
    status = kube.get(RLJOBS, ns, "alpha")["status"]
    assert status["observedGeneration"] == 1 and status["pytorchJobName"] == "alpha"
    assert [x["type"] for x in status["conditions"]] == list(c.CONDITION_TYPES)
    stored = kube.get(RLJOBS, ns, "alpha")
    assert opschema.rljob_schema_errors(stored) == []
    assert "finalizers" not in stored["metadata"], "no external side effects, so no finalizer"
    eventually.event(ns, "alpha", c.REASON_SPEC_ACCEPTED)
    created = eventually.event(ns, "alpha", c.EVENT_CREATED)
    assert created["type"] == "Normal" and created["involvedObject"]["uid"] == job["metadata"]["uid"]


def test_training_operator_lifecycle_is_mirrored(kube: KubeClient, operator, eventually: Eventually,
                                                 api_server, ns: str) -> None:
    start_running(kube, eventually, ns, "beta")
    status = kube.get(RLJOBS, ns, "beta")["status"]
    assert status["startTime"] == "2026-11-26T10:00:00Z"
    eventually.event(ns, "beta", c.EVENT_RUNNING)
    # The worker reports progress through the annotation; the operator folds it into status.trainer.
    patch_progress(encode_progress(15, total_steps=30, reward_mean=0.75,
                                   last_checkpoint={"step": 10, "uri": "file:///ckpt/step_000010"}),
                   name="beta", namespace=ns, api_base=api_server.url)
    trainer = eventually(lambda: (kube.get(RLJOBS, ns, "beta")["status"].get("trainer") or {}).get("step") == 15
                         and kube.get(RLJOBS, ns, "beta")["status"]["trainer"], "trainer progress")
    assert trainer["progressPercentage"] == 50 and trainer["rewardMean"] == 0.75
    assert trainer["lastCheckpoint"] == {"step": 10, "uri": "file:///ckpt/step_000010"}
    # A malformed report is ignored; the status keeps the last good one.
    kube.patch(RLJOBS, ns, "beta", {"metadata": {"annotations": {"rljob.dev/progress": '{"step": "x", "time": "t"}'}}})
    kube.set_pytorchjob_conditions(ns, "beta", ("Created", "True", "PyTorchJobCreated"),
                                   ("Running", "False", "PyTorchJobRunning"),
                                   ("Succeeded", "True", "PyTorchJobSucceeded"),
                                   completionTime="2026-11-26T11:00:00Z")
    eventually.condition(ns, "beta", c.SUCCEEDED, "True", c.REASON_PYTORCHJOB_SUCCEEDED)
    status = kube.get(RLJOBS, ns, "beta")["status"]
    assert status["completionTime"] == "2026-11-26T11:00:00Z"
    assert status["trainer"]["step"] == 15
    assert c.get_condition(status["conditions"], c.RUNNING)["reason"] == c.REASON_COMPLETED
    eventually.event(ns, "beta", c.EVENT_SUCCEEDED)
    # A finished job's PyTorchJob (e.g. removed by ttlSecondsAfterFinished) is not recreated.
    kube.delete(PYTORCHJOBS, ns, "beta")
    time.sleep(2.0)
    assert kube.maybe_get(PYTORCHJOBS, ns, "beta") is None
    assert kube.condition(ns, "beta", c.SUCCEEDED)["status"] == "True"


def test_failure_reason_and_message_come_from_the_pytorchjob(kube: KubeClient, operator, eventually: Eventually,
                                                             ns: str) -> None:
    start_running(kube, eventually, ns, "gamma")
    kube.set_pytorchjob_conditions(ns, "gamma", ("Created", "True", "PyTorchJobCreated"),
                                   ("Failed", "True", "BackoffLimitExceeded"))
    failed = eventually.condition(ns, "gamma", c.FAILED, "True", "BackoffLimitExceeded")
    assert failed["message"] == "PyTorchJob gamma is failed."
    event = eventually.event(ns, "gamma", c.EVENT_FAILED)
    assert event["type"] == "Warning" and "BackoffLimitExceeded" in event["message"]
    assert kube.get(RLJOBS, ns, "gamma")["status"]["completionTime"]


def test_invalid_spec_is_reported_once_and_creates_nothing(kube: KubeClient, operator, eventually: Eventually,
                                                           api_server, ns: str) -> None:
    # Passes the CRD schema and its CEL rules, fails the operator's cross-field validation.
    kube.create(RLJOBS, ns, rljob("bad", rollout__valN=4, rollout__valTemperature=0.0))
    cond = eventually.condition(ns, "bad", c.ACCEPTED, "False", c.REASON_INVALID_SPEC)
    assert "spec.rollout.valN" in cond["message"]
    event = eventually.event(ns, "bad", c.REASON_INVALID_SPEC)
    assert event["type"] == "Warning"
    for resource, pattern in CHILD_KINDS:
        assert kube.maybe_get(resource, ns, pattern.format("bad")) is None
    # No retry storm: a resync reconciles it again (result "invalid") and writes and posts nothing.
    status_path = f"/namespaces/{ns}/rljobs/bad/status"
    writes = lambda: sum(1 for m, p in api_server.call(api_server.server.request_log)
                         if m == "PATCH" and p.startswith("/apis/rljob.dev") and status_path in p)
    before = writes()
    invalid_cycles = operator.metric("rljob_operator_reconciles_total", trigger="resync", result="invalid")
    eventually(lambda: operator.metric("rljob_operator_reconciles_total", trigger="resync", result="invalid")
               > invalid_cycles, "a resync of the invalid job", timeout=RESYNC_SECONDS + 5)
    assert writes() == before
    assert len([e for e in kube.events_for(ns, "bad") if e["reason"] == c.REASON_INVALID_SPEC]) == 1
    # Fixing the spec creates the job.
    kube.patch(RLJOBS, ns, "bad", {"spec": {"rollout": {"valN": 1}}})
    eventually.condition(ns, "bad", c.ACCEPTED, "True")
    eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "bad"), "the PyTorchJob after the fix")
    assert kube.condition(ns, "bad", c.ACCEPTED)["observedGeneration"] == 2


# ---------------------------------------------------------------------------- lifecycle


def test_suspend_and_resume(kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    start_running(kube, eventually, ns, "delta")
    kube.patch(RLJOBS, ns, "delta", {"spec": {"suspend": True}})
    eventually(lambda: kube.get(PYTORCHJOBS, ns, "delta")["spec"]["runPolicy"]["suspend"] is True,
               "runPolicy.suspend on the PyTorchJob")
    eventually.condition(ns, "delta", c.SUSPENDED, "False", c.REASON_SUSPENDING)
    kube.set_pytorchjob_conditions(ns, "delta", ("Created", "True", "PyTorchJobCreated"),
                                   ("Running", "False", "PyTorchJobSuspended"),
                                   ("Suspended", "True", "PyTorchJobSuspended"))
    eventually.condition(ns, "delta", c.SUSPENDED, "True", c.REASON_SUSPENDED)
    eventually.condition(ns, "delta", c.RUNNING, "False", c.REASON_JOB_SUSPENDED)
    eventually.event(ns, "delta", c.REASON_SUSPENDED)
    uid = kube.get(PYTORCHJOBS, ns, "delta")["metadata"]["uid"]
    kube.patch(RLJOBS, ns, "delta", {"spec": {"suspend": False}})
    eventually(lambda: kube.get(PYTORCHJOBS, ns, "delta")["spec"]["runPolicy"]["suspend"] is False,
               "runPolicy.suspend false")
    eventually.condition(ns, "delta", c.SUSPENDED, "False", c.REASON_RESUMED)
    eventually.event(ns, "delta", c.REASON_RESUMED)
    assert kube.get(PYTORCHJOBS, ns, "delta")["metadata"]["uid"] == uid, "suspend alone never recreates"


def test_spec_changes_are_rejected_while_running_and_applied_while_suspended(
        kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    ptj = start_running(kube, eventually, ns, "eps")
    launched_hash = ptj["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]
    kube.patch(RLJOBS, ns, "eps", {"spec": {"training": {"lr": 0.01}}})
    cond = eventually.condition(ns, "eps", c.ACCEPTED, "False", c.REASON_SPEC_CHANGE_REJECTED)
    assert "spec.training.lr" in cond["message"] and cond["observedGeneration"] == 2
    eventually.event(ns, "eps", c.REASON_SPEC_CHANGE_REJECTED)
    assert kube.get(PYTORCHJOBS, ns, "eps")["metadata"]["uid"] == ptj["metadata"]["uid"]
    assert '"lr": 0.003' in kube.get(CONFIGMAPS, ns, "eps-spec")["data"]["spec.json"]
    assert kube.condition(ns, "eps", c.RUNNING)["status"] == "True"
    # Suspending applies it: the PyTorchJob is replaced by a suspended one from the new spec.
    kube.patch(RLJOBS, ns, "eps", {"spec": {"suspend": True}})
    eventually.event(ns, "eps", c.EVENT_SPEC_CHANGE_APPLIED)
    new = eventually(lambda: (p := kube.maybe_get(PYTORCHJOBS, ns, "eps")) and p["metadata"]["uid"] != ptj[
        "metadata"]["uid"] and p, "the replacement PyTorchJob")
    assert new["spec"]["runPolicy"]["suspend"] is True
    assert new["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH] != launched_hash
    assert '"lr": 0.01' in kube.get(CONFIGMAPS, ns, "eps-spec")["data"]["spec.json"]
    eventually.condition(ns, "eps", c.ACCEPTED, "True")
    eventually.condition(ns, "eps", c.SUSPENDED, "True", c.REASON_SUSPENDED)
    time.sleep(2.0)  # the misleading "was missing" event used to follow about a second later
    assert c.EVENT_RECREATED not in {e["reason"] for e in kube.events_for(ns, "eps")}, "replaced on purpose"
    kube.patch(RLJOBS, ns, "eps", {"spec": {"suspend": False}})
    eventually(lambda: kube.get(PYTORCHJOBS, ns, "eps")["spec"]["runPolicy"]["suspend"] is False, "resumed")


def test_kueue_admits_and_preempts_and_the_operator_never_unsuspends(kube: KubeClient, operator,
                                                                    eventually: Eventually, api_server,
                                                                    ns: str) -> None:
    """A second client plays Kueue: it creates the PyTorchJob's Workload, un-suspends the PyTorchJob to admit it
    and suspends it to preempt it."""
    queue = {builders.LABEL_KUEUE_QUEUE: "team-a", builders.LABEL_KUEUE_PRIORITY: "low"}
    body = rljob("queued")
    body["metadata"]["labels"] = queue
    kube.create(RLJOBS, ns, body)
    ptj = eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "queued"), "the PyTorchJob")
    kueue = KubeClient(kube.base_url)
    kueue.create_workload(ns, ptj)
    assert queue.items() <= ptj["metadata"]["labels"].items()
    assert ptj["spec"]["runPolicy"]["suspend"] is True, "created suspended, for Kueue to admit"
    eventually.condition(ns, "queued", c.ADMITTED, "False", c.REASON_QUEUED)
    eventually.condition(ns, "queued", c.RUNNING, "False", c.REASON_QUEUED)
    assert not kube.get(RLJOBS, ns, "queued")["spec"].get("suspend"), "spec.suspend stays the user's intent"
    table = kube.request("GET", f"/apis/rljob.dev/v1alpha1/namespaces/{ns}/rljobs/queued", headers={
        "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    names = [col["name"] for col in table["columnDefinitions"]]
    assert table["rows"][0]["cells"][names.index("Queue")] == "Queued"

    kueue.patch(PYTORCHJOBS, ns, "queued", {"spec": {"runPolicy": {"suspend": False}}})  # admission
    eventually.condition(ns, "queued", c.ADMITTED, "True", c.REASON_ADMITTED)
    eventually.event(ns, "queued", c.REASON_ADMITTED)
    kube.set_pytorchjob_conditions(ns, "queued", ("Created", "True", "PyTorchJobCreated"),
                                   ("Running", "True", "PyTorchJobRunning"))
    eventually.condition(ns, "queued", c.RUNNING, "True", c.REASON_PYTORCHJOB_RUNNING)

    kueue.patch(PYTORCHJOBS, ns, "queued", {"spec": {"runPolicy": {"suspend": True}}})  # preemption
    eventually.condition(ns, "queued", c.ADMITTED, "False", c.REASON_QUEUED)
    assert eventually.event(ns, "queued", c.EVENT_PREEMPTED)["type"] == "Warning"
    kube.set_pytorchjob_conditions(ns, "queued", ("Created", "True", "PyTorchJobCreated"),
                                   ("Running", "False", "PyTorchJobSuspended"),
                                   ("Suspended", "True", "PyTorchJobSuspended"))
    eventually.condition(ns, "queued", c.RUNNING, "False", c.REASON_QUEUED)
    assert kube.condition(ns, "queued", c.SUSPENDED)["reason"] == c.REASON_NOT_SUSPENDED
    time.sleep(RESYNC_SECONDS + 2)  # past a level-based resync: still not flipped back against the queue
    assert kube.get(PYTORCHJOBS, ns, "queued")["spec"]["runPolicy"]["suspend"] is True
    assert kube.condition(ns, "queued", c.ADMITTED)["reason"] == c.REASON_QUEUED, "its Workload exists"

    kueue.patch(PYTORCHJOBS, ns, "queued", {"spec": {"runPolicy": {"suspend": False}}})  # re-admission
    eventually.condition(ns, "queued", c.ADMITTED, "True", c.REASON_ADMITTED)
    # The user's suspend still works on a queue-managed job, and resuming leaves the start to Kueue.
    kube.patch(RLJOBS, ns, "queued", {"spec": {"suspend": True}})
    eventually(lambda: kube.get(PYTORCHJOBS, ns, "queued")["spec"]["runPolicy"]["suspend"] is True,
               "runPolicy.suspend set by the user's spec.suspend")
    eventually.condition(ns, "queued", c.ADMITTED, "False", c.REASON_SUSPENDED)
    kube.patch(RLJOBS, ns, "queued", {"spec": {"suspend": False}})
    eventually.condition(ns, "queued", c.ADMITTED, "False", c.REASON_QUEUED)
    assert kube.get(PYTORCHJOBS, ns, "queued")["spec"]["runPolicy"]["suspend"] is True


def test_hand_deleted_pytorchjob_is_recreated(kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    ptj = start_running(kube, eventually, ns, "zeta")
    kube.delete(PYTORCHJOBS, ns, "zeta")
    again = eventually(lambda: (p := kube.maybe_get(PYTORCHJOBS, ns, "zeta")) and p["metadata"]["uid"] != ptj[
        "metadata"]["uid"] and p, "the recreated PyTorchJob")
    assert again["metadata"]["ownerReferences"] == ptj["metadata"]["ownerReferences"]
    eventually.event(ns, "zeta", c.EVENT_RECREATED)
    assert len(kube.items(PYTORCHJOBS, ns)) == 1


def test_deleting_the_rljob_leaves_nothing_behind(kube: KubeClient, operator, eventually: Eventually,
                                                  ns: str) -> None:
    start_running(kube, eventually, ns, "eta")
    kube.create(RLJOBS, ns, rljob("bystander"))
    eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "bystander"), "the bystander's PyTorchJob")
    kube.delete(RLJOBS, ns, "eta")
    for resource, pattern in CHILD_KINDS:
        eventually(lambda r=resource, p=pattern: kube.maybe_get(r, ns, p.format("eta")) is None,
                   f"{pattern.format('eta')} garbage-collected", timeout=GARBAGE_COLLECTED)
    for resource, pattern in CHILD_KINDS:
        assert kube.maybe_get(resource, ns, pattern.format("bystander")) is not None
    time.sleep(1.0)
    assert kube.maybe_get(PYTORCHJOBS, ns, "eta") is None, "nothing recreates children of a deleted RLJob"


def test_credentials_are_referenced_never_copied_or_logged(kube: KubeClient, operator, eventually: Eventually,
                                                           ns: str) -> None:
    secret_value = "s3cr3t-do-not-leak-4711"
    kube.create(SECRETS, ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3"},
                              "stringData": {}, "data": {"id": "aWQ=", "key": "czNjcjN0LWRvLW5vdC1sZWFrLTQ3MTE="}})
    kube.create(RLJOBS, ns, rljob("theta", s3={"endpoint": "http://minio:9000", "credentialsSecretRef": {
        "name": "s3", "accessKeyIdKey": "id", "secretAccessKeyKey": "key"}}, checkpoint__uri="s3://ckpt/rl"))
    ptj = eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "theta"), "the PyTorchJob")
    env = {e["name"]: e for e in ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "s3", "key": "key"}}
    everything = str(kube.items(CONFIGMAPS, ns)) + str(ptj) + operator.logs()
    assert secret_value not in everything and "czNjcjN0" not in everything


def test_resync_restores_children_deleted_by_hand(kube: KubeClient, operator, eventually: Eventually,
                                                  ns: str) -> None:
    """Nothing watches ConfigMaps or Roles; the level-based resync timer brings them back."""
    start_running(kube, eventually, ns, "xi")
    cm = kube.get(CONFIGMAPS, ns, "xi-spec")
    kube.delete(CONFIGMAPS, ns, "xi-spec")
    kube.delete(ROLES, ns, "xi-progress")
    eventually(lambda: kube.maybe_get(CONFIGMAPS, ns, "xi-spec") and kube.maybe_get(ROLES, ns, "xi-progress"),
               "the ConfigMap and Role recreated by the resync", timeout=RESYNC_SECONDS + 5)
    assert kube.get(CONFIGMAPS, ns, "xi-spec")["data"] == cm["data"]


# ---------------------------------------------------------------------------- faults


def test_api_errors_become_a_condition_and_are_retried(kube: KubeClient, operator, eventually: Eventually,
                                                       api_server, ns: str) -> None:
    fault = api_server.call(api_server.server.inject, method="POST", path=f"/namespaces/{ns}/pytorchjobs$",
                            status=500, times=6)
    kube.create(RLJOBS, ns, rljob("iota"))
    cond = eventually.condition(ns, "iota", c.RUNNING, "False", c.REASON_CREATE_FAILED)
    assert "500" in cond["message"]
    eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "iota"), "the PyTorchJob after the errors", timeout=20)
    assert fault.hits == 6
    eventually.condition(ns, "iota", c.RUNNING, "False", c.REASON_PENDING)
    assert len(kube.items(PYTORCHJOBS, ns)) == 1
    # The create that finally worked is a create, not the recreation of a "missing" PyTorchJob, and the
    # spec's acceptance was announced (it used to be lost with the failed cycle's status write).
    eventually.event(ns, "iota", c.EVENT_CREATED)
    accepted = eventually.event(ns, "iota", c.REASON_SPEC_ACCEPTED)
    assert accepted["type"] == "Normal"
    warning = eventually.event(ns, "iota", c.REASON_CREATE_FAILED)
    assert warning["type"] == "Warning" and "500" in warning["message"]
    reasons = [e["reason"] for e in kube.events_for(ns, "iota")]
    assert c.EVENT_RECREATED not in reasons and reasons.count(c.REASON_SPEC_ACCEPTED) == 1, reasons
    assert operator.metric("rljob_operator_api_errors_total", verb="create", code="500") >= 6


def test_expired_watches_are_relisted(kube: KubeClient, operator, eventually: Eventually, api_server,
                                      ns: str) -> None:
    """A child's status written while the operator's watches are down (an API-server restart, a control-plane
    upgrade) reaches the RLJob when the watches come back, not at the next resync: kopf re-lists after 410
    Expired and the re-listed PyTorchJob is reconciled like any event (it used to be dropped)."""
    start_running(kube, eventually, ns, "kappa")
    api_server.call(api_server.server.compact)
    before = len(api_server.call(api_server.server.request_log))
    assert api_server.call(api_server.server.drop_watches) >= 2
    kube.set_pytorchjob_conditions(ns, "kappa", ("Succeeded", "True", "PyTorchJobSucceeded"))  # no watch open
    # kopf resumes from its last resourceVersion, gets 410 Expired, and lists again.
    for plural in ("/rljobs", "/pytorchjobs"):  # both watches recover, each at its own backoff
        eventually(lambda plural=plural: any(m == "GET" and plural in p and "watch" not in p
                                             for m, p in api_server.call(api_server.server.request_log)[before:]),
                   f"a fresh list of {plural[1:]}")
    relisted = time.monotonic()
    eventually.condition(ns, "kappa", c.SUCCEEDED, "True", timeout=5.0)  # the issue's bound, far below the resync
    assert time.monotonic() - relisted < RESYNC_SECONDS - 1
    kube.create(RLJOBS, ns, rljob("lambda"))
    eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "lambda"), "a PyTorchJob after the relist",
               timeout=RESYNC_SECONDS - 1)


def test_operator_metrics(kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    start_running(kube, eventually, ns, "mu")
    assert operator.metric("rljob_operator_reconciles_total", result="ok") > 0
    assert operator.metric("rljob_operator_reconcile_duration_seconds_count", trigger="change") > 0
    assert operator.metric("rljob_operator_children_created_total", kind="PyTorchJob") >= 1
    eventually(lambda: operator.metric("rljob_operator_rljobs", condition="Running", status="True") >= 1,
               "the jobs-by-condition gauge")
    assert operator.metric("process_resident_memory_bytes") > 0


def test_restart_mid_reconcile_creates_no_duplicates(kube: KubeClient, operator, eventually: Eventually,
                                                     api_server, ns: str) -> None:
    """SIGKILL the operator while its PyTorchJob create is in flight (the server commits it but the
    answer is slow); the next operator finds what exists and creates nothing twice."""
    api_server.call(api_server.server.inject, method="POST", path=f"/namespaces/{ns}/pytorchjobs$", status=None,
                    delay_response=30.0)
    kube.create(RLJOBS, ns, rljob("nu"))
    eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "nu"), "the PyTorchJob committed")
    operator.restart(kill=True)
    eventually.condition(ns, "nu", c.RUNNING, "False", c.REASON_PENDING)
    for resource, _ in CHILD_KINDS:
        assert len(kube.items(resource, ns)) == 1, resource
    kube.set_pytorchjob_conditions(ns, "nu", ("Running", "True", "PyTorchJobRunning"))
    eventually.condition(ns, "nu", c.RUNNING, "True")
    api_server.call(api_server.server.clear_faults)


# ---------------------------------------------------------------------------- the JobSet child


def start_jobset(kube: KubeClient, eventually: Eventually, ns: str, name: str, labels: dict[str, str] | None = None,
                 **spec: Any) -> dict[str, Any]:
    body = rljob(name, childKind="JobSet", **spec)
    if labels:
        body["metadata"]["labels"] = labels
    kube.create(RLJOBS, ns, body)
    return eventually(lambda: kube.maybe_get(JOBSETS, ns, name), "the JobSet")


def test_jobset_child_is_created_owned_and_mirrored(kube: KubeClient, operator, eventually: Eventually,
                                                   ns: str) -> None:
    js = start_jobset(kube, eventually, ns, "js-alpha", nnodes=2)
    job = kube.get(RLJOBS, ns, "js-alpha")
    assert js["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert kube.maybe_get(PYTORCHJOBS, ns, "js-alpha") is None
    assert opschema.jobset_schema_errors(js) == [] and opschema.dropped_fields(js) == []
    (role,) = js["spec"]["replicatedJobs"]
    assert (role["name"], role["template"]["spec"]["completions"], role["template"]["spec"]["parallelism"]) == (
        "trainer", 2, 2)
    env = {e["name"]: e for e in role["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PET_MASTER_ADDR"]["value"] == "js-alpha-trainer-0-0.js-alpha"
    assert env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    eventually.condition(ns, "js-alpha", c.ACCEPTED, "True", c.REASON_SPEC_ACCEPTED)
    created = eventually.event(ns, "js-alpha", c.EVENT_CREATED)
    assert created["message"] == "Created JobSet js-alpha."
    assert kube.get(RLJOBS, ns, "js-alpha")["status"]["jobSetName"] == "js-alpha"
    kube.set_jobset_status(ns, "js-alpha", ready=1)
    eventually.condition(ns, "js-alpha", c.RUNNING, "True", c.REASON_JOBSET_RUNNING)
    kube.set_jobset_status(ns, "js-alpha", ("Completed", "True", "AllJobsCompleted"), ready=1)
    eventually.condition(ns, "js-alpha", c.SUCCEEDED, "True", c.REASON_JOBSET_SUCCEEDED)
    eventually.event(ns, "js-alpha", c.EVENT_SUCCEEDED)


def test_jobset_suspend_resume_and_spec_edits(kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    js = start_jobset(kube, eventually, ns, "js-beta")
    kube.set_jobset_status(ns, "js-beta", ready=1)
    eventually.condition(ns, "js-beta", c.RUNNING, "True", c.REASON_JOBSET_RUNNING)
    kube.patch(RLJOBS, ns, "js-beta", {"spec": {"training": {"lr": 0.01}}})
    eventually.condition(ns, "js-beta", c.ACCEPTED, "False", c.REASON_SPEC_CHANGE_REJECTED)
    kube.patch(RLJOBS, ns, "js-beta", {"spec": {"training": {"lr": 0.003}}})  # revert
    eventually.condition(ns, "js-beta", c.ACCEPTED, "True")
    kube.patch(RLJOBS, ns, "js-beta", {"spec": {"suspend": True}})
    eventually(lambda: kube.get(JOBSETS, ns, "js-beta")["spec"]["suspend"] is True, "spec.suspend on the JobSet")
    eventually.condition(ns, "js-beta", c.SUSPENDED, "False", c.REASON_SUSPENDING)
    kube.set_jobset_status(ns, "js-beta", ("Suspended", "True", "SuspendedJobs"), suspended=1)
    eventually.condition(ns, "js-beta", c.SUSPENDED, "True", c.REASON_SUSPENDED)
    eventually.condition(ns, "js-beta", c.RUNNING, "False", c.REASON_JOB_SUSPENDED)
    kube.patch(RLJOBS, ns, "js-beta", {"spec": {"suspend": False}})
    eventually(lambda: kube.get(JOBSETS, ns, "js-beta")["spec"]["suspend"] is False, "resumed")
    eventually.condition(ns, "js-beta", c.SUSPENDED, "False", c.REASON_RESUMED)
    assert kube.get(JOBSETS, ns, "js-beta")["metadata"]["uid"] == js["metadata"]["uid"], "suspend never recreates"
    # A spec edit while suspended replaces the JobSet (its network/success/failure policies are immutable).
    kube.patch(RLJOBS, ns, "js-beta", {"spec": {"suspend": True, "runPolicy": {"backoffLimit": 7}}})
    eventually.event(ns, "js-beta", c.EVENT_SPEC_CHANGE_APPLIED)
    new = eventually(lambda: (j := kube.maybe_get(JOBSETS, ns, "js-beta")) and j["metadata"]["uid"] != js[
        "metadata"]["uid"] and j, "the replacement JobSet")
    assert new["spec"]["failurePolicy"]["maxRestarts"] == 7 and new["spec"]["suspend"] is True


def test_child_kind_edit_while_suspended_moves_the_job_to_a_jobset(kube: KubeClient, operator,
                                                                   eventually: Eventually, ns: str) -> None:
    ptj = start_running(kube, eventually, ns, "mover")
    kube.patch(RLJOBS, ns, "mover", {"spec": {"childKind": "JobSet"}})
    cond = eventually.condition(ns, "mover", c.ACCEPTED, "False", c.REASON_SPEC_CHANGE_REJECTED)
    assert "spec.childKind" in cond["message"]
    assert kube.get(PYTORCHJOBS, ns, "mover")["metadata"]["uid"] == ptj["metadata"]["uid"]
    kube.patch(RLJOBS, ns, "mover", {"spec": {"suspend": True}})
    eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "mover") is None, "the PyTorchJob deleted")
    js = eventually(lambda: kube.maybe_get(JOBSETS, ns, "mover"), "the JobSet")
    assert js["spec"]["suspend"] is True
    eventually.condition(ns, "mover", c.ACCEPTED, "True")
    # the cycle that creates the JobSet writes its name into the status after the create: wait for that write
    status = eventually(lambda: (s := kube.get(RLJOBS, ns, "mover")["status"]).get("jobSetName") and s,
                        "status.jobSetName")
    assert status["jobSetName"] == "mover" and "pytorchJobName" not in status


def test_jobset_kueue_admits_and_preempts(kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    """A second client plays Kueue for the JobSet: creates its Workload, admits (un-suspends) and preempts."""
    queue = {builders.LABEL_KUEUE_QUEUE: "team-a"}
    js = start_jobset(kube, eventually, ns, "js-queued", labels=queue)
    assert js["spec"]["suspend"] is True and js["metadata"]["labels"][builders.LABEL_KUEUE_QUEUE] == "team-a"
    kueue = KubeClient(kube.base_url)
    kueue.create_workload(ns, js)
    eventually.condition(ns, "js-queued", c.ADMITTED, "False", c.REASON_QUEUED)
    kueue.patch(JOBSETS, ns, "js-queued", {"spec": {"suspend": False}})  # admission
    eventually.condition(ns, "js-queued", c.ADMITTED, "True", c.REASON_ADMITTED)
    kube.set_jobset_status(ns, "js-queued", ready=1)
    eventually.condition(ns, "js-queued", c.RUNNING, "True", c.REASON_JOBSET_RUNNING)
    kueue.patch(JOBSETS, ns, "js-queued", {"spec": {"suspend": True}})  # preemption
    eventually.condition(ns, "js-queued", c.ADMITTED, "False", c.REASON_QUEUED)
    assert eventually.event(ns, "js-queued", c.EVENT_PREEMPTED)["type"] == "Warning"
    kube.set_jobset_status(ns, "js-queued", ("Suspended", "True", "SuspendedJobs"), suspended=1)
    eventually.condition(ns, "js-queued", c.RUNNING, "False", c.REASON_QUEUED)
    time.sleep(KUEUE_GRACE_SECONDS + 1)
    assert kube.get(JOBSETS, ns, "js-queued")["spec"]["suspend"] is True, "never un-suspended against the queue"
    assert kube.condition(ns, "js-queued", c.ADMITTED)["reason"] == c.REASON_QUEUED
    kueue.patch(JOBSETS, ns, "js-queued", {"spec": {"suspend": False}})  # re-admission
    eventually.condition(ns, "js-queued", c.ADMITTED, "True", c.REASON_ADMITTED)


def test_no_kueue_workload_is_reported_then_cleared(kube: KubeClient, operator, eventually: Eventually,
                                                    ns: str) -> None:
    """Kueue >= 0.19 ignores PyTorchJobs by default: nothing creates a Workload for the queued PyTorchJob, so
    after the grace period (KUEUE_GRACE_SECONDS here) the RLJob says so, once, with both fixes."""
    body = rljob("ignored")
    body["metadata"]["labels"] = {builders.LABEL_KUEUE_QUEUE: "team-a"}
    kube.create(RLJOBS, ns, body)
    ptj = eventually(lambda: kube.maybe_get(PYTORCHJOBS, ns, "ignored"), "the PyTorchJob")
    eventually.condition(ns, "ignored", c.ADMITTED, "False", c.REASON_QUEUED)
    cond = eventually.condition(ns, "ignored", c.ADMITTED, "False", c.REASON_NO_KUEUE_WORKLOAD,
                                timeout=KUEUE_GRACE_SECONDS + EVENT_DRIVEN)
    warning = eventually.event(ns, "ignored", c.REASON_NO_KUEUE_WORKLOAD)
    assert warning["type"] == "Warning" and warning["message"] == cond["message"]
    assert "kubeflow.org/pytorchjob" in cond["message"] and "integrations.frameworks" in cond["message"]
    assert "spec.childKind: JobSet" in cond["message"]
    time.sleep(2.0)
    assert [e["reason"] for e in kube.events_for(ns, "ignored")].count(c.REASON_NO_KUEUE_WORKLOAD) == 1
    # Kueue (now configured for PyTorchJobs) creates the Workload: the condition clears at once.
    KubeClient(kube.base_url).create_workload(ns, ptj)
    eventually.condition(ns, "ignored", c.ADMITTED, "False", c.REASON_QUEUED)
    assert eventually.event(ns, "ignored", c.EVENT_KUEUE_WORKLOAD_FOUND)["type"] == "Normal"


def test_deleting_a_jobset_rljob_leaves_nothing_behind(kube: KubeClient, operator, eventually: Eventually,
                                                       ns: str) -> None:
    start_jobset(kube, eventually, ns, "js-gone")
    kube.delete(RLJOBS, ns, "js-gone")
    for resource, pattern in [*CHILD_KINDS[:-1], (JOBSETS, "{}")]:
        eventually(lambda r=resource, p=pattern: kube.maybe_get(r, ns, p.format("js-gone")) is None,
                   f"{pattern.format('js-gone')} garbage-collected", timeout=GARBAGE_COLLECTED)


def test_hand_deleted_jobset_is_recreated(kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    js = start_jobset(kube, eventually, ns, "js-again")
    eventually.event(ns, "js-again", c.EVENT_CREATED)
    kube.delete(JOBSETS, ns, "js-again")
    eventually(lambda: (j := kube.maybe_get(JOBSETS, ns, "js-again")) and j["metadata"]["uid"] != js["metadata"][
        "uid"], "the recreated JobSet")
    assert "JobSet js-again was missing" in eventually.event(ns, "js-again", c.EVENT_RECREATED)["message"]


def test_deleting_a_namespace_is_quiet(kube: KubeClient, operator, eventually: Eventually, ns: str) -> None:
    """Deleting a namespace takes its RLJobs and their children in any order: a cycle that finds its
    child gone and may not create one (403, the namespace is terminating) has nothing to do and nothing
    to warn about."""
    from cluster import NAMESPACES

    start_running(kube, eventually, ns, "ns-a")
    start_jobset(kube, eventually, ns, "ns-b")
    logged = len(operator.logs())
    kube.delete(NAMESPACES, None, ns)
    eventually(lambda: kube.maybe_get(NAMESPACES, None, ns) is None, f"namespace {ns} gone", timeout=80)
    time.sleep(2.0)
    warnings = [line for line in operator.logs()[logged:].splitlines() if ns in line and "WARNING" in line]
    assert warnings == []


# ---------------------------------------------------------------------------- last: what every test sent


def test_nothing_the_operator_sent_was_pruned(api_server, operator) -> None:
    """Runs after the module's lifecycles: a real API server drops unknown fields silently (201 and a
    Warning header), so any field of a child, patch or status write the schemas do not know is a bug."""
    pruned = [w for w in api_server.call(api_server.server.unknown_field_warnings)
              if not w[0].startswith("Python-urllib")]  # the tests' own client
    assert pruned == []


# ---------------------------------------------------------------------------- the operator-run judge


JUDGE_REWARD = {"remote": {"protocol": "openai-chat", "judge": {"model": "judge", "promptTemplate": "{completion}"}},
                "server": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}}


def test_the_judge_starts_with_the_job_follows_suspend_and_goes_with_it(kube: KubeClient, operator,
                                                                        eventually: Eventually, ns: str) -> None:
    """spec.reward.server: the judge's Deployment and Service come with the job; JudgeReady follows the
    Deployment's available replicas (read at each reconcile: the resync picks a readiness change up);
    suspend scales it to 0, resume back to 1; deleting the RLJob removes both."""
    start_running(kube, eventually, ns, "jury", reward=JUDGE_REWARD)
    deployment = eventually(lambda: kube.maybe_get(DEPLOYMENTS, ns, "jury-judge"), "the judge Deployment")
    assert deployment["spec"]["replicas"] == 1 and kube.maybe_get(SERVICES, ns, "jury-judge") is not None
    resync = RESYNC_SECONDS + EVENT_DRIVEN
    eventually.condition(ns, "jury", c.JUDGE_READY, "False", c.REASON_JUDGE_STARTING, timeout=resync)
    kube.patch(DEPLOYMENTS, ns, "jury-judge", {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
               subresource="status")
    eventually.condition(ns, "jury", c.JUDGE_READY, "True", c.REASON_JUDGE_READY, timeout=resync)
    kube.patch(RLJOBS, ns, "jury", {"spec": {"suspend": True}})
    eventually(lambda: kube.get(DEPLOYMENTS, ns, "jury-judge")["spec"]["replicas"] == 0, "the judge scaled to 0")
    eventually.condition(ns, "jury", c.JUDGE_READY, "False", c.REASON_JUDGE_SCALED_DOWN)
    kube.patch(RLJOBS, ns, "jury", {"spec": {"suspend": False}})
    eventually(lambda: kube.get(DEPLOYMENTS, ns, "jury-judge")["spec"]["replicas"] == 1, "the judge back at 1")
    kube.delete(RLJOBS, ns, "jury")
    for resource in (DEPLOYMENTS, SERVICES):
        eventually(lambda r=resource: kube.maybe_get(r, ns, "jury-judge") is None, f"{resource[2]} garbage-collected",
                   timeout=GARBAGE_COLLECTED)
