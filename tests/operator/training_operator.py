"""A stand-in for the Kubeflow training-operator that runs PyTorchJob replicas as local processes.

It reads PyTorchJobs from the test API server and, for each replica (Master = node rank 0,
Worker i = node rank i + 1), runs the pod's own container command with the environment the
training-operator injects (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR,
PET_MASTER_PORT, MASTER_ADDR/PORT, RANK and WORLD_SIZE as pod counts) plus the container's own
env (values, fieldRefs, secretKeyRefs read from the API server) and its ConfigMap volumes written
to a local folder. It mirrors the lifecycle into PyTorchJob conditions (Created, Running,
Restarting, Succeeded, Failed, Suspended), restarts failed replicas under restartPolicy OnFailure
up to runPolicy.backoffLimit, and on runPolicy.suspend sends SIGTERM to the pods and waits for
them within terminationGracePeriodSeconds, as kubelet would. A killed pod loses every process in it,
torchrun's workers too, though they run in sessions of their own (pod_processes.py), and a pod's
processes left when its launcher exits are killed, as the container's PID namespace would be.

Local differences from a cluster, on purpose: `torchrun` runs as `python -m torch.distributed.run`
(same code), the master address is 127.0.0.1 with a free port per start (pods share one host),
and each pod gets its own metrics port and RLJOB_WORKDIR. A pod's metrics port is kept across its
restarts and comes from `ports` (the suite's `free_port`: below the kernel's ephemeral range). On a
cluster each pod has a network namespace of its own; here pods share the host's, and a port in the
ephemeral range can be taken between a pod's death and its restart by any outgoing connection on
the host, whose TIME_WAIT then refuses the restarted pod's bind for a minute
(test_pod_processes.py shows it).
"""
from __future__ import annotations

import base64
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pod_processes
from cluster import CONFIGMAPS, PYTORCHJOBS, SECRETS, ApiError, KubeClient


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Pod:
    name: str
    proc: subprocess.Popen
    metrics_port: int
    log: Path
    marker: str  # in the environment of every process of this pod (pod_processes.py)


@dataclass
class JobState:
    pods: list[Pod] = field(default_factory=list)
    restarts: int = 0
    finished: str | None = None  # "Succeeded" / "Failed"
    suspended: bool = False
    starts: int = 0
    conditions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (status, reason)


