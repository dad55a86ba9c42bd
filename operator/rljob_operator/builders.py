"""Pure child builders: a validated RLJob and the operator settings in, plain dicts out.

No API calls, no kopf, no YAML templating. The handler creates what these return; `rljob render`
prints it. Every child carries the standard labels, the namespace of the RLJob and, when the
RLJob has a uid (it does once stored), an ownerReference with ``controller: true`` so deleting
the RLJob garbage-collects it.

The PyTorchJob contract (Kubeflow training-operator v1) lives in `build_pytorchjob` only, so a
move to Trainer v2 (TrainJob) touches one function. The JobSet contract (jobset.x-k8s.io/v1alpha2)
lives in `build_jobset`: its roles are `replicated_job` entries (today one, `trainer`; a rollout
pool or a reward server is one more entry), and both kinds share `_pod_template`.
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from rljob_api.enums import ChildKind
from rljob_api.models import API_VERSION, GPU_RESOURCE, GROUP, KIND, PLURAL, RLJob
from rljob_api.pod_layout import (
    COMPILE_CACHE_MOUNT,
    COMPILE_CACHE_VOLUME,
    SHM_MOUNT_PATH,
    SHM_VOLUME,
    SPEC_VOLUME,
)
from rljob_api.validation import processes_per_node

from rljob_operator.settings import OperatorSettings

# ---------------------------------------------------------------------------- names and labels

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_JOB = "rljob.dev/job-name"
MANAGER = "rljob-operator"
ANNOTATION_SPEC_HASH = "rljob.dev/spec-hash"
# Kueue (https://kueue.sigs.k8s.io): a job with a queue-name label is created suspended and Kueue
# un-suspends it on admission (and suspends it again to preempt it).
LABEL_KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
LABEL_KUEUE_PRIORITY = "kueue.x-k8s.io/priority-class"
KUEUE_LABELS = (LABEL_KUEUE_QUEUE, LABEL_KUEUE_PRIORITY)

PYTORCHJOB_API_VERSION = "kubeflow.org/v1"
PYTORCHJOB_KIND = "PyTorchJob"
PYTORCH_CONTAINER = "pytorch"  # the training-operator finds the container by this name
PYTORCH_PORT_NAME = "pytorchjob-port"  # ... and the rendezvous port by this one
METRICS_PORT_NAME = "metrics"
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_KIND = "JobSet"
TRAINER_ROLE = "trainer"  # the JobSet's replicatedJob of training pods
# The Job controller annotates each pod of an Indexed Job with its index (0..completions-1).
JOB_COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CHILD_API_VERSIONS = {ChildKind.PYTORCHJOB: PYTORCHJOB_API_VERSION, ChildKind.JOBSET: JOBSET_API_VERSION}
# Size of the compile-cache emptyDir (the names and paths of the pod's own volumes: rljob_api.pod_layout).
COMPILE_CACHE_SIZE = "10Gi"
COMPILE_CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": f"{COMPILE_CACHE_MOUNT}/inductor",
                     "TRITON_CACHE_DIR": f"{COMPILE_CACHE_MOUNT}/triton", "VLLM_CACHE_ROOT": f"{COMPILE_CACHE_MOUNT}/vllm",
                     "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}

COMPONENT_TRAINER = "trainer"
COMPONENT_SPEC = "spec"
COMPONENT_PROGRESS = "progress-reporter"
COMPONENT_METRICS = "metrics"


def spec_configmap_name(job_name: str) -> str:
    return f"{job_name}-spec"


def pytorchjob_name(job_name: str) -> str:
    return job_name


def child_name(job_name: str) -> str:
    """The name of the RLJob's workload child, whichever its kind (PyTorchJob or JobSet)."""
    return job_name


def jobset_pod_hostname(job_name: str, role: str, job_index: int = 0, pod_index: int = 0) -> str:
    """A JobSet pod's stable hostname with network.enableDNSHostnames: <jobset>-<role>-<job>-<pod>."""
    return f"{child_name(job_name)}-{role}-{job_index}-{pod_index}"


