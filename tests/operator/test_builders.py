"""Pure child builders: table-driven properties and golden files.

Golden files live in tests/operator/golden/; regenerate them after an intended change with
    RLJOB_UPDATE_GOLDEN=1 python -m pytest tests/operator/test_builders.py
and review the diff.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import opschema
import pytest
import yaml
from rljob_api.validation import parse_rljob
from rljob_operator import builders
from rljob_operator.settings import OperatorSettings

HERE = Path(__file__).resolve().parent
EXAMPLES = opschema.REPO / "examples"
GOLDEN = HERE / "golden"
UID = "0f6c8a4e-1d2b-4c3a-9e8f-7a6b5c4d3e2f"


def load_example(name: str, **meta: Any) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    doc["metadata"].update({"namespace": "team-a", "uid": UID, **meta})
    return doc


def job_from(doc: dict[str, Any]):
    return parse_rljob(doc)


def multinode_doc() -> dict[str, Any]:
    """Everything a user can override, on 4 nodes, suspended, with a PodMonitor."""
    doc = load_example("qwen2.5-7b-grpo-tp4.yaml")
    spec = doc["spec"]
    spec["nnodes"] = 4
    spec["suspend"] = True
    spec["metrics"] = {"port": 9500, "podMonitor": True}
    spec["runPolicy"] = {"backoffLimit": 5, "activeDeadlineSeconds": 86400, "ttlSecondsAfterFinished": 600}
    spec["podTemplate"] = {
        "resources": {"requests": {"cpu": "32", "memory": "400Gi", "nvidia.com/gpu": "8"},
                      "limits": {"memory": "500Gi"}},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "AWS_REGION", "value": "eu-west-1"}],
        "labels": {"team": "rl"},
        "annotations": {"example.com/owner": "rl-team"},
        "serviceAccountName": "trainer",
        "imagePullSecrets": ["regcred"],
        "priorityClassName": "high",
        "schedulerName": "volcano",
        "terminationGracePeriodSeconds": 600,
        "shmSize": "64Gi",
    }
    spec["s3"]["credentialsSecretRef"] = {"name": "s3-creds", "accessKeyIdKey": "id", "secretAccessKeyKey": "secret"}
    spec["tracking"] = {
        "mlflow": {"trackingUri": "http://mlflow.ml.svc:5000", "tokenSecretRef": {"name": "mlflow", "key": "token"}},
        "wandb": {"project": "rl", "apiKeySecretRef": {"name": "wandb", "key": "api-key"}}}
    return doc


def jobset_doc() -> dict[str, Any]:
    """The multinode overrides as a JobSet in a Kueue queue."""
    doc = multinode_doc()
    doc["spec"]["childKind"] = "JobSet"
    doc["spec"]["suspend"] = False
    doc["metadata"]["labels"] = {builders.LABEL_KUEUE_QUEUE: "team-a", builders.LABEL_KUEUE_PRIORITY: "high"}
    return doc


GOLDEN_CASES = {
    "jobset-queued": (jobset_doc, OperatorSettings(metrics_service=True, worker_image="registry.local/w:1")),
    "quickstart": (lambda: load_example("quickstart.yaml"), OperatorSettings()),
    "qwen3-8b-grpo-megatron": (lambda: load_example("qwen3-8b-grpo-megatron.yaml"), OperatorSettings()),
    "multinode-overrides": (multinode_doc, OperatorSettings(metrics_service=True, worker_image="registry.local/w:1")),
    "no-progress-rbac": (lambda: load_example("qwen2.5-7b-grpo-tp2.yaml"), OperatorSettings(progress_rbac=False)),
    "qwen2.5-7b-ppo-split": (lambda: load_example("qwen2.5-7b-ppo-split.yaml"), OperatorSettings()),
    "qwen2.5-7b-grpo-judge": (lambda: load_example("qwen2.5-7b-grpo-judge.yaml"), OperatorSettings()),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_children_match_golden_files(case: str) -> None:
    make_doc, settings = GOLDEN_CASES[case]
    children = builders.build_children(job_from(make_doc()), settings)
    text = yaml.safe_dump_all(children, sort_keys=False, width=120)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("RLJOB_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with RLJOB_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{case}: children differ from {path} (RLJOB_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_every_child_passes_its_schema_and_the_webhook_rules(case: str) -> None:
    make_doc, settings = GOLDEN_CASES[case]
    for child in builders.build_children(job_from(make_doc()), settings):
        if child["kind"] == "PyTorchJob":
            assert opschema.pytorchjob_schema_errors(child) == []
            assert opschema.pytorchjob_webhook_errors(child) == []
        elif child["kind"] == "JobSet":
            assert opschema.jobset_schema_errors(child) == []
        elif child["kind"] == "PodMonitor":
            assert child["apiVersion"] == "monitoring.coreos.com/v1"
        else:
            assert opschema.builtin_errors(child) == [], child["kind"]


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_renders_a_valid_pytorchjob(example: str) -> None:
    ptj = builders.build_pytorchjob(job_from(load_example(example)), OperatorSettings())
    assert opschema.pytorchjob_schema_errors(ptj) == []
    assert opschema.pytorchjob_webhook_errors(ptj) == []


def test_the_schema_check_can_fail() -> None:
    """The strict validator really rejects unknown and mistyped fields deep in the pod template."""
    ptj = builders.build_pytorchjob(job_from(load_example("quickstart.yaml")), OperatorSettings())
    bad = copy.deepcopy(ptj)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    bad["spec"]["runPolicy"]["backoffLimit"] = "three"
    errors = opschema.pytorchjob_schema_errors(bad)
    assert any("imagePullPolcy" in e for e in errors) and any("backoffLimit" in e for e in errors), errors
    bad = copy.deepcopy(ptj)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    bad["spec"]["pytorchReplicaSpecs"]["Worker"] = {"replicas": 0, "template": {"spec": {"containers": []}}}
    errors = opschema.pytorchjob_webhook_errors(bad)
    assert len(errors) == 3, errors


NNODES_TABLE = [(1, None), (2, 1), (3, 2), (16, 15)]


@pytest.mark.parametrize(("nnodes", "workers"), NNODES_TABLE)
def test_replicas_one_master_and_nnodes_minus_one_workers(nnodes: int, workers: int | None) -> None:
    doc = load_example("quickstart.yaml")
    doc["spec"]["nnodes"] = nnodes
    ptj = builders.build_pytorchjob(job_from(doc), OperatorSettings())
    replicas = ptj["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    if workers is None:
        assert "Worker" not in replicas  # the webhook rejects Worker with 0 replicas
    else:
        assert replicas["Worker"]["replicas"] == workers
    for spec in replicas.values():
        assert spec["restartPolicy"] == "OnFailure"


DEVICE_TABLE = [
    # device, gpusPerNode, user resources, expected container resources
    ("gpu", 8, {}, {"limits": {"nvidia.com/gpu": "8"}}),
    ("gpu", 4, {"requests": {"cpu": "8", "nvidia.com/gpu": "4"}},
     {"requests": {"cpu": "8", "nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}),
    # validation refuses these two (a GPU count other than gpusPerNode, a GPU on device cpu); an RLJob stored
    # before it did still gets gpusPerNode's count
    ("gpu", 4, {"requests": {"cpu": "8", "nvidia.com/gpu": "2"}},
     {"requests": {"cpu": "8", "nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}),
    ("cpu", 2, {}, None),
    ("cpu", 2, {"limits": {"cpu": "4", "nvidia.com/gpu": "1"}}, {"limits": {"cpu": "4"}}),
]


@pytest.mark.parametrize(("device", "gpus", "user", "expected"), DEVICE_TABLE)
def test_gpu_resources_follow_device_and_gpus_per_node(device: str, gpus: int, user: dict, expected: dict | None) -> None:
    doc = load_example("quickstart.yaml")
    doc["spec"].update({"device": device, "gpusPerNode": gpus})
    doc["spec"]["training"].update({"trainBatchSizePerNode": 4, "ppoMiniBatchSizePerNode": 4, "microBatchSizePerGpu": 1})
    job = job_from(doc)
    job.spec.pod_template.resources = user  # after validation, as a stored object reaches the builder
    ptj = builders.build_pytorchjob(job, OperatorSettings())
    container = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container.get("resources") == expected
    assert ptj["spec"]["nprocPerNode"] == str(gpus)


def test_a_shared_critic_with_its_own_sizes_runs_two_processes_per_gpu() -> None:
    """Trinity's critic block (TP4 beside an actor at TP2 PP2, shared): torchrun starts a critic process beside
    every actor process; the pods still ask for gpusPerNode GPUs. Both child kinds say the same."""
    doc = load_example("trinity-ppo-megatron.yaml")
    ptj = builders.build_pytorchjob(job_from(doc), OperatorSettings())
    assert ptj["spec"]["nprocPerNode"] == "16"
    assert _container(ptj)["resources"]["limits"]["nvidia.com/gpu"] == "8"
    doc["spec"]["childKind"] = "JobSet"
    jobset = builders.build_jobset(job_from(doc), OperatorSettings())
    env = {e["name"]: e.get("value") for e in
           jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PET_NPROC_PER_NODE"] == "16"


def test_split_critic_pool_is_inside_the_same_pods() -> None:
    """Split pools are ranks of one world: each pod asks for all gpusPerNode GPUs (actor and critic pools
    together) and runs one process per GPU; no second job or replica type."""
    ptj = builders.build_pytorchjob(job_from(load_example("qwen2.5-7b-ppo-split.yaml")), OperatorSettings())
    assert ptj["spec"]["nprocPerNode"] == "8"
    assert set(ptj["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert _container(ptj)["resources"]["limits"]["nvidia.com/gpu"] == "8"
    doc = load_example("qwen2.5-7b-ppo-split.yaml")
    doc["spec"]["nnodes"] = 2
    ptj = builders.build_pytorchjob(job_from(doc), OperatorSettings())
    assert ptj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert _container(ptj, "Worker")["resources"]["limits"]["nvidia.com/gpu"] == "8"


def _container(ptj: dict[str, Any], replica: str = "Master") -> dict[str, Any]:
    return ptj["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]


def test_container_contract() -> None:
    settings = OperatorSettings()
    job = job_from(load_example("qwen3-8b-grpo-megatron.yaml"))
    ptj = builders.build_pytorchjob(job, settings)
    container = _container(ptj)
    assert container["name"] == "pytorch"
    assert container["command"] == ["python", "-m", "rljob_worker.runtime.launch", "-m", "rljob_worker", "--spec",
                                    "/etc/rljob/spec.json"]
    assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in container["ports"]
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert env["RLJOB_NAME"]["value"] == "qwen3-8b-grpo"
    assert env["RLJOB_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.minio.svc:9000"
    assert env["AWS_REGION"]["value"] == "us-east-1"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "s3-credentials", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert not any(k.startswith("PET_") for k in env), "the training-operator injects PET_*"
    pod = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert volumes["rljob-spec"] == {"name": "rljob-spec", "configMap": {"name": "qwen3-8b-grpo-spec"}}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm" and mounts["/etc/rljob"]["readOnly"] is True
    assert pod["serviceAccountName"] == "qwen3-8b-grpo-worker"


def test_user_overrides_are_merged() -> None:
    job = job_from(multinode_doc())
    ptj = builders.build_pytorchjob(job, OperatorSettings())
    for replica in ("Master", "Worker"):
        pod = ptj["spec"]["pytorchReplicaSpecs"][replica]["template"]
        container = pod["spec"]["containers"][0]
        env = [e["name"] for e in container["env"]]
        assert env.count("AWS_REGION") == 1
        assert {"name": "AWS_REGION", "value": "eu-west-1"} in container["env"]  # the user's value wins
        assert env[-1] == "AWS_REGION" and "NCCL_DEBUG" in env
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
        assert pod["metadata"]["labels"]["team"] == "rl"
        assert pod["metadata"]["labels"][builders.LABEL_JOB] == job.metadata.name
        assert pod["spec"]["serviceAccountName"] == "trainer"
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["spec"]["terminationGracePeriodSeconds"] == 600
    assert ptj["spec"]["runPolicy"] == {"backoffLimit": 5, "suspend": True, "activeDeadlineSeconds": 86400,
                                        "ttlSecondsAfterFinished": 600}
    kinds = [c["kind"] for c in builders.build_children(job, OperatorSettings())]
    assert "ServiceAccount" not in kinds, "a user-named service account is bound, not created"
    binding = next(c for c in builders.build_children(job, OperatorSettings()) if c["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainer", "namespace": "team-a"}]


def test_ownership_labels_and_namespace_on_every_child() -> None:
    job = job_from(multinode_doc())
    for child in builders.build_children(job, OperatorSettings(metrics_service=True)):
        meta = child["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob",
                                            "name": job.metadata.name, "uid": UID, "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"][builders.LABEL_MANAGED_BY] == "rljob-operator"
        assert meta["labels"][builders.LABEL_JOB] == job.metadata.name
        assert meta["labels"]["app.kubernetes.io/instance"] == job.metadata.name


def test_without_uid_there_is_no_owner_reference() -> None:
    doc = load_example("quickstart.yaml")
    del doc["metadata"]["uid"]
    for child in builders.build_children(job_from(doc), OperatorSettings()):
        assert "ownerReferences" not in child["metadata"]


def test_progress_role_is_narrow() -> None:
    job = job_from(load_example("quickstart.yaml"))
    role = builders.build_progress_role(job, OperatorSettings())
    assert role["rules"] == [{"apiGroups": ["rljob.dev"], "resources": ["rljobs"], "resourceNames": ["quickstart"],
                              "verbs": ["get", "patch"]}]


def test_configmap_holds_the_defaulted_spec_and_no_credentials() -> None:
    doc = load_example("qwen3-8b-grpo-megatron.yaml")
    job = job_from(doc)
    cm = builders.build_spec_configmap(job, OperatorSettings())
    spec = json.loads(cm["data"]["spec.json"])
    assert spec == job.spec.model_dump(mode="json", by_alias=True)
    assert spec["training"]["lrWarmupSteps"] == 0  # defaults are filled in
    assert spec["s3"]["credentialsSecretRef"]["name"] == "s3-credentials"
    assert json.loads(cm["data"]["job.json"]) == {"name": "qwen3-8b-grpo", "namespace": "team-a", "uid": UID}
    assert sorted(cm["data"]) == ["job.json", "spec.json"]  # names of Secrets only, never their values


def test_spec_hash_ignores_suspend_only() -> None:
    base = load_example("quickstart.yaml")
    h = builders.spec_hash(job_from(base))
    suspended = copy.deepcopy(base)
    suspended["spec"]["suspend"] = True
    assert builders.spec_hash(job_from(suspended)) == h
    faster = copy.deepcopy(base)
    faster["spec"]["training"]["lr"] = 1e-3
    assert builders.spec_hash(job_from(faster)) != h
    renamed = copy.deepcopy(base)
    renamed["metadata"]["uid"] = "other"
    assert builders.spec_hash(job_from(renamed)) == h


def test_metrics_children_only_when_enabled() -> None:
    doc = load_example("quickstart.yaml")
    doc["spec"]["metrics"] = {"enabled": False, "podMonitor": True}
    kinds = [c["kind"] for c in builders.build_children(job_from(doc), OperatorSettings(metrics_service=True))]
    assert "Service" not in kinds and "PodMonitor" not in kinds
    ptj = builders.build_pytorchjob(job_from(doc), OperatorSettings())
    assert [p["name"] for p in _container(ptj)["ports"]] == ["pytorchjob-port"]
    doc["spec"]["metrics"] = {"enabled": True, "podMonitor": True}
    children = builders.build_children(job_from(doc), OperatorSettings(metrics_service=True))
    monitor = next(c for c in children if c["kind"] == "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics"}]
    service = next(c for c in children if c["kind"] == "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == monitor["spec"]["selector"]["matchLabels"]


def test_rljob_render_prints_exactly_the_children(capsys: pytest.CaptureFixture[str]) -> None:
    from rljob_cli.main import main

    path = EXAMPLES / "qwen3-8b-grpo-megatron.yaml"
    assert main(["render", str(path)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    doc = yaml.safe_load(path.read_text())
    assert docs == builders.build_children(job_from(doc), OperatorSettings.from_env())
    ptj = next(d for d in docs if d["kind"] == "PyTorchJob")
    assert opschema.pytorchjob_schema_errors(ptj) == [] and opschema.pytorchjob_webhook_errors(ptj) == []


def test_vendored_crd_is_the_shared_one() -> None:
    assert opschema.file_sha256(opschema.VENDORED_PYTORCHJOB_CRD) == opschema.PYTORCHJOB_CRD_SHA256
    if opschema.SHARED_PYTORCHJOB_CRD.exists():
        assert opschema.file_sha256(opschema.SHARED_PYTORCHJOB_CRD) == opschema.PYTORCHJOB_CRD_SHA256


# ---------------------------------------------------------------------------- nothing the server would drop

ROUND_TRIP_SETTINGS = [OperatorSettings(), OperatorSettings(progress_rbac=False, metrics_service=True),
                       OperatorSettings(metrics_service=True)]


@pytest.mark.parametrize("kind", ["PyTorchJob", "JobSet"])
@pytest.mark.parametrize("settings", ROUND_TRIP_SETTINGS, ids=["default", "no-rbac+service", "rbac+service"])
@pytest.mark.parametrize("doc", [*sorted(p.name for p in EXAMPLES.glob("*.yaml")), "multinode"])
def test_every_child_round_trips_through_the_server_schemas(doc: str, settings: OperatorSettings, kind: str) -> None:
    """A real API server prunes unknown fields silently (201 plus a Warning header): a misspelt field in a
    child would vanish on a cluster. Every child must survive the vendored PyTorchJob and JobSet CRDs and
    the Kubernetes OpenAPI schemas (ConfigMap, Service, ServiceAccount, Role, RoleBinding) whole."""
    body = multinode_doc() if doc == "multinode" else load_example(doc)
    body["metadata"]["labels"] = {builders.LABEL_KUEUE_QUEUE: "team-a", builders.LABEL_KUEUE_PRIORITY: "high"}
    body["spec"]["childKind"] = kind
    children = builders.build_children(job_from(body), settings)
    checked = [c for c in children if c["kind"] != "PodMonitor"]  # the Prometheus Operator's CRD is not vendored
    assert {c["kind"] for c in checked} >= {"ConfigMap", kind}
    for child in checked:
        assert opschema.dropped_fields(child) == [], f"{child['kind']} would lose fields on a real server"


def test_the_round_trip_check_finds_a_misspelt_field() -> None:
    ptj = builders.build_pytorchjob(job_from(load_example("quickstart.yaml")), OperatorSettings())
    ptj["spec"]["runPolicy"]["suspended"] = True
    ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagePullpolicy"] = "Always"
    role = builders.build_progress_role(job_from(load_example("quickstart.yaml")), OperatorSettings())
    role["rules"][0]["resourceName"] = ["x"]
    assert opschema.dropped_fields(ptj) == [
        "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].imagePullpolicy", "spec.runPolicy.suspended"]
    assert opschema.dropped_fields(role) == ["rules[0].resourceName"]


def test_gpu_pods_get_a_compile_cache_that_outlives_container_restarts() -> None:
    """Every GPU pod (Master and Workers) mounts an emptyDir for torch.compile's caches and points inductor at
    it; a user env entry of the same name wins; CPU jobs get neither."""
    doc = multinode_doc()
    doc["spec"]["podTemplate"]["env"] = [{"name": "TORCHINDUCTOR_FX_GRAPH_CACHE", "value": "0"}]
    ptj = builders.build_pytorchjob(job_from(doc), OperatorSettings())
    assert set(ptj["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    for replica in ptj["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["compile-cache"] == {"name": "compile-cache", "emptyDir": {"sizeLimit": "10Gi"}}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(mounts["compile-cache"] + "/")
        assert env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
        assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"  # the user's entry, once
        assert [e["name"] for e in container["env"]].count("TORCHINDUCTOR_FX_GRAPH_CACHE") == 1
    cpu = builders.build_pytorchjob(job_from(load_example("quickstart.yaml")), OperatorSettings())
    pod = cpu["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "compile-cache" not in {v["name"] for v in pod["volumes"]}
    assert not any(e["name"].startswith("TORCHINDUCTOR") for e in pod["containers"][0]["env"])


# ---------------------------------------------------------------------------- the JobSet child


def _trainer(js: dict[str, Any]) -> dict[str, Any]:
    (role,) = js["spec"]["replicatedJobs"]
    return role


@pytest.mark.parametrize("nnodes", [1, 2, 16])
def test_jobset_is_one_indexed_trainer_job_of_nnodes_pods(nnodes: int) -> None:
    doc = jobset_doc()
    doc["spec"]["nnodes"] = nnodes
    job = job_from(doc)
    js = builders.build_child(job, OperatorSettings())
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    role = _trainer(js)
    assert role["name"] == "trainer" and role["replicas"] == 1
    spec = role["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed", nnodes, nnodes, 0)
    assert spec["activeDeadlineSeconds"] == 86400
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 5}  # spec.runPolicy.backoffLimit, the restart budget
    assert js["spec"]["ttlSecondsAfterFinished"] == 600
    assert opschema.jobset_schema_errors(js) == [] and opschema.dropped_fields(js) == []


def test_jobset_pods_get_the_torchrun_contract_from_their_completion_index() -> None:
    job = job_from(jobset_doc())
    js = builders.build_jobset(job, OperatorSettings(master_port=29500))
    (container,) = _trainer(js)["template"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    name = job.metadata.name
    assert env["PET_NNODES"]["value"] == "4" and env["PET_NPROC_PER_NODE"]["value"] == "8"
    # <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain = the JobSet's name>
    assert env["PET_MASTER_ADDR"]["value"] == f"{name}-trainer-0-0.{name}"
    assert env["PET_MASTER_PORT"]["value"] == "29500"
    assert env["PET_NODE_RANK"] == {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    assert {"name": "pytorchjob-port", "containerPort": 29500, "protocol": "TCP"} in container["ports"]


def test_jobset_pod_template_is_the_pytorchjobs() -> None:
    """One pod-template builder: the JobSet's pods differ from the PyTorchJob Master's only by the PET_*
    entries the training-operator would inject and the Job's restartPolicy."""
    doc = jobset_doc()
    job = job_from(doc)
    js_pod = copy.deepcopy(_trainer(builders.build_jobset(job, OperatorSettings()))["template"]["spec"]["template"])
    doc["spec"]["childKind"] = "PyTorchJob"
    ptj_pod = builders.build_pytorchjob(job_from(doc), OperatorSettings())["spec"]["pytorchReplicaSpecs"]["Master"][
        "template"]
    assert js_pod["spec"].pop("restartPolicy") == "Never"
    js_container, ptj_container = js_pod["spec"]["containers"][0], ptj_pod["spec"]["containers"][0]
    js_env = js_container.pop("env")
    assert [e for e in js_env if not e["name"].startswith("PET_")] == ptj_container.pop("env")
    assert js_pod == ptj_pod


