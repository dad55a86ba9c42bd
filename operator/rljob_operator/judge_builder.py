"""The judge the operator runs for ``spec.reward.server``: a vLLM OpenAI-compatible server as a Deployment
plus a ClusterIP Service ``<job>-judge`` on port 8000, both owned by the RLJob (deleted with it by the
garbage collector). The worker reaches it at ``rljob_api.models.judge_url`` when
``spec.reward.remote.url`` is unset, and waits at start-up until it answers. Pure builders, like
:mod:`rljob_operator.builders`.
"""
from __future__ import annotations

from typing import Any

from rljob_api.models import JUDGE_PORT, RLJob, judge_service_name

from rljob_operator import builders
from rljob_operator.settings import OperatorSettings

COMPONENT = "judge"


def _selector(job: RLJob) -> dict[str, str]:
    return {**builders.selector_labels(job.metadata.name), builders.LABEL_COMPONENT: COMPONENT}


def build_judge_deployment(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    """One replica of `vllm serve MODEL`, serving the name spec.reward.remote.judge.model asks for."""
    server, remote = job.spec.reward.server, job.spec.reward.remote
    served = remote.judge.model if remote is not None and remote.judge is not None else server.model
    args = [server.model, "--served-model-name", served, "--host", "0.0.0.0", "--port", str(JUDGE_PORT)]
    if server.gpus > 1 and "--tensor-parallel-size" not in server.vllm_args:
        args += ["--tensor-parallel-size", str(server.gpus)]
    container: dict[str, Any] = {
        "name": "vllm",
        "image": server.image,
        "command": ["vllm", "serve"],
        "args": args + list(server.vllm_args),
        "ports": [{"name": "http", "containerPort": JUDGE_PORT}],
        # /health answers once the model is loaded: the Service sends requests to ready pods only
        "readinessProbe": {"httpGet": {"path": "/health", "port": JUDGE_PORT}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if server.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(server.gpus)}}
    pt = job.spec.pod_template
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": pt.shm_size}}],
    }
    if pt.node_selector:
        pod_spec["nodeSelector"] = dict(pt.node_selector)
    if pt.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in pt.tolerations]
    if pt.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in pt.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": builders._metadata(job, judge_service_name(job.metadata.name), COMPONENT),
        "spec": {
            "replicas": 0 if job.spec.suspend else 1,
            "selector": {"matchLabels": _selector(job)},
            "template": {"metadata": {"labels": builders.labels(job, COMPONENT)}, "spec": pod_spec},
        },
    }


def build_judge_service(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": builders._metadata(job, judge_service_name(job.metadata.name), COMPONENT),
        "spec": {"selector": _selector(job),
                 "ports": [{"name": "http", "port": JUDGE_PORT, "targetPort": JUDGE_PORT, "protocol": "TCP"}]},
    }


def build_judge_children(job: RLJob, settings: OperatorSettings) -> list[dict[str, Any]]:
    """The judge's Deployment and Service, or nothing without spec.reward.server."""
    if job.spec.reward.server is None:
        return []
    return [build_judge_deployment(job, settings), build_judge_service(job, settings)]
