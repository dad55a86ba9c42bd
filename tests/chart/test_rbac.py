"""The chart's RBAC grants exactly what the operator's code uses: no more, no less.

The needs are derived from the operator's code by tests/chart/rbac_needs.py (read its docstring):
its real reconcile cycles run against a recording object store, kopf's needs come from kopf's
handler registry and the operator's real startup settings, and the mode and settings come from
the rendered Deployment through the operator's own argument parser and `OperatorSettings.from_env`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import rbac_needs
from chart_support import NAMESPACE, VALUES_FILES, by_kind, one, render, values_of
from rbac_needs import Need, format_needs, rule_needs

CONFIGS = [None, *VALUES_FILES]
CONFIG_IDS = ["defaults", *(f.stem for f in VALUES_FILES)]
FORBIDDEN_VERBS = {"*", "bind", "escalate", "impersonate"}


def files_of(config: Path | None) -> list[Path]:
    return [] if config is None else [config]


def operator_needs(docs: list[dict[str, Any]], values: dict[str, Any], monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[set[Need], set[Need], rbac_needs.Recording, Any]:
    """(namespaced needs, cluster-scoped needs, the recording, the parsed args) for one rendering."""
    from rljob_operator.__main__ import build_parser
    from rljob_operator.settings import OperatorSettings

    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("RLJOB_")}
    settings = OperatorSettings.from_env(env)
    # RLJobs ask for a PodMonitor in their own spec; the chart decides whether that is allowed.
    recording = rbac_needs.record_operator_calls(settings, pod_monitor=values["rbac"]["podMonitors"],
                                                 monkeypatch=monkeypatch)
    kopf_settings = rbac_needs.kopf_startup_settings(monkeypatch)
    kopf_ns, kopf_cluster = rbac_needs.kopf_needs(clusterwide=args.all_namespaces, standalone=args.peering is None,
                                                  settings=kopf_settings)
    cluster = kopf_cluster if values["rbac"]["clusterDiscovery"] else set()
    return recording.needs | kopf_ns | owner_reference_needs(recording), cluster, recording, args


def owner_reference_needs(recording: rbac_needs.Recording) -> set[Need]:
    """Creating a child with `blockOwnerDeletion: true` needs `update` on the owner's finalizers
    subresource wherever the OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift)."""
    needs: set[Need] = set()
    for body in recording.created:
        for ref in body.get("metadata", {}).get("ownerReferences", []):
            if ref.get("blockOwnerDeletion"):
                group = ref["apiVersion"].split("/")[0] if "/" in ref["apiVersion"] else ""
                needs.add((group, f"{ref['kind'].lower()}s/finalizers", "update"))
    return needs


def test_chart_rbac_equals_the_operators_needs(helm_bin: str, config: Path | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    files = files_of(config)
    docs = render(helm_bin, files)
    values = values_of(files)
    namespaced, cluster, _, args = operator_needs(docs, values, monkeypatch)
    sa = one(docs, "ServiceAccount")["metadata"]["name"] if values["serviceAccount"]["create"] else None
    subject = {"kind": "ServiceAccount", "name": sa or values["serviceAccount"]["name"], "namespace": NAMESPACE}

    cluster_roles = {d["metadata"]["name"]: d for d in by_kind(docs, "ClusterRole")}
    bound_cluster: set[Need] = set()
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [subject]
        bound_cluster |= rule_needs(cluster_roles[binding["roleRef"]["name"]]["rules"])
    assert len(by_kind(docs, "ClusterRoleBinding")) == len(cluster_roles), "an unbound ClusterRole"

    if args.all_namespaces:
        assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
        expected = namespaced | cluster
        assert bound_cluster == expected, (
            f"ClusterRole grants {format_needs(bound_cluster - expected)} more and "
            f"{format_needs(expected - bound_cluster)} less than the operator needs")
    else:
        assert bound_cluster == cluster, (
            f"namespaced mode: cluster-scoped grants {format_needs(bound_cluster)} != {format_needs(cluster)}")
        roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in by_kind(docs, "Role")}
        bindings = by_kind(docs, "RoleBinding")
        assert sorted(ns for ns, _ in roles) == sorted(args.namespaces)
        assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(args.namespaces)
        for binding in bindings:
            assert binding["subjects"] == [subject]
            role = roles[(binding["metadata"]["namespace"], binding["roleRef"]["name"])]
            granted = rule_needs(role["rules"])
            assert granted == namespaced, (
                f"Role in {binding['metadata']['namespace']} grants {format_needs(granted - namespaced)} more and "
                f"{format_needs(namespaced - granted)} less than the operator needs")


@pytest.fixture(params=CONFIGS, ids=CONFIG_IDS)
def config(request: pytest.FixtureRequest) -> Path | None:
    return request.param


def test_no_secrets_no_wildcards_no_escalation(helm_bin: str, config: Path | None) -> None:
    docs = render(helm_bin, files_of(config))
    for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
        for rule in role["rules"]:
            assert "secrets" not in rule["resources"], f"{role['metadata']['name']} grants secrets: {rule}"
            assert "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
            assert not FORBIDDEN_VERBS & set(rule["verbs"]), rule


def test_operator_holds_every_permission_it_hands_out(helm_bin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RBAC escalation prevention: the per-job progress Role's rules must be ones the operator holds
    (it has neither `bind` nor `escalate`), or creating the Role/RoleBinding is forbidden."""
    docs = render(helm_bin)
    values = values_of([])
    _, _, recording, _ = operator_needs(docs, values, monkeypatch)
    roles = [b for b in recording.created if b["kind"] == "Role"]
    assert roles, "the default settings create a per-job progress Role"
    (cluster_role,) = by_kind(docs, "ClusterRole")
    held = rule_needs(cluster_role["rules"])
    for role in roles:
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert (group, resource, verb) in held, f"the operator hands out {rule} without holding it"


