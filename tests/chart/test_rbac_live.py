"""Every request the REAL operator makes is one the chart's RBAC allows.

The operator runs as the chart configures it (the Deployment's args and RLJOB_* env, namespaced mode
with every optional child on) against the test API server of tests/operator (kmock plus a harness,
over HTTP), with the RLJob CRD rendered by the chart. A lifecycle (create, run, suspend, a spec change
while suspended, resume, progress, success, delete; a JobSet child suspended and replaced; a queued
JobSet child) drives it; then every (method, path) in the
server's request log, kopf's own watches, patches and events included, is mapped to an RBAC
(apiGroup, resource, verb) and must be granted by the Role of its namespace or, for cluster-scoped
requests, by the ClusterRole; and every grant must have been used. (test_rbac.py derives the same
set from the code for every values file.)
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import VALUES_FILES, by_kind, one, render
from rbac_needs import format_needs, need_of, rule_needs

OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
if str(OPERATOR_TESTS) not in sys.path:
    sys.path.insert(0, str(OPERATOR_TESTS))

pytestmark = pytest.mark.timeout(120)
SET = ["worker.metricsService=true", "rbac.podMonitors=true"]
NS = "team-a"
PODMONITORS = ("monitoring.coreos.com", "v1", "podmonitors")


def _podmonitor_crd() -> dict[str, Any]:
    """A permissive stand-in for the Prometheus Operator's PodMonitor CRD (schema not under test)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "podmonitors.monitoring.coreos.com"},
        "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                 "names": {"kind": "PodMonitor", "listKind": "PodMonitorList", "plural": "podmonitors",
                           "singular": "podmonitor"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


@pytest.fixture(scope="module")
def chart_docs(helm_bin: str) -> list[dict[str, Any]]:
    (namespaced,) = [f for f in VALUES_FILES if f.stem == "namespaced"]
    return render(helm_bin, [namespaced], SET)