class TrainingOperatorStandIn:
    def __init__(self, kube: KubeClient, namespace: str, workdir: Path, ports: Callable[[], int],
                 extra_env: dict[str, str] | None = None):
        self.kube, self.namespace, self.workdir, self.ports = kube, namespace, workdir, ports
        self.extra_env = extra_env or {}
        self.jobs: dict[str, JobState] = {}
        self._metrics_ports: dict[str, int] = {}  # per pod name: a restarted pod keeps its port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="training-operator", daemon=True)
        self.errors: list[str] = []

    # -- lifecycle of the stand-in
    def start(self) -> TrainingOperatorStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for state in self.jobs.values():
            self._terminate(state.pods, grace=5)

    def kill_pod(self, job: str, index: int = 0) -> None:
        """SIGKILL one replica, like a node failure or an OOM kill."""
        pod_processes.kill_all(self.jobs[job].pods[index].marker)

    def pod_logs(self, job: str) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob(f"{job}-*/*.log")))

    def metrics_ports(self, job: str) -> list[int]:
        return [p.metrics_port for p in self.jobs.get(job, JobState()).pods]

    # -- the control loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001 - recorded for the test to report, loop goes on
                self.errors.append(repr(exc))
            self._stop.wait(0.3)

    def _sync(self) -> None:
        live = {pj["metadata"]["name"]: pj for pj in self.kube.items(PYTORCHJOBS, self.namespace)}
        for name in list(self.jobs):
            if name not in live:  # deleted: its pods go too
                self._terminate(self.jobs.pop(name).pods, grace=5)
        for name, pj in live.items():
            self._sync_job(name, pj)

    def _sync_job(self, name: str, pj: dict[str, Any]) -> None:
        state = self.jobs.setdefault(name, JobState())
        if state.finished:
            return
        run_policy = pj["spec"].get("runPolicy", {})
        grace = self._template(pj, "Master")["spec"].get("terminationGracePeriodSeconds", 30)
        if run_policy.get("suspend"):
            if state.pods:
                self._terminate(state.pods, grace=grace)
                state.pods = []
            if not state.suspended:
                state.suspended = True
                self._conditions(name, ("Suspended", "True", "JobSuspended"), ("Running", "False", "JobSuspended"))
            return
        if state.suspended:
            state.suspended = False
            self._conditions(name, ("Suspended", "False", "JobResumed"))
        if not state.pods:
            self._start_pods(name, pj, state)
            return
        codes = [p.proc.poll() for p in state.pods]
        if all(c == 0 for c in codes):
            state.finished = "Succeeded"
            self._conditions(name, ("Running", "False", "JobSucceeded"), ("Succeeded", "True", "JobSucceeded"),
                             completionTime=_now())
        elif any(c not in (None, 0) for c in codes):
            state.restarts += 1
            self._terminate(state.pods, grace=5)
            state.pods = []
            if state.restarts > run_policy.get("backoffLimit", 6):
                state.finished = "Failed"
                self._conditions(name, ("Running", "False", "BackoffLimitExceeded"),
                                 ("Failed", "True", "BackoffLimitExceeded"), completionTime=_now())
            else:
                self._conditions(name, ("Restarting", "True", "JobRestarting"), ("Running", "False", "JobRestarting"))

    # -- pods
    def _template(self, pj: dict[str, Any], replica: str) -> dict[str, Any]:
        return pj["spec"]["pytorchReplicaSpecs"][replica]["template"]

    def _start_pods(self, name: str, pj: dict[str, Any], state: JobState) -> None:
        specs = pj["spec"]["pytorchReplicaSpecs"]
        replicas = [("master", 0, specs["Master"])]
        for i in range(specs.get("Worker", {}).get("replicas", 0)):
            replicas.append(("worker", i, specs["Worker"]))
        nnodes = len(replicas)
        master_port = self.ports()
        state.starts += 1
        for node_rank, (kind, index, replica) in enumerate(replicas):
            pod_name = f"{name}-{kind}-{index}"
            state.pods.append(self._start_pod(pj, replica["template"], pod_name, node_rank, nnodes, master_port,
                                              state.starts))
        if state.starts == 1:
            self._conditions(name, ("Created", "True", "JobCreated"), ("Running", "True", "JobRunning"),
                             startTime=_now())
        else:
            self._conditions(name, ("Restarting", "False", "JobRunning"), ("Running", "True", "JobRunning"))

    def _start_pod(self, pj, template, pod_name, node_rank, nnodes, master_port, start) -> Pod:
        spec = template["spec"]
        container = next(c for c in spec["containers"] if c["name"] == "pytorch")
        root = self.workdir / f"{pj['metadata']['name']}-{node_rank}"
        mounts = self._materialize_config_maps(spec, container, root / "mounts")
        command = [arg for arg in container["command"] + container.get("args", [])]
        if command[0] == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
        elif command[0] == "python":  # the image's interpreter is this one here
            command = [sys.executable, *command[1:]]
        for mount_path, local in mounts.items():
            command = [arg.replace(mount_path, str(local), 1) if arg.startswith(mount_path) else arg for arg in command]
        if pod_name not in self._metrics_ports:
            self._metrics_ports[pod_name] = self.ports()
        metrics_port = self._metrics_ports[pod_name]
        env = {
            **os.environ,
            **self._container_env(container, pod_name),
            "PET_NNODES": str(nnodes),
            "PET_NPROC_PER_NODE": str(pj["spec"].get("nprocPerNode", "1")),
            "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(master_port),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "RANK": str(node_rank),
            "WORLD_SIZE": str(nnodes),
            "RLJOB_WORKDIR": str(root / "work"),
            "RLJOB_METRICS_PORT": str(metrics_port),
            "OMP_NUM_THREADS": "1",
            **self.extra_env,
        }
        marker = env[pod_processes.MARKER] = pod_processes.new_marker(pod_name)
        root.mkdir(parents=True, exist_ok=True)
        log = root / f"start-{start}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return Pod(pod_name, proc, metrics_port, log, marker)

    def _materialize_config_maps(self, spec, container, root: Path) -> dict[str, Path]:
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        out = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if "configMap" not in volume:
                continue
            cm = self.kube.get(CONFIGMAPS, self.namespace, volume["configMap"]["name"])
            local = root / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for key, value in cm.get("data", {}).items():
                (local / key).write_text(value)
            out[mount["mountPath"].rstrip("/")] = local
        return out

    def _container_env(self, container, pod_name: str) -> dict[str, str]:
        env = {}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = str(var["value"])
                continue
            source = var.get("valueFrom", {})
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                env[var["name"]] = {"metadata.namespace": self.namespace, "metadata.name": pod_name}[path]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.kube.get(SECRETS, self.namespace, ref["name"])
                env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        return env

    def _terminate(self, pods: list[Pod], grace: float) -> None:
        """SIGTERM to each pod's entrypoint (it forwards it to its workers), SIGKILL to all left after grace."""
        for pod in pods:
            if pod.proc.poll() is None:
                os.killpg(pod.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for pod in pods:
            try:
                pod.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            pod_processes.kill_all(pod.marker)
            pod.proc.wait()

    # -- status
    def _conditions(self, name: str, *conds: tuple[str, str, str], **status: Any) -> None:
        """Update conditions by type (the training-operator keeps every type it ever set)."""
        known = self.jobs[name].conditions
        for type_, value, reason in conds:
            known[type_] = (value, reason)
        everything = [(t, v, r) for t, (v, r) in known.items()]
        for _ in range(5):
            try:
                self.kube.set_pytorchjob_conditions(self.namespace, name, *everything, **status)
                return
            except ApiError as exc:
                if exc.status != 409:
                    raise
