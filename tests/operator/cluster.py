"""Test-side helpers: a small synchronous Kubernetes HTTP client, the operator as a subprocess, waiting.

`KubeClient` speaks plain HTTP to the test API server, like kubectl would (it is how tests "apply"
RLJobs and play the training-operator). `OperatorProcess` runs `python -m rljob_operator` with
KUBECONFIG pointing at the server, logging to a file.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

RLJOBS = ("rljob.dev", "v1alpha1", "rljobs")
PYTORCHJOBS = ("kubeflow.org", "v1", "pytorchjobs")
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")
CONFIGMAPS = ("", "v1", "configmaps")
SECRETS = ("", "v1", "secrets")
EVENTS = ("", "v1", "events")
NAMESPACES = ("", "v1", "namespaces")
SERVICEACCOUNTS = ("", "v1", "serviceaccounts")
SERVICES = ("", "v1", "services")
DEPLOYMENTS = ("apps", "v1", "deployments")
ROLES = ("rbac.authorization.k8s.io", "v1", "roles")
ROLEBINDINGS = ("rbac.authorization.k8s.io", "v1", "rolebindings")
CRDS = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
CLUSTER_SCOPED = {NAMESPACES, CRDS}
RESYNC_SECONDS = 10  # the e2e operator's resync period: longer than every event-driven wait in the tests
KUEUE_GRACE_SECONDS = 3  # the e2e operator's wait for a Kueue Workload before NoKueueWorkload

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def path_of(resource: tuple[str, str, str], namespace: str | None = None, name: str | None = None,
            subresource: str | None = None) -> str:
    group, version, plural = resource
    base = f"/api/{version}" if group == "" else f"/apis/{group}/{version}"
    if namespace is not None and resource not in CLUSTER_SCOPED:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


class KubeClient:
    def __init__(self, base_url: str, timeout: float = 10.0, token: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                params: dict[str, str] | None = None, headers: dict[str, str] | None = None) -> Any:
        url = self.base_url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={
            "Content-Type": content_type, "Accept": "application/json", **self.auth, **(headers or {})})
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw.decode(errors="replace")
            raise ApiError(exc.code, payload) from None

    # -- typed shortcuts
    def get(self, resource, namespace, name, subresource=None) -> dict[str, Any]:
        return self.request("GET", path_of(resource, namespace, name, subresource))

    def maybe_get(self, resource, namespace, name) -> dict[str, Any] | None:
        try:
            return self.get(resource, namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, resource, namespace=None, **params: str) -> dict[str, Any]:
        return self.request("GET", path_of(resource, namespace), params=params or None)

    def items(self, resource, namespace=None, **params: str) -> list[dict[str, Any]]:
        return self.list(resource, namespace, **params)["items"]

    def create(self, resource, namespace, body, **params: str) -> dict[str, Any]:
        return self.request("POST", path_of(resource, namespace), body, params=params or None)

    def patch(self, resource, namespace, name, body, *, subresource=None,
              content_type="application/merge-patch+json", **params: str) -> dict[str, Any]:
        return self.request("PATCH", path_of(resource, namespace, name, subresource), body, content_type=content_type,
                            params=params or None)

    def delete(self, resource, namespace, name, body=None) -> dict[str, Any]:
        return self.request("DELETE", path_of(resource, namespace, name), body)

    def create_namespace(self, name: str) -> None:
        try:
            self.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        except ApiError as exc:
            if exc.status != 409:
                raise

    def apply_crd(self, crd: dict[str, Any], timeout: float = 30.0) -> None:
        """Create a CRD (409: already there) and wait until it is Established: a real API server serves a new
        CRD's resource only a moment after answering the create (`kubectl wait --for condition=established`)."""
        try:
            self.create(CRDS, None, crd)
        except ApiError as exc:
            if exc.status != 409:
                raise
        name = crd["metadata"]["name"]

        def established() -> bool:
            conds = (self.get(CRDS, None, name).get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conds)

        wait_until(established, timeout=timeout, interval=0.05, what=f"CRD {name} Established")

    def watch(self, resource, namespace=None, *, timeout: float = 5.0, **params: str) -> Iterable[dict[str, Any]]:
        """Yield watch events until the server ends the stream or `timeout` passes without data."""
        params = {"watch": "true", **params}
        url = self.base_url + path_of(resource, namespace) + "?" + urllib.parse.urlencode(params)
        with _OPENER.open(urllib.request.Request(url, headers=self.auth), timeout=timeout) as resp:
            try:
                for line in resp:
                    if line.strip():
                        yield json.loads(line)
            except TimeoutError:
                return

    # -- test conveniences
    def events_for(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [e for e in self.items(EVENTS, namespace) if e.get("involvedObject", {}).get("name") == name]

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any] | None:
        obj = self.get(RLJOBS, namespace, name)
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return cond
        return None

    def set_pytorchjob_conditions(self, namespace: str, name: str, *conds: tuple[str, str, str], **status: Any) -> None:
        """Play the training-operator: replace the PyTorchJob's status conditions (type, status, reason)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {"status": {"conditions": [
            {"type": t, "status": s, "reason": r, "message": f"PyTorchJob {name} is {t.lower()}.",
             "lastUpdateTime": now, "lastTransitionTime": now} for t, s, r in conds], **status}}
        self.patch(PYTORCHJOBS, namespace, name, body, subresource="status")


    def set_jobset_status(self, namespace: str, name: str, *conds: tuple[str, str, str], ready: int = 0,
                          restarts: int = 0, suspended: int = 0) -> None:
        """Play the JobSet controller: its conditions (type, status, reason) and the trainer's counts."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {"status": {
            "conditions": [{"type": t, "status": s, "reason": r, "message": f"JobSet {name} is {t.lower()}.",
                            "lastTransitionTime": now} for t, s, r in conds],
            "restarts": restarts,
            "replicatedJobsStatus": [{"name": "trainer", "ready": ready, "succeeded": 0, "failed": 0,
                                      "active": 0 if suspended else 1, "suspended": suspended}]}}
        self.patch(JOBSETS, namespace, name, body, subresource="status")

    def create_workload(self, namespace: str, child: dict[str, Any]) -> dict[str, Any]:
        """Play Kueue: the Workload it creates for a job it manages, owned by the job."""
        meta = child["metadata"]
        return self.create(WORKLOADS, namespace, {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": f"{child['kind'].lower()}-{meta['name']}-{meta['uid'][:5]}",
                         "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                         "ownerReferences": [{"apiVersion": child["apiVersion"], "kind": child["kind"],
                                              "name": meta["name"], "uid": meta["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": {"queueName": meta["labels"]["kueue.x-k8s.io/queue-name"], "podSets": []}})


def wait_until(check: Callable[[], Any], *, timeout: float = 15.0, interval: float = 0.1,
               what: str = "condition", on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll `check` until it returns something truthy; return that. AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError, TypeError, ApiError, OSError) as exc:
            last_exc = exc
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_exc!r}\n{extra}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """`python -m rljob_operator` against the test API server; logs go to `log_path`."""

    def __init__(self, kubeconfig: Path, log_path: Path, *, namespaces: Iterable[str] = (),
                 all_namespaces: bool = False, env: dict[str, str] | None = None, metrics_port: int | None = None,
                 extra_args: Iterable[str] = ()):
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.metrics_port = metrics_port if metrics_port is not None else free_port()
        args = [sys.executable, "-m", "rljob_operator", "--metrics-port", str(self.metrics_port)]
        args += ["--all-namespaces"] if all_namespaces else [a for ns in namespaces for a in ("--namespace", ns)]
        args += list(extra_args)
        self.args = args
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), os.environ.get("PYTHONPATH", "")]),
                    "RLJOB_API_TIMEOUT_SECONDS": "5", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stop()
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=REPO, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Ready when its /metrics answers (started by the operator's startup handler, after login)."""
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            return self.metrics_text() is not None

        wait_until(ready, timeout=timeout, interval=0.2, what="the operator's /metrics",
                   on_timeout=lambda: self.logs()[-4000:])

    def metrics_text(self) -> str | None:
        try:
            with _OPENER.open(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
                return resp.read().decode()
        except (OSError, urllib.error.URLError):
            return None

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the operator's metrics (0.0 when absent)."""
        text = self.metrics_text() or ""
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            metric, _, value = line.rpartition(" ")
            if metric.split("{")[0] != name:
                continue
            got = {}
            if "{" in metric:
                for part in metric[metric.index("{") + 1:-1].split('",'):
                    if "=" in part:
                        k, v = part.split("=", 1)
                        got[k.strip()] = v.strip().strip('"')
            if all(got.get(k) == v for k, v in labels.items()):
                return float(value)
        return 0.0

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def rss_bytes(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown (a crash, an OOM kill, a node loss)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()