def test_jobset_suspend_labels_and_ownership_follow_the_pytorchjob_rules() -> None:
    doc = jobset_doc()
    js = builders.build_child(job_from(doc), OperatorSettings())
    assert js["spec"]["suspend"] is True, "queue-managed: created suspended, for Kueue to admit"
    assert js["metadata"]["labels"][builders.LABEL_KUEUE_QUEUE] == "team-a"
    assert js["metadata"]["labels"][builders.LABEL_KUEUE_PRIORITY] == "high"
    assert js["metadata"]["ownerReferences"][0]["uid"] == UID
    assert js["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH] == builders.spec_hash(job_from(doc))
    doc["metadata"]["labels"] = {}
    assert builders.build_child(job_from(doc), OperatorSettings())["spec"]["suspend"] is False
    doc["spec"]["suspend"] = True
    assert builders.build_child(job_from(doc), OperatorSettings())["spec"]["suspend"] is True


def test_a_second_role_is_one_more_replicated_job() -> None:
    """The builder's roles are entries: a reward server added beside the trainer stays schema-valid and
    the success policy still waits for the trainer only."""
    job = job_from(jobset_doc())
    js = builders.build_jobset(job, OperatorSettings())
    server = builders.replicated_job(job, "reward-server", 1, copy.deepcopy(_trainer(js)["template"]["spec"]["template"]))
    js["spec"]["replicatedJobs"].append(server)
    assert opschema.jobset_schema_errors(js) == [] and opschema.dropped_fields(js) == []
    assert js["spec"]["successPolicy"]["targetReplicatedJobs"] == ["trainer"]


def test_the_child_kind_is_a_launch_time_field_and_the_default_keeps_old_hashes() -> None:
    doc = load_example("quickstart.yaml")
    default = builders.spec_hash(job_from(doc))
    doc["spec"]["childKind"] = "PyTorchJob"
    assert builders.spec_hash(job_from(doc)) == default
    doc["spec"]["childKind"] = "JobSet"
    assert builders.spec_hash(job_from(doc)) != default


def test_jobset_names_leave_room_for_pod_hostnames() -> None:
    from rljob_api.validation import name_errors

    doc = jobset_doc()
    doc["metadata"]["name"] = "a" * 50
    assert name_errors("a" * 50, job_from(doc).spec) == []  # 4 nodes: a-...-trainer-0-3 has 62 characters
    doc["spec"]["nnodes"] = 2000
    job = job_from(doc)
    (error,) = name_errors(job.metadata.name, job.spec)
    assert error.path == "metadata.name" and "at most 48 characters" in error.message
    doc["spec"]["childKind"] = "PyTorchJob"
    assert name_errors(job.metadata.name, job_from(doc).spec) == []


def test_rljob_render_prints_a_suspended_jobset_for_the_kueue_example(capsys: pytest.CaptureFixture[str]) -> None:
    from rljob_cli.main import main

    path = EXAMPLES / "qwen3-8b-grpo-jobset-kueue.yaml"
    assert main(["render", str(path)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    assert not [d for d in docs if d["kind"] == "PyTorchJob"]
    assert js["spec"]["suspend"] is True and js["metadata"]["labels"][builders.LABEL_KUEUE_QUEUE] == "team-a"
    env = {e["name"]: e for e in _trainer(js)["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert opschema.jobset_schema_errors(js) == []


def test_vendored_jobset_crd_is_what_its_script_writes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_jobset_crd", HERE / "vendor" / "build_jobset_crd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert opschema.VENDORED_JOBSET_CRD.read_text() == module.text(), (
        "run python tests/operator/vendor/build_jobset_crd.py and commit the result")
