"""`helm template` for the defaults and every values file: every object validated, and the
operator Deployment, ServiceAccount, monitors and dashboards checked against what they must be."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_support import (
    BUILTIN_KINDS,
    CHART,
    KUBERNETES_VERSION,
    MONITORING_KINDS,
    NAMESPACE,
    VALUES_FILES,
    by_kind,
    monitoring_errors,
    one,
    render,
    values_of,
)

CONFIGS = [None, *VALUES_FILES]
CONFIG_IDS = ["defaults", *(f.stem for f in VALUES_FILES)]
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


def files_of(config: Path | None) -> list[Path]:
    return [] if config is None else [config]


@pytest.fixture(params=CONFIGS, ids=CONFIG_IDS)
def config(request: pytest.FixtureRequest) -> Path | None:
    return request.param


# ---------------------------------------------------------------------------- every object valid


def test_every_rendered_object_is_valid(helm_bin: str, config: Path | None) -> None:
    docs = render(helm_bin, files_of(config))
    assert docs, "nothing rendered"
    problems = []
    for doc in docs:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        where = f"{kind} {name}"
        if kind in BUILTIN_KINDS:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{where}: {exc.message} at {'/'.join(map(str, exc.path))}")
        elif kind in MONITORING_KINDS:
            problems += [f"{where}: {e}" for e in monitoring_errors(doc)]
        else:
            problems.append(f"{where}: a kind these tests do not validate; add it to chart_support")
        labels = doc["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/managed-by") != "Helm":
            problems.append(f"{where}: missing the chart's common labels")
        if kind not in CLUSTER_SCOPED and not doc["metadata"].get("namespace"):
            problems.append(f"{where}: namespaced object without metadata.namespace")
        if kind in CLUSTER_SCOPED and "namespace" in doc["metadata"]:
            problems.append(f"{where}: cluster-scoped object with a namespace")
    assert not problems, "\n".join(problems)
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"duplicate objects: {sorted(keys)}"


def test_validation_catches_an_unknown_field(helm_bin: str) -> None:
    """The validator in use is strict (else the test above could not fail)."""
    deployment = one(render(helm_bin), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
               "metadata": {"name": "x", "namespace": "y"},
               "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "m", "pth": "/"}]}}
    assert monitoring_errors(monitor)


# ---------------------------------------------------------------------------- monitors off by default


def test_monitors_are_off_by_default(helm_bin: str) -> None:
    docs = render(helm_bin)
    assert not [d["kind"] for d in docs if d["kind"] in MONITORING_KINDS]
    assert not [d for d in by_kind(docs, "Service")], "no metrics Service unless asked for"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["serviceMonitor"]["enabled"] is False
    assert values["metrics"]["podMonitor"]["enabled"] is False
    assert values["workerMonitoring"]["podMonitor"]["enabled"] is False
    assert values["workerMonitoring"]["serviceMonitor"]["enabled"] is False
    assert values["prometheusRule"]["enabled"] is False


def test_every_monitor_renders_when_enabled(helm_bin: str) -> None:
    docs = render(helm_bin, [CHART_VALUES("monitoring")])
    names = sorted((d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in MONITORING_KINDS)
    assert names == [
        ("PodMonitor", "rljob-rljob-operator"), ("PodMonitor", "rljob-rljob-operator-workers"),
        ("PrometheusRule", "rljob-rljob-operator"),
        ("ServiceMonitor", "rljob-rljob-operator"), ("ServiceMonitor", "rljob-rljob-operator-workers"),
    ]
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def CHART_VALUES(stem: str) -> Path:
    (path,) = [f for f in VALUES_FILES if f.stem == stem]
    return path


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_operator_monitors_select_the_operator(helm_bin: str) -> None:
    docs = render(helm_bin, [CHART_VALUES("monitoring")])
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert ports["metrics"] == 9090 and env["RLJOB_OPERATOR_METRICS_PORT"] == "9090"

    service = one(docs, "Service", "rljob-rljob-operator-metrics")
    assert _matches(service["spec"]["selector"], pod_labels)
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    smon = one(docs, "ServiceMonitor", "rljob-rljob-operator")
    assert _matches(smon["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert smon["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert smon["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    pmon = one(docs, "PodMonitor", "rljob-rljob-operator")
    assert _matches(pmon["spec"]["selector"]["matchLabels"], pod_labels)
    assert pmon["spec"]["podMetricsEndpoints"][0]["port"] in ports
    # The operator's monitors select nothing of the workers and vice versa.
    assert not _matches(pmon["spec"]["selector"]["matchLabels"], worker_pod_labels())


def worker_pod_labels() -> dict[str, str]:
    from rljob_api.validation import parse_rljob
    from rljob_operator import builders
    from rljob_operator.settings import OperatorSettings

    job = parse_rljob(_quickstart_doc())
    ptj = builders.build_pytorchjob(job, OperatorSettings())
    return ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]


def _quickstart_doc() -> dict[str, Any]:
    doc = yaml.safe_load((CHART.parents[1] / "examples" / "quickstart.yaml").read_text())
    doc["metadata"].update({"namespace": "team-a", "uid": "u-1"})
    return doc


@pytest.mark.parametrize("config_name", ["monitoring", "namespaced"])
def test_worker_monitors_select_the_training_pods_and_metrics_services(helm_bin: str, config_name: str) -> None:
    """The worker monitors select exactly what the operator's builders label, on the port they name."""
    from rljob_api.validation import parse_rljob
    from rljob_operator import builders
    from rljob_operator.settings import OperatorSettings

    files = [CHART_VALUES("monitoring")] + ([CHART_VALUES("namespaced")] if config_name == "namespaced" else [])
    docs = render(helm_bin, files)
    job = parse_rljob(_quickstart_doc())
    settings = OperatorSettings(metrics_service=True)
    ptj = builders.build_pytorchjob(job, settings)
    for replica in ptj["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]
        pmon = one(docs, "PodMonitor", "rljob-rljob-operator-workers")
        assert _matches(pmon["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
        port_names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
        assert pmon["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    svc = builders.build_metrics_service(job, settings)
    smon = one(docs, "ServiceMonitor", "rljob-rljob-operator-workers")
    assert _matches(smon["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert smon["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    # ... and nothing else the operator creates (the spec ConfigMap, RBAC objects).
    for child in builders.build_children(job, settings):
        if child["kind"] != "Service":
            assert not _matches(smon["spec"]["selector"]["matchLabels"], child["metadata"]["labels"])
    expected_ns = {"any": True} if config_name == "monitoring" else {"matchNames": ["team-a", "team-b"]}
    assert pmon["spec"]["namespaceSelector"] == expected_ns
    assert smon["spec"]["namespaceSelector"] == expected_ns


def test_worker_service_monitor_needs_the_metrics_services(helm_bin: str) -> None:
    from chart_support import HelmError

    with pytest.raises(HelmError, match="worker.metricsService"):
        render(helm_bin, set_values=["workerMonitoring.serviceMonitor.enabled=true"])


def test_prometheus_rule_wraps_the_alert_rules_verbatim(helm_bin: str, promtool_bin: str, tmp_path: Path) -> None:
    import subprocess

    rule = one(render(helm_bin, [CHART_VALUES("monitoring")]), "PrometheusRule")
    source = yaml.safe_load((CHART / "files" / "alerts.rules.yaml").read_text())
    assert set(source) == {"groups"}, "the rules file must hold only `groups` (it is inserted under spec)"
    assert rule["spec"] == source, "Helm changed the rules (a template rendered inside them?)"
    assert "{{ $labels.rljob }}" in json.dumps(rule["spec"])
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    proc = subprocess.run([promtool_bin, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- dashboards


def test_one_labelled_configmap_per_dashboard(helm_bin: str) -> None:
    dashboards = sorted((CHART / "dashboards").glob("*.json"))
    assert dashboards
    docs = render(helm_bin)
    cms = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(cms) == len(dashboards)
    by_key = {key: (cm, value) for cm in cms for key, value in cm["data"].items()}
    for path in dashboards:
        cm, text = by_key[path.name]
        assert len(cm["data"]) == 1
        assert json.loads(text) == json.loads(path.read_text()), f"{path.name} changed on the way"
        assert cm["metadata"]["namespace"] == NAMESPACE
        assert len(cm["metadata"]["name"]) <= 63


def test_dashboards_namespace_and_toggle(helm_bin: str) -> None:
    cms = [d for d in render(helm_bin, [CHART_VALUES("monitoring")]) if d["kind"] == "ConfigMap"]
    assert cms and {cm["metadata"]["namespace"] for cm in cms} == {"monitoring"}
    assert all(cm["metadata"]["annotations"] == {"grafana_folder": "rljob"} for cm in cms)
    assert not by_kind(render(helm_bin, [CHART_VALUES("worker-defaults")]), "ConfigMap")


# ---------------------------------------------------------------------------- the operator Deployment


def test_operator_deployment_is_hardened(helm_bin: str, config: Path | None) -> None:
    docs = render(helm_bin, files_of(config))
    deployment = one(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/tmp" in mounts, "a read-only root filesystem needs a writable /tmp"
    assert not any("secret" in v for v in pod.get("volumes", [])), "the operator mounts no Secret"
    assert all("valueFrom" not in e or "secretKeyRef" not in e["valueFrom"] for e in container["env"])
    assert pod["serviceAccountName"] == (one(docs, "ServiceAccount")["metadata"]["name"])


def test_probes_hit_the_kopf_liveness_endpoint_the_operator_is_started_with(helm_bin: str, config: Path | None) -> None:
    from urllib.parse import urlparse

    from rljob_operator.__main__ import build_parser

    container = one(render(helm_bin, files_of(config)), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "command" not in container, "the image's entrypoint (python -m rljob_operator) runs"
    args = build_parser().parse_args(container["args"])  # the operator's own parser accepts them
    liveness = urlparse(args.liveness)
    assert liveness.hostname == "0.0.0.0" and liveness.path == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in (container["livenessProbe"], container["readinessProbe"]):
        assert probe["httpGet"]["path"] == liveness.path
        port = probe["httpGet"]["port"]
        assert ports.get(port, port) == liveness.port
    values = values_of(files_of(config))
    assert liveness.port == values["operator"]["healthPort"]
    metrics_port = int({e["name"]: e.get("value") for e in container["env"]}["RLJOB_OPERATOR_METRICS_PORT"])
    assert metrics_port != liveness.port, "metrics and liveness cannot share a port"
    assert (ports.get("metrics") or 0) == metrics_port
    assert args.peering is None, "one replica, standalone: no kopf peering"
    level = values["operator"]["logLevel"]
    assert (args.verbose, args.quiet) == (level == "debug", level == "warning")


def _settings_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("RLJOB_")}


def test_operator_env_is_exactly_what_settings_reads(helm_bin: str, config: Path | None) -> None:
    """Every RLJOB_* variable settings.py reads is set by the chart, and nothing it ignores."""
    import re

    from rljob_operator import settings as settings_module
    from rljob_operator.settings import OperatorSettings

    read = set(re.findall(r'"(RLJOB_[A-Z0-9_]+)"', Path(settings_module.__file__).read_text()))
    container = one(render(helm_bin, files_of(config)), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = _settings_env(container)
    assert set(env) == read
    OperatorSettings.from_env(env)  # parses (a bad value raises, naming the variable)


@pytest.mark.parametrize("config_name", ["worker-defaults", "monitoring"])
def test_values_reach_the_operator_settings(helm_bin: str, config_name: str) -> None:
    from rljob_operator.settings import OperatorSettings

    files = [CHART_VALUES(config_name)]
    values = values_of(files)
    container = one(render(helm_bin, files), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    s = OperatorSettings.from_env(_settings_env(container))
    worker, op = values["worker"], values["operator"]
    assert s.worker_image == f"{worker['image']['repository']}:{worker['image']['tag'] or '0.1.0'}"
    assert (s.worker_module, s.master_port) == (worker["module"], worker["masterPort"])
    assert (s.progress_rbac, s.metrics_service) == (worker["progressRbac"], worker["metricsService"])
    assert (s.resync_seconds, s.api_timeout_seconds, s.api_concurrency, s.watch_server_timeout) == (
        op["resyncSeconds"], op["apiTimeoutSeconds"], op["apiConcurrency"], op["watchServerTimeoutSeconds"])
    assert s.operator_metrics_port == (values["metrics"]["port"] if values["metrics"]["enabled"] else 0)


def test_default_worker_image_is_the_operators_default(helm_bin: str) -> None:
    from rljob_operator.settings import OperatorSettings

    container = one(render(helm_bin), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert OperatorSettings.from_env(_settings_env(container)) == OperatorSettings()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert container["image"] == f"ghcr.io/rljob/operator:{chart['appVersion']}"


def test_custom_values_are_used(helm_bin: str) -> None:
    docs = render(helm_bin, [CHART_VALUES("worker-defaults")])
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/ml/rljob-operator:0.1.0"
    assert {"name": "HTTPS_PROXY", "value": "http://proxy.example.com:3128"} in container["env"]
    assert pod["serviceAccountName"] == "rljob-controller"
    sa = one(docs, "ServiceAccount")
    assert sa["metadata"]["name"] == "rljob-controller"
    assert sa["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    assert "metrics" not in {p["name"] for p in container["ports"]}
    assert not by_kind(docs, "CustomResourceDefinition")
    ns_pod = one(render(helm_bin, [CHART_VALUES("namespaced")]), "Deployment")["spec"]["template"]["spec"]
    assert ns_pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_watch_mode_args(helm_bin: str) -> None:
    from rljob_operator.__main__ import build_parser

    def args_of(files: list[Path]):
        container = one(render(helm_bin, files), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        return build_parser().parse_args(container["args"])

    cluster = args_of([])
    assert cluster.all_namespaces and not cluster.namespaces
    namespaced = args_of([CHART_VALUES("namespaced")])
    assert not namespaced.all_namespaces and namespaced.namespaces == ["team-a", "team-b"]


def test_namespaced_installs_in_two_namespaces_claim_different_cluster_scoped_objects(helm_bin: str) -> None:
    """One operator per team: the same release name installed in two namespaces, each serving its own
    (the second leaves the CRD to the first). Helm refuses an object another release owns, so no
    cluster-scoped name may repeat."""
    from chart_support import helm

    def cluster_scoped(namespace: str, *sets: str) -> set[tuple[str, str]]:
        args = ["template", "rljob", str(CHART), "--namespace", namespace, "--set", f"watchNamespaces[0]={namespace}"]
        for value in sets:
            args += ["--set", value]
        docs = [d for d in yaml.safe_load_all(helm(helm_bin, *args).stdout) if d]
        return {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in CLUSTER_SCOPED}

    first = cluster_scoped("team-a")
    second = cluster_scoped("team-b", "crds.install=false")
    assert {kind for kind, _ in first} >= {"ClusterRole", "ClusterRoleBinding"}
    assert first & second == set()


# ---------------------------------------------------------------------------- NOTES.txt


def test_notes_tell_what_to_apply_next(helm_bin: str) -> None:
    from chart_support import helm

    out = helm(helm_bin, "install", "rljob", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
               "--values", str(CHART_VALUES("namespaced"))).stdout
    notes = out.split("NOTES:", 1)[1]
    assert "kubectl apply -n team-a -f examples/quickstart.yaml" in notes
    assert "kubectl get rlj -n team-a" in notes
    assert "team-a, team-b" in notes
    assert "rollout status deployment/rljob-rljob-operator" in notes
    # The operator sets no finalizer on RLJobs (test_operator_e2e checks the stored object).
    assert "puts no finalizer on RLJobs" in notes and "kopf puts a finalizer" not in notes