def test_derivation_exercises_every_request_kube_io_can_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lifecycle walk covers every kind of request in kube_io.py (else a need could hide)."""
    from rljob_operator.settings import OperatorSettings

    recording = rbac_needs.record_operator_calls(OperatorSettings(progress_rbac=True, metrics_service=True),
                                                 pod_monitor=True, monkeypatch=monkeypatch)
    source_methods = {method for _, method in rbac_needs.kube_io_request_verbs()}
    assert source_methods, "found no self._request(...) calls in kube_io.py; update rbac_needs"
    recorded_methods = {method for method, _, _ in recording.requests}
    assert source_methods <= recorded_methods, f"not exercised: {source_methods - recorded_methods}"
    kinds = {b["kind"] for b in recording.created}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "PyTorchJob", "JobSet", "Service",
                     "PodMonitor", "Event", "Deployment"}
    verbs = {(g, r, v) for g, r, v in recording.needs}
    assert ("kubeflow.org", "pytorchjobs", "delete") in verbs and ("", "configmaps", "patch") in verbs
    assert {("jobset.x-k8s.io", "jobsets", v) for v in ("get", "create", "patch", "delete")} <= verbs
    assert ("kueue.x-k8s.io", "workloads", "list") in verbs
    assert ("rljob.dev", "rljobs/status", "patch") in verbs
    assert recording.events, "the walk posted no events"


def test_declared_permission_table_matches_the_recorded_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """If kube_io declares its permissions (REQUIRED_PERMISSIONS / API_CALLS), they are what it does."""
    from rljob_operator.settings import OperatorSettings

    declared = rbac_needs.declared_table()
    if declared is None:
        pytest.skip("kube_io.py declares no permission table; the recording alone is the source")
    recording = rbac_needs.record_operator_calls(OperatorSettings(progress_rbac=True, metrics_service=True),
                                                 pod_monitor=True, monkeypatch=monkeypatch)
    kopf_event = rbac_needs.kopf_event_need()
    assert declared - {kopf_event} == recording.needs - {kopf_event}


def test_the_comparison_can_fail(helm_bin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant the operator does not use, or a missing one, is caught (mutation check)."""
    docs = render(helm_bin)
    namespaced, cluster, _, _ = operator_needs(docs, values_of([]), monkeypatch)
    granted = rule_needs(one(docs, "ClusterRole")["rules"])
    assert granted == namespaced | cluster
    assert granted | {("", "secrets", "get")} != namespaced | cluster
    assert granted - {("kubeflow.org", "pytorchjobs", "delete")} != namespaced | cluster
