"""From `kubectl apply` to a trained, checkpointed, observed RLJob, on this machine.

Real parts: kubectl 1.37, the rljob operator process, the worker (torchrun -> megatron-core on
CPU -> HF rollout), SeaweedFS S3 for checkpoints, Prometheus scraping the worker. Stand-ins:
the API server (kmock harness with schema/CEL admission, tests/operator/apiserver.py) and the
training-operator (tests/operator/training_operator.py, which runs the pod's own command with the
PET_* environment as local processes).
"""
from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from cluster import PYTORCHJOBS, RLJOBS, SECRETS, KubeClient, wait_until
from training_operator import TrainingOperatorStandIn

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.services, pytest.mark.slow]


def quickstart(name: str, bucket: str, s3_endpoint: str, *, steps: int, save_freq: int, **spec_changes) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["training"].update(totalTrainingSteps=steps, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(uri=f"s3://{bucket}/ckpt", saveFreq=save_freq, exportHf=False)
    spec["s3"] = {"endpoint": s3_endpoint, "credentialsSecretRef": {"name": "s3-credentials"}}
    spec.update(spec_changes)
    return doc


@pytest.fixture
def cluster(api_server, kube, operator, ns, s3_server, tmp_path, kubectl_bin, free_port):
    """Namespace with the S3 Secret, the training-operator stand-in running, and a kubectl helper."""
    kube.create(SECRETS, ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-credentials"},
                              "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(s3_server.access_key.encode()).decode(),
                                       "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_server.secret_key.encode()).decode()}})
    standin = TrainingOperatorStandIn(kube, ns, tmp_path / "pods", ports=free_port,
                                      extra_env={"RLJOB_PROGRESS_API_URL": api_server.url,
                                                 "RLJOB_PROGRESS_INTERVAL_S": "1"}).start()
    kubeconfig = operator.kubeconfig

    def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        # --validate=false: the stand-in API server serves no OpenAPI document for client-side
        # validation; it validates creates against the CRD schema and CEL rules itself.
        return subprocess.run([kubectl_bin, "--kubeconfig", str(kubeconfig), "-n", ns, *args], input=stdin,
                              check=False, capture_output=True, text=True, timeout=60)

    yield ns, standin, kubectl
    standin.stop()
    assert not standin.errors, standin.errors


def apply(kubectl, doc: dict) -> None:
    result = kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(doc))
    assert result.returncode == 0, result.stderr


def trainer_status(kube, ns, name) -> dict:
    return (kube.get(RLJOBS, ns, name).get("status") or {}).get("trainer") or {}


def committed_steps(s3_server, bucket: str, prefix: str) -> list[int]:
    s3 = s3_server.client()
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]
    return sorted(int(k.split("/")[-2].split("_")[1]) for k in keys if k.endswith("/COMMIT"))