def jobset_master_addr(job_name: str) -> str:
    """The DNS name of the trainer's index-0 pod: <hostname>.<subdomain>, where the subdomain (the
    headless Service the JobSet controller creates) defaults to the JobSet's name."""
    return f"{jobset_pod_hostname(job_name, TRAINER_ROLE)}.{child_name(job_name)}"


def service_account_name(job_name: str) -> str:
    return f"{job_name}-worker"


def progress_role_name(job_name: str) -> str:
    return f"{job_name}-progress"


def metrics_service_name(job_name: str) -> str:
    return f"{job_name}-metrics"


def selector_labels(job_name: str) -> dict[str, str]:
    """Labels that identify an RLJob's children (and select its training pods with the component)."""
    return {LABEL_MANAGED_BY: MANAGER, LABEL_JOB: job_name}


def labels(job: RLJob, component: str) -> dict[str, str]:
    name = job.metadata.name
    return {
        LABEL_NAME: "rljob",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: "rljob",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_JOB: name,
    }


def queue_labels(job: RLJob) -> dict[str, str]:
    """The RLJob's Kueue labels, which its PyTorchJob carries (Kueue reads them from the job it manages)."""
    return {k: v for k in KUEUE_LABELS if (v := job.metadata.labels.get(k))}


def queue_name(obj: dict[str, Any] | Any) -> str | None:
    """The Kueue LocalQueue of a stored object (None when Kueue does not manage it)."""
    return ((obj or {}).get("metadata", {}).get("labels") or {}).get(LABEL_KUEUE_QUEUE) or None


def owner_reference(job: RLJob) -> dict[str, Any] | None:
    if not job.metadata.uid:
        return None
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: RLJob, name: str, component: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": job.metadata.namespace, "labels": labels(job, component)}
    if annotations:
        meta["annotations"] = annotations
    owner = owner_reference(job)
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


# ---------------------------------------------------------------------------- the spec ConfigMap

def spec_document(job: RLJob) -> dict[str, Any]:
    """The validated, defaulted spec as the worker reads it (`spec.json`); it holds no credentials,
    only the name of the Secret that does."""
    return job.spec.model_dump(mode="json", by_alias=True)


def spec_hash(job: RLJob) -> str:
    """Fingerprint of everything the running pods depend on: the whole spec except `suspend`.

    Stored on the ConfigMap and PyTorchJob; a different hash on a live PyTorchJob means a
    launch-time field changed (see reconcile's immutability policy).
    """
    doc = spec_document(job)
    doc.pop("suspend", None)
    # The default child kind leaves the hash as it was before spec.childKind existed, so upgrading the
    # operator does not read every running PyTorchJob as launched from a different spec.
    if doc.get("childKind") == ChildKind.PYTORCHJOB.value:
        doc.pop("childKind")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def build_spec_configmap(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    job_doc = {"name": job.metadata.name, "namespace": job.metadata.namespace, "uid": job.metadata.uid}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, spec_configmap_name(job.metadata.name), COMPONENT_SPEC,
                              {ANNOTATION_SPEC_HASH: spec_hash(job)}),
        "data": {
            "spec.json": json.dumps(spec_document(job), indent=2, sort_keys=True) + "\n",
            "job.json": json.dumps(job_doc, indent=2, sort_keys=True) + "\n",
        },
    }


# ---------------------------------------------------------------------------- the PyTorchJob