@pytest.fixture(scope="module")
def live_requests(chart_docs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[list[tuple[str, str]]]:
    from apiserver import ApiServerThread
    from cluster import (
        JOBSETS,
        PYTORCHJOBS,
        RLJOBS,
        WORKLOADS,
        KubeClient,
        OperatorProcess,
        free_port,
        wait_until,
    )
    from kube_rbac import User
    from opschema import jobset_crd, pytorchjob_crd, workload_crd
    from rljob_operator.progress import ANNOTATION, encode_progress

    tmp = tmp_path_factory.mktemp("rbac-live")
    account = one(chart_docs, "ServiceAccount")["metadata"]
    # The server enforces RBAC: the operator's token is the chart's ServiceAccount, bound to nothing
    # but the chart's ClusterRole and Roles (the test itself acts as a cluster admin).
    server = ApiServerThread(bookmark_interval=5.0, tokens={
        "test-token": User.service_account(account["namespace"], account["name"]),
        "admin-token": User("admin", ("system:masters",))}).start()
    operator = None
    try:
        kube = KubeClient(server.url, token="admin-token")
        kube.apply_crd(one(chart_docs, "CustomResourceDefinition"))
        kube.apply_crd(pytorchjob_crd())
        kube.apply_crd(jobset_crd())
        kube.apply_crd(workload_crd())
        kube.apply_crd(_podmonitor_crd())
        for ns in ("team-a", "team-b", "elsewhere", account["namespace"]):
            kube.create_namespace(ns)
        rbac = "rbac.authorization.k8s.io"
        for doc in chart_docs:
            if doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
                group, plural = ("", "serviceaccounts") if doc["kind"] == "ServiceAccount" else (
                    rbac, doc["kind"].lower() + "s")
                kube.create((group, "v1", plural), doc["metadata"].get("namespace"), doc)

        container = one(chart_docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
        args = [a for a in container["args"] if not a.startswith("--liveness")]
        args.append(f"--liveness=http://127.0.0.1:{free_port()}/healthz")
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("RLJOB_")}
        env["RLJOB_RESYNC_SECONDS"] = "2"  # let the resync timer run within the test
        operator = OperatorProcess(server.write_kubeconfig(tmp / "kubeconfig.json"), tmp / "operator.log",
                                   env=env, extra_args=args).start()
        operator.wait_ready()

        def eventually(check: Any, what: str) -> Any:
            return wait_until(check, timeout=15, what=what, on_timeout=lambda: operator.logs()[-6000:])

        def condition(type_: str) -> str | None:
            return next((c["status"] for c in (kube.get(RLJOBS, NS, "job").get("status") or {}).get("conditions", [])
                         if c["type"] == type_), None)

        job = yaml.safe_load((OPERATOR_TESTS.parents[1] / "examples" / "quickstart.yaml").read_text())
        job["metadata"] = {"name": "job"}
        job["spec"]["metrics"] = {"enabled": True, "podMonitor": True}
        kube.create(RLJOBS, NS, job)
        eventually(lambda: kube.maybe_get(PODMONITORS, NS, "job"), "the PodMonitor")
        eventually(lambda: kube.maybe_get(PYTORCHJOBS, NS, "job"), "the PyTorchJob")
        kube.set_pytorchjob_conditions(NS, "job", ("Created", "True", "PyTorchJobCreated"),
                                       ("Running", "True", "PyTorchJobRunning"))
        eventually(lambda: condition("Running") == "True", "Running=True")
        kube.patch(RLJOBS, NS, "job", {"spec": {"suspend": True}})
        eventually(lambda: kube.get(PYTORCHJOBS, NS, "job")["spec"]["runPolicy"]["suspend"], "suspended")
        uid = kube.get(PYTORCHJOBS, NS, "job")["metadata"]["uid"]
        kube.patch(RLJOBS, NS, "job", {"spec": {"training": {"lr": 1.0e-3}}})
        eventually(lambda: (kube.maybe_get(PYTORCHJOBS, NS, "job") or {}).get("metadata", {}).get("uid") not in
                   (None, uid), "the PyTorchJob recreated from the new spec")
        kube.patch(RLJOBS, NS, "job", {"spec": {"suspend": False},
                                       "metadata": {"annotations": {ANNOTATION: encode_progress(5, total_steps=30)}}})
        eventually(lambda: (kube.get(RLJOBS, NS, "job").get("status") or {}).get("trainer", {}).get("step") == 5,
                   "progress in the status")
        kube.set_pytorchjob_conditions(NS, "job", ("Succeeded", "True", "PyTorchJobSucceeded"))
        eventually(lambda: condition("Succeeded") == "True", "Succeeded=True")
        wait_until(lambda: operator.metric("rljob_operator_reconciles_total", trigger="resync") > 0, timeout=10,
                   what="a resync cycle")
        # The JobSet child: create, suspend (patch), a spec change while suspended (delete, create again);
        # then a queue-labelled one, whose suspended JobSet makes the operator look for its Kueue Workload.
        job_set = {**job, "metadata": {"name": "js"}, "spec": {**job["spec"], "childKind": "JobSet"}}
        kube.create(RLJOBS, NS, job_set)
        eventually(lambda: kube.maybe_get(JOBSETS, NS, "js"), "the JobSet")
        kube.patch(RLJOBS, NS, "js", {"spec": {"suspend": True}})
        eventually(lambda: kube.get(JOBSETS, NS, "js")["spec"]["suspend"], "the JobSet suspended")
        js_uid = kube.get(JOBSETS, NS, "js")["metadata"]["uid"]
        kube.patch(RLJOBS, NS, "js", {"spec": {"training": {"lr": 1.0e-3}}})
        eventually(lambda: (kube.maybe_get(JOBSETS, NS, "js") or {}).get("metadata", {}).get("uid") not in
                   (None, js_uid), "the JobSet recreated from the new spec")
        queued = {**job_set, "metadata": {"name": "jq", "labels": {"kueue.x-k8s.io/queue-name": "q"}}}
        kube.create(RLJOBS, NS, queued)
        eventually(lambda: any("/workloads" in r for _, r in server.call(lambda: [
            (q.method.value, q.url.path_qs) for q in server.server._requests
            if q.headers.get("Authorization") == "Bearer test-token"])), "a look for the Workload")
        assert kube.items(WORKLOADS, NS) == []
        kube.delete(RLJOBS, NS, "job")
        eventually(lambda: kube.maybe_get(RLJOBS, NS, "job") is None, "the RLJob deleted (kopf's finalizer removed)")
        # The operator authenticates with the kubeconfig's token; the test's own client sends none.
        yield server.call(lambda: [(r.method.value, r.url.path_qs) for r in server.server._requests
                                   if r.headers.get("Authorization") == "Bearer test-token"])
        forbidden = [line for line in operator.logs().splitlines() if " 403" in line or "Forbidden" in line]
        assert not forbidden, "the enforcing server refused the operator:\n" + "\n".join(forbidden[:20])
    finally:
        if operator is not None:
            operator.stop()
        server.stop()


def _verb(method: str, path_qs: str) -> tuple[str, str, str] | None:
    path, _, query = path_qs.partition("?")
    try:
        group, resource, verb = need_of(method, path)
    except ValueError:
        return None  # discovery (/api, /apis/GROUP/VERSION): allowed to every authenticated user
    if verb == "list" and "watch=true" in query:
        verb = "watch"
    return group, resource, verb


def _namespace_of(path: str) -> str | None:
    parts = path.split("?")[0].split("/")
    if "namespaces" in parts:
        i = parts.index("namespaces")
        if i + 2 < len(parts):  # /namespaces/NS/<plural>...: a namespaced request
            return parts[i + 1]
    return None


def test_every_live_request_is_allowed(chart_docs: list[dict[str, Any]], live_requests: list[tuple[str, str]]) -> None:
    roles = {r["metadata"]["namespace"]: rule_needs(r["rules"]) for r in by_kind(chart_docs, "Role")}
    cluster = set().union(*(rule_needs(r["rules"]) for r in by_kind(chart_docs, "ClusterRole")))
    denied: dict[str, set] = {}
    used: set = set()
    for method, path_qs in live_requests:
        need = _verb(method, path_qs)
        if need is None:
            continue
        ns = _namespace_of(path_qs)
        granted = roles.get(ns, set()) if ns is not None else cluster
        used.add(need)
        if need not in granted:
            denied.setdefault(f"{ns or 'cluster'}", set()).add(need)
    assert not denied, "requests the chart's RBAC would forbid:\n" + "\n".join(
        f"{where}: {format_needs(needs)}" for where, needs in denied.items())
    # The walk reached what matters: kopf's watches, finalizer/annotation patches and events, our status writes.
    # ... and the lifecycle used every grant: the chart's RBAC is exactly what the real operator did.
    granted = roles[NS] | cluster
    # Demanded only by the OwnerReferencesPermissionEnforcement admission plugin, which the test API
    # server does not run: creating children with blockOwnerDeletion never shows up as a request.
    granted -= {("rljob.dev", "rljobs/finalizers", "update")}
    # The operator-run judge's Deployment (spec.reward.server): the stand-in serves no apps/v1, so no live job
    # creates one here; the static walk (rbac_needs.py, test_rbac.py) shows the operator needs the rule.
    granted -= {("apps", "deployments", verb) for verb in ("get", "create", "patch")}
    assert used == granted, (f"granted but never used: {format_needs(granted - used)}; "
                             f"used but not granted: {format_needs(used - granted)}")


def test_no_request_touches_secrets_or_unserved_namespaces(live_requests: list[tuple[str, str]]) -> None:
    for method, path_qs in live_requests:
        assert "/secrets" not in path_qs, (method, path_qs)
        ns = _namespace_of(path_qs)
        assert ns in (None, "team-a", "team-b"), f"{method} {path_qs}: outside the served namespaces"