def test_apply_train_checkpoint_observe_with_two_pods_and_a_killed_worker(
        cluster, kube, s3_server, s3_bucket, prometheus_server):
    ns, standin, kubectl = cluster
    doc = quickstart("e2e", s3_bucket, s3_server.endpoint_url, steps=16, save_freq=4, nnodes=2)
    doc["spec"]["training"].update(trainBatchSizePerNode=2, ppoMiniBatchSizePerNode=2)
    apply(kubectl, doc)
    pj = wait_until(lambda: kube.maybe_get(PYTORCHJOBS, ns, "e2e"), timeout=30, what="the PyTorchJob")
    assert pj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1

    ports = wait_until(lambda: standin.metrics_ports("e2e"), timeout=30, what="pods")
    prom = prometheus_server([f"127.0.0.1:{ports[0]}"])

    # Kill the master once after its first checkpoint: the PyTorchJob restarts it, and it resumes.
    wait_until(lambda: committed_steps(s3_server, s3_bucket, f"ckpt/{ns}/e2e/"), timeout=600,
               what="the first committed checkpoint", on_timeout=lambda: standin.pod_logs("e2e")[-4000:])
    standin.kill_pod("e2e", 0)
    wait_until(lambda: standin.jobs["e2e"].restarts == 1, timeout=30, what="a restart")

    def succeeded():
        cond = kube.condition(ns, "e2e", "Succeeded")
        return cond and cond["status"] == "True"

    wait_until(succeeded, timeout=900, what="Succeeded", on_timeout=lambda: standin.pod_logs("e2e")[-6000:])
    logs = standin.pod_logs("e2e")
    assert "resumed from step" in logs, logs[-3000:]

    trainer = wait_until(lambda: (t := trainer_status(kube, ns, "e2e")).get("step") == 16 and t, timeout=30,
                         what="final progress in status.trainer")
    assert trainer["totalSteps"] == 16 and trainer["progressPercentage"] == 100
    assert trainer["rewardMean"] > 0.5, trainer
    assert trainer["lastCheckpoint"]["step"] == 16
    assert trainer["lastCheckpoint"]["uri"] == f"s3://{s3_bucket}/ckpt/{ns}/e2e/step_000016"
    # maxToKeep 2: step 16 and the one before it: the periodic step 12, or a later step the surviving
    # pod's preemption save committed when the restart stopped it (SIGTERM -> save -> exit 143)
    kept = committed_steps(s3_server, s3_bucket, f"ckpt/{ns}/e2e/")
    assert len(kept) == 2 and kept[-1] == 16 and 12 <= kept[0] < 16, kept

    table = kubectl("get", "rlj", "e2e")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "STEP", "REWARD", "RUNNING", "SUCCEEDED"], header
    assert row.split()[1] == "16" and row.split()[4] == "True", row

    # Prometheus scraped the master (before and after its restart) while it trained.
    scraped = prom.value('max(max_over_time(rljob_step{rljob="e2e"}[10m]))')
    assert scraped is not None and scraped >= 4, scraped


def test_suspend_checkpoints_and_resume_continues(cluster, kube, s3_server, s3_bucket):
    ns, standin, kubectl = cluster
    apply(kubectl, quickstart("sus", s3_bucket, s3_server.endpoint_url, steps=400, save_freq=1000))
    wait_until(lambda: standin.metrics_ports("sus"), timeout=60, what="pods")
    wait_until(lambda: trainer_status(kube, ns, "sus").get("step", 0) >= 3, timeout=600, what="training progress",
               on_timeout=lambda: standin.pod_logs("sus")[-4000:])

    assert kubectl("patch", "rlj", "sus", "--type", "merge", "-p", '{"spec":{"suspend":true}}').returncode == 0

    def suspended():
        cond = kube.condition(ns, "sus", "Suspended")
        return cond and cond["status"] == "True"

    wait_until(suspended, timeout=300, what="Suspended", on_timeout=lambda: standin.pod_logs("sus")[-4000:])
    assert standin.jobs["sus"].pods == []
    saved = committed_steps(s3_server, s3_bucket, f"ckpt/{ns}/sus/")
    assert saved, "no checkpoint committed on SIGTERM:\n" + standin.pod_logs("sus")[-3000:]
    stopped_at = saved[-1]

    # Shorten the run while suspended (applied: the PyTorchJob is recreated), then resume.
    assert kubectl("patch", "rlj", "sus", "--type", "merge", "-p",
                   json.dumps({"spec": {"training": {"totalTrainingSteps": stopped_at + 3}}})).returncode == 0
    time.sleep(2)
    assert kubectl("patch", "rlj", "sus", "--type", "merge", "-p", '{"spec":{"suspend":false}}').returncode == 0

    def succeeded():
        cond = kube.condition(ns, "sus", "Succeeded")
        return cond and cond["status"] == "True"

    wait_until(succeeded, timeout=600, what="Succeeded after resume", on_timeout=lambda: standin.pod_logs("sus")[-5000:])
    assert f"resumed from step {stopped_at}" in standin.pod_logs("sus")
    assert wait_until(lambda: trainer_status(kube, ns, "sus").get("step") == stopped_at + 3, timeout=30,
                      what="final step in status")