def _env(job: RLJob, extra: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    spec = job.spec
    env: list[dict[str, Any]] = [*(extra or []),
        {"name": "RLJOB_NAME", "value": job.metadata.name},
        {"name": "RLJOB_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "AWS_REGION", "value": spec.s3.region},
    ]
    if spec.s3.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": spec.s3.endpoint})
    if spec.device == "gpu":
        env.extend({"name": k, "value": v} for k, v in COMPILE_CACHE_ENV.items())
    ref = spec.s3.credentials_secret_ref
    if ref is not None:
        env.append({"name": "AWS_ACCESS_KEY_ID",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.access_key_id_key}}})
        env.append({"name": "AWS_SECRET_ACCESS_KEY",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.secret_access_key_key}}})
    # Tracker credentials: env references to the Secret, never the values.
    mlflow, wandb = spec.tracking.mlflow, spec.tracking.wandb
    for var, secret in (("MLFLOW_TRACKING_TOKEN", mlflow.token_secret_ref if mlflow else None),
                        ("WANDB_API_KEY", wandb.api_key_secret_ref if wandb else None)):
        if secret is not None:
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    env.extend(reward_header_env(spec))
    # User entries win over ours with the same name; new names are appended in their order.
    user = [copy.deepcopy(e) for e in spec.pod_template.env]
    user_names = {e.get("name") for e in user}
    return [e for e in env if e["name"] not in user_names] + user


def reward_header_env(spec) -> list[dict[str, Any]]:
    """The Secret keys of spec.reward's remote headers (and its bySource routes') as env references; the
    worker reads them by the same names (HeadersSecretRef.env_names). Values are never copied."""
    remotes = [spec.reward.remote] + [route.remote for route in spec.reward.by_source.values()]
    out: dict[str, dict[str, Any]] = {}
    for remote in remotes:
        ref = remote.headers_secret_ref if remote is not None else None
        if ref is None:
            continue
        for header, env in ref.env_names().items():
            out[env] = {"name": env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.headers[header]}}}
    return list(out.values())


def _resources(job: RLJob) -> dict[str, Any]:
    spec = job.spec
    resources = {k: dict(v) for k, v in copy.deepcopy(spec.pod_template.resources).items()}
    if spec.device == "gpu":
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(spec.gpus_per_node)
        if GPU_RESOURCE in resources.get("requests", {}):
            resources["requests"][GPU_RESOURCE] = str(spec.gpus_per_node)
    else:
        for section in resources.values():
            section.pop(GPU_RESOURCE, None)
    return {k: v for k, v in resources.items() if v}


def _pod_template(job: RLJob, settings: OperatorSettings,
                  extra_env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The training pods of either child kind; `extra_env` goes before ours (a user entry still wins)."""
    spec, pt = job.spec, job.spec.pod_template
    name = job.metadata.name
    on_gpu = spec.device == "gpu"
    ports = [{"name": PYTORCH_PORT_NAME, "containerPort": settings.master_port, "protocol": "TCP"}]
    if spec.metrics.enabled:
        ports.append({"name": METRICS_PORT_NAME, "containerPort": spec.metrics.port, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": PYTORCH_CONTAINER,
        "image": spec.image or settings.worker_image,
        "imagePullPolicy": spec.image_pull_policy,
        # torchrun (through rljob_worker.runtime.launch, which keeps the worker's exit code: 2 for a
        # configuration error, 143 after a preemption save) reads PET_NNODES, PET_NPROC_PER_NODE,
        # PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, which the training-operator injects
        # (a PyTorchJob) or the JobSet's pod template carries (`_jobset_env`).
        "command": ["python", "-m", "rljob_worker.runtime.launch", "-m", settings.worker_module, "--spec", settings.spec_path],
        "env": _env(job, extra_env),
        "ports": ports,
        "volumeMounts": [
            {"name": SPEC_VOLUME, "mountPath": settings.spec_mount_path, "readOnly": True},
            {"name": SHM_VOLUME, "mountPath": SHM_MOUNT_PATH},
            *([{"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_MOUNT}] if on_gpu else []),
            *copy.deepcopy(pt.volume_mounts),
        ],
    }
    resources = _resources(job)
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": SPEC_VOLUME, "configMap": {"name": spec_configmap_name(name)}},
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": pt.shm_size}},
            *([{"name": COMPILE_CACHE_VOLUME, "emptyDir": {"sizeLimit": COMPILE_CACHE_SIZE}}] if on_gpu else []),
            *copy.deepcopy(pt.volumes),
        ],
        "terminationGracePeriodSeconds": pt.termination_grace_period_seconds,
    }
    sa = pt.service_account_name or (service_account_name(name) if settings.progress_rbac else None)
    if sa:
        pod_spec["serviceAccountName"] = sa
    if pt.node_selector:
        pod_spec["nodeSelector"] = dict(pt.node_selector)
    if pt.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(pt.tolerations)
    if pt.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in pt.image_pull_secrets]
    if pt.priority_class_name:
        pod_spec["priorityClassName"] = pt.priority_class_name
    if pt.scheduler_name:
        pod_spec["schedulerName"] = pt.scheduler_name
    pod_labels = {**pt.labels, **labels(job, COMPONENT_TRAINER)}
    pod_annotations = {**pt.annotations, "kubectl.kubernetes.io/default-container": PYTORCH_CONTAINER}
    return {"metadata": {"labels": pod_labels, "annotations": pod_annotations}, "spec": pod_spec}


def build_pytorchjob(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    """One Master, nnodes-1 Workers (omitted when 0: the training-operator's webhook rejects 0)."""
    spec = job.spec
    template = _pod_template(job, settings)
    replicas: dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template},
    }
    if spec.nnodes > 1:
        replicas["Worker"] = {"replicas": spec.nnodes - 1, "restartPolicy": "OnFailure",
                              "template": copy.deepcopy(template)}
    queued = queue_labels(job)
    # A queue-managed job starts suspended: Kueue un-suspends it when the queue admits it.
    run_policy: dict[str, Any] = {"backoffLimit": spec.run_policy.backoff_limit,
                                  "suspend": spec.suspend or LABEL_KUEUE_QUEUE in queued}
    if spec.run_policy.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = spec.run_policy.active_deadline_seconds
    if spec.run_policy.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = spec.run_policy.ttl_seconds_after_finished
    meta = _metadata(job, pytorchjob_name(job.metadata.name), COMPONENT_TRAINER, {ANNOTATION_SPEC_HASH: spec_hash(job)})
    meta["labels"].update(queued)
    return {
        "apiVersion": PYTORCHJOB_API_VERSION,
        "kind": PYTORCHJOB_KIND,
        "metadata": meta,
        "spec": {
            "nprocPerNode": str(processes_per_node(spec)),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": replicas,
        },
    }


def build_child(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    """The workload child of `job.spec.childKind`."""
    if job.spec.child_kind == ChildKind.JOBSET:
        return build_jobset(job, settings)
    return build_pytorchjob(job, settings)


# ---------------------------------------------------------------------------- the JobSet


def _jobset_env(job: RLJob, settings: OperatorSettings) -> list[dict[str, Any]]:
    """The torchrun contract the training-operator would inject, written into the pod template: every
    pod rendezvous at the trainer's index-0 pod; its node rank is its Indexed-Job completion index."""
    spec = job.spec
    return [
        {"name": "PET_NNODES", "value": str(spec.nnodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(processes_per_node(spec))},
        {"name": "PET_MASTER_ADDR", "value": jobset_master_addr(job.metadata.name)},
        {"name": "PET_MASTER_PORT", "value": str(settings.master_port)},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{JOB_COMPLETION_INDEX_ANNOTATION}']"}}},
    ]


def replicated_job(job: RLJob, role: str, pods: int, template: dict[str, Any], *,
                   active_deadline_seconds: int | None = None) -> dict[str, Any]:
    """One JobSet role: a single Indexed Job of `pods` pods that all run at once (completions =
    parallelism), none retried on its own (backoffLimit 0: a failed pod fails the Job, and the
    JobSet's failurePolicy restarts the whole gang, which is what a torchrun world needs)."""
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": pods,
        "parallelism": pods,
        "backoffLimit": 0,
        "template": template,
    }
    if active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = active_deadline_seconds
    return {"name": role, "replicas": 1,
            "template": {"metadata": {"labels": labels(job, role)}, "spec": job_spec}}


def build_jobset(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    """A JobSet with one `trainer` role of nnodes pods; suspend, Kueue labels, ownership and the spec
    hash exactly as on the PyTorchJob."""
    spec = job.spec
    template = _pod_template(job, settings, _jobset_env(job, settings))
    template["spec"]["restartPolicy"] = "Never"  # a Job's pods restart through the JobSet's failurePolicy
    roles = [replicated_job(job, TRAINER_ROLE, spec.nnodes, template,
                            active_deadline_seconds=spec.run_policy.active_deadline_seconds)]
    queued = queue_labels(job)
    jobset_spec: dict[str, Any] = {
        "replicatedJobs": roles,
        # Stable pod hostnames <jobset>-<role>-<job>-<pod>.<jobset> (PET_MASTER_ADDR), published before
        # the pods are ready so rendezvous can start.
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        # The job succeeds when the trainer succeeds (other roles, e.g. a reward server, never finish).
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [TRAINER_ROLE]},
        "failurePolicy": {"maxRestarts": spec.run_policy.backoff_limit},
        # A queue-managed job starts suspended: Kueue un-suspends it when the queue admits it.
        "suspend": spec.suspend or LABEL_KUEUE_QUEUE in queued,
    }
    if spec.run_policy.ttl_seconds_after_finished is not None:
        jobset_spec["ttlSecondsAfterFinished"] = spec.run_policy.ttl_seconds_after_finished
    meta = _metadata(job, child_name(job.metadata.name), COMPONENT_TRAINER, {ANNOTATION_SPEC_HASH: spec_hash(job)})
    meta["labels"].update(queued)
    return {"apiVersion": JOBSET_API_VERSION, "kind": JOBSET_KIND, "metadata": meta, "spec": jobset_spec}


# ---------------------------------------------------------------------------- progress RBAC

def build_service_account(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _metadata(job, service_account_name(job.metadata.name), COMPONENT_PROGRESS)}


def build_progress_role(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    """Rank 0 may read and patch its own RLJob (the progress annotation) and nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(job, progress_role_name(job.metadata.name), COMPONENT_PROGRESS),
        "rules": [{"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [job.metadata.name],
                   "verbs": ["get", "patch"]}],
    }


def build_progress_rolebinding(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    name = job.metadata.name
    account = job.spec.pod_template.service_account_name or service_account_name(name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(job, progress_role_name(name), COMPONENT_PROGRESS),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": progress_role_name(name)},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": job.metadata.namespace}],
    }


# ---------------------------------------------------------------------------- metrics

def _trainer_selector(job: RLJob) -> dict[str, str]:
    return {**selector_labels(job.metadata.name), LABEL_COMPONENT: COMPONENT_TRAINER}


def build_metrics_service(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    """Headless Service over the training pods' metrics port (for Service-based scraping)."""
    port = job.spec.metrics.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, metrics_service_name(job.metadata.name), COMPONENT_METRICS),
        "spec": {
            "clusterIP": "None",
            "selector": _trainer_selector(job),
            "ports": [{"name": METRICS_PORT_NAME, "port": port, "targetPort": METRICS_PORT_NAME, "protocol": "TCP"}],
        },
    }


def build_pod_monitor(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(job, job.metadata.name, COMPONENT_METRICS),
        "spec": {
            "selector": {"matchLabels": _trainer_selector(job)},
            "podMetricsEndpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics"}],
        },
    }


# ---------------------------------------------------------------------------- all children

def build_children(job: RLJob, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Every child of `job`, in creation order (RBAC and the spec before the PyTorchJob or JobSet that uses them)."""
    children: list[dict[str, Any]] = []
    if settings.progress_rbac:
        if not job.spec.pod_template.service_account_name:
            children.append(build_service_account(job, settings))
        children.append(build_progress_role(job, settings))
        children.append(build_progress_rolebinding(job, settings))
    children.append(build_spec_configmap(job, settings))
    from rljob_operator.judge_builder import build_judge_children  # (imports this module)

    children.extend(build_judge_children(job, settings))  # spec.reward.server: before the job that waits for it
    children.append(build_child(job, settings))
    if job.spec.metrics.enabled and settings.metrics_service:
        children.append(build_metrics_service(job, settings))
    if job.spec.metrics.enabled and job.spec.metrics.pod_monitor:
        children.append(build_pod_monitor(job, settings))
    return children