def test_kueue_preemption_checkpoints_and_readmission_resumes(cluster, kube, s3_server, s3_bucket):
    """A second client plays Kueue: it creates the job's Workload, admission un-suspends the PyTorchJob,
    preemption suspends it. The
    preempted pods stop as on a user suspend (SIGTERM -> committed checkpoint), and re-admission
    resumes from that checkpoint; the operator never un-suspends the job itself."""
    ns, standin, kubectl = cluster
    doc = quickstart("queued", s3_bucket, s3_server.endpoint_url, steps=400, save_freq=1000)
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    apply(kubectl, doc)
    pj = wait_until(lambda: kube.maybe_get(PYTORCHJOBS, ns, "queued"), timeout=30, what="the PyTorchJob")
    assert pj["spec"]["runPolicy"]["suspend"] is True
    time.sleep(3)
    assert not standin.metrics_ports("queued"), "no pods before Kueue admits the job"
    kueue = KubeClient(kube.base_url)
    kueue.create_workload(ns, pj)  # as Kueue does for every job it manages (else: NoKueueWorkload)
    kueue.patch(PYTORCHJOBS, ns, "queued", {"spec": {"runPolicy": {"suspend": False}}})
    wait_until(lambda: standin.metrics_ports("queued"), timeout=60, what="pods after admission")
    wait_until(lambda: trainer_status(kube, ns, "queued").get("step", 0) >= 3, timeout=600, what="training progress",
               on_timeout=lambda: standin.pod_logs("queued")[-4000:])

    kueue.patch(PYTORCHJOBS, ns, "queued", {"spec": {"runPolicy": {"suspend": True}}})  # preemption
    wait_until(lambda: standin.jobs["queued"].pods == [], timeout=300, what="the preempted pods gone",
               on_timeout=lambda: standin.pod_logs("queued")[-4000:])
    saved = committed_steps(s3_server, s3_bucket, f"ckpt/{ns}/queued/")
    assert saved, "no checkpoint committed on preemption:\n" + standin.pod_logs("queued")[-3000:]
    stopped_at = saved[-1]
    wait_until(lambda: (kube.condition(ns, "queued", "Admitted") or {}).get("reason") == "Queued", timeout=30,
               what="Admitted=False Queued")
    time.sleep(3)
    assert kube.get(PYTORCHJOBS, ns, "queued")["spec"]["runPolicy"]["suspend"] is True, "left to Kueue"

    kueue.patch(PYTORCHJOBS, ns, "queued", {"spec": {"runPolicy": {"suspend": False}}})  # re-admission
    wait_until(lambda: f"resumed from step {stopped_at}" in standin.pod_logs("queued"), timeout=600,
               what="the resume from the preemption checkpoint", on_timeout=lambda: standin.pod_logs("queued")[-4000:])
    wait_until(lambda: trainer_status(kube, ns, "queued").get("step", 0) > stopped_at, timeout=600,
               what="training past the checkpoint")
    kube.delete(RLJOBS, ns, "queued")
    wait_until(lambda: not standin.jobs.get("queued") or standin.jobs["queued"].pods == [], timeout=120,
               what="the pods gone with the RLJob")


def test_invalid_rljob_is_rejected_and_creates_nothing(cluster, kube, s3_server, s3_bucket):
    ns, standin, kubectl = cluster
    doc = quickstart("bad", s3_bucket, s3_server.endpoint_url, steps=4, save_freq=2)
    doc["spec"]["megatron"]["tensorModelParallelSize"] = 3  # 1 GPU cannot hold TP 3: the CRD's CEL rule says so
    result = kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(doc))
    assert result.returncode != 0
    assert "TP x PP x CP" in result.stderr, result.stderr

    # A rule only the operator checks (batch divisibility) gets Accepted=False and no children.
    doc["spec"]["megatron"]["tensorModelParallelSize"] = 1
    doc["spec"]["training"]["microBatchSizePerGpu"] = 5
    apply(kubectl, doc)
    cond = wait_until(lambda: kube.condition(ns, "bad", "Accepted"), timeout=30, what="Accepted condition")
    assert cond["status"] == "False" and "microBatchSizePerGpu" in cond["message"], cond
    time.sleep(2)
    assert kube.maybe_get(PYTORCHJOBS, ns, "bad") is None
    assert standin.jobs.get("bad") is None
