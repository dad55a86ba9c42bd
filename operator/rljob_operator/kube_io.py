"""All Kubernetes API I/O of the operator: reads, creates, patches, deletes, status writes, events.

The `kubernetes` client runs in a bounded thread pool (one pooled connection per thread) so the
kopf event loop never blocks. Every call goes through `KubeApi._request`, which
- retries transient failures (connection errors, timeouts, 429, 5xx) a few times with jittered
  backoff before raising `ApiError` (kopf then retries the whole cycle with its own backoff);
- treats 409 on create as "already there" (creates are idempotent, so an operator restarted
  mid-reconcile never makes duplicates) and 409 on a guarded write as `Conflict`;
- never logs request bodies (a spec names Secrets, never their values, but keep logs boring).

Events are core/v1 Events posted in the background by this module (not through kopf.event, so
that cycles started outside kopf's handler context -- retries, resyncs -- post them the same way).

Status writes are merge patches of `/status` carrying `metadata.resourceVersion`, so a write
computed from a stale read fails with `Conflict` instead of overwriting newer state.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from rljob_api.models import API_VERSION, KIND, PLURAL, judge_service_name

from rljob_operator import builders
from rljob_operator.reconcile import ChildRef, Event, Observed, Plan, child_suspended
from rljob_operator.settings import OperatorSettings

log = logging.getLogger("rljob_operator.kube_io")

# Kueue's Workload: Kueue creates one per job it manages, owned by the job (v1beta2 is what Kueue >= 0.15
# serves; 0.20 dropped v1beta1).
WORKLOAD_API_VERSION = "kueue.x-k8s.io/v1beta2"
WORKLOAD_KIND = "Workload"
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Secret"): "secrets",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    (builders.PYTORCHJOB_API_VERSION, builders.PYTORCHJOB_KIND): "pytorchjobs",
    (builders.JOBSET_API_VERSION, builders.JOBSET_KIND): "jobsets",
    (WORKLOAD_API_VERSION, WORKLOAD_KIND): "workloads",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("v1", "Event"): "events",
    (API_VERSION, KIND): PLURAL,
}
RETRY_DELAYS = (0.2, 0.5, 1.0)  # in-call retries of transient failures, before the cycle gives up
# What to do when a create is answered 404 because the kind's API is not served (its CRD is not installed).
# The cycle is retried with backoff, so the job starts by itself once the CRD is there.
NOT_SERVED_FIX = {
    builders.PYTORCHJOB_KIND: ("install the Kubeflow training-operator (CRD pytorchjobs.kubeflow.org), or set "
                               "spec.childKind: JobSet"),
    builders.JOBSET_KIND: "install JobSet v1alpha2 (CRD jobsets.jobset.x-k8s.io), or remove spec.childKind (PyTorchJob)",
    "PodMonitor": ("install the Prometheus Operator's CRDs (podmonitors.monitoring.coreos.com), or set "
                   "spec.metrics.podMonitor: false"),
}


class ApiError(Exception):
    """A failed API call (after the in-call retries for transient ones)."""

    def __init__(self, verb: str, what: str, status: int, reason: str = "", message: str = ""):
        self.verb, self.what, self.status, self.reason = verb, what, status, reason
        text = f"{verb} {what}: " + (f"HTTP {status} {reason}".strip() if status else "no response")
        super().__init__(f"{text}: {message}" if message else text)

    @property
    def transient(self) -> bool:
        return self.status == 0 or self.status == 429 or self.status >= 500

    @property
    def namespace_gone(self) -> bool:
        """A create in a namespace being deleted (403) or already gone (404 naming the namespace): nothing
        to retry, the namespace's deletion takes everything."""
        text = str(self)
        return (self.status == 403 and "being terminated" in text) or (
            self.status == 404 and 'namespaces "' in text and "not found" in text)


class Conflict(ApiError):
    """409 on a write guarded by resourceVersion: someone changed the object since it was read."""


def path_for(api_version: str, kind: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
    plural = PLURALS[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{urllib.parse.quote(namespace, safe='')}"
    base += f"/{plural}"
    if name:
        base += f"/{urllib.parse.quote(name, safe='')}"
    if subresource:
        base += f"/{subresource}"
    return base


def merge_diff(old: Any, new: Any) -> Any:
    """A JSON merge patch that turns `old` into `new` (removed keys become null; lists are replaced)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_diff(old[key], value)
    return patch


def load_configuration(settings: OperatorSettings) -> k8s_client.Configuration:
    """In-cluster service account when running in a pod, else KUBECONFIG / ~/.kube/config."""
    configuration = k8s_client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        k8s_config.load_incluster_config(client_configuration=configuration)
    else:
        k8s_config.load_kube_config(client_configuration=configuration)
    return configuration


class KubeApi:
    def __init__(self, settings: OperatorSettings, *, on_error: Callable[[str, int], None] | None = None,
                 configuration: k8s_client.Configuration | None = None):
        self.settings = settings
        configuration = configuration or load_configuration(settings)
        configuration.connection_pool_maxsize = settings.api_concurrency
        configuration.retries = False  # retries are ours: bounded, logged and counted
        self._client = k8s_client.ApiClient(configuration)
        self._executor = concurrent.futures.ThreadPoolExecutor(settings.api_concurrency, thread_name_prefix="kube-io")
        self._on_error = on_error or (lambda verb, status: None)
        self._event_tasks: set[asyncio.Future] = set()
        self._instance = socket.gethostname()
        self._workload_warning_logged = False
        self.kueue_missing = False  # the last Workload list was a 404: the API is not served

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # ------------------------------------------------------------------ the one request path

    def _request_sync(self, method: str, path: str, body: Any, content_type: str | None,
                      query: list[tuple[str, str]] | None) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        req = self._client.param_serialize(method=method, resource_path=path, query_params=query or [],
                                           header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self._client.call_api(*req, _request_timeout=self.settings.api_timeout_seconds)
        response.read()
        data = response.data
        try:
            payload = json.loads(data) if data else None
        except ValueError:
            payload = {"message": data[:200].decode(errors="replace") if isinstance(data, bytes) else str(data)[:200]}
        return response.status, payload

    async def _request(self, verb: str, method: str, path: str, body: Any = None, *, content_type: str | None = None,
                       query: list[tuple[str, str]] | None = None, ok: tuple[int, ...] = (200, 201)) -> tuple[int, Any]:
        """(status, payload) for statuses in `ok` and 404/409; ApiError for the rest after retries."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                status, payload = await loop.run_in_executor(
                    self._executor, self._request_sync, method, path, body, content_type, query)
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                status, payload = getattr(exc, "status", 0) or 0, {"message": type(exc).__name__}
            if status in ok or status in (404, 409):
                return status, payload
            self._on_error(verb, status)
            reason = (payload or {}).get("reason", "") if isinstance(payload, dict) else ""
            message = (payload or {}).get("message", "") if isinstance(payload, dict) else ""
            error = ApiError(verb, path, status, reason, message)
            if not error.transient or attempt >= len(RETRY_DELAYS):
                raise error
            delay = RETRY_DELAYS[attempt] * (0.5 + random.random())
            log.info("retrying %s %s in %.2fs after %s", verb, path, delay, error)
            attempt += 1
            await asyncio.sleep(delay)

    # ------------------------------------------------------------------ verbs

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        status, payload = await self._request("get", "GET", path_for(api_version, kind, namespace, name))
        if status == 404:
            return None
        if status == 409:
            raise ApiError("get", name, status)
        return payload

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """True if created, False if an object of that name already exists (409)."""
        meta = obj["metadata"]
        status, payload = await self._request(
            "create", "POST", path_for(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj,
            content_type="application/json")
        if status == 404:  # the namespace is gone, or the kind's API is not served
            error = ApiError("create", f"{obj['kind']} {meta['name']}", status, "NotFound",
                             (payload or {}).get("message", ""))
            if not error.namespace_gone:
                fix = NOT_SERVED_FIX.get(obj["kind"], f"install the CRD that serves {obj['kind']}")
                error = ApiError("create", f"{obj['kind']} {meta['name']}", status, "NotFound",
                                 f"{obj['apiVersion']} {obj['kind']} is not served by this cluster: {fix}")
            raise error
        return status != 409

    async def patch(self, ref: ChildRef, body: Mapping[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        status, payload = await self._request(
            "patch", "PATCH", path_for(ref.api_version, ref.kind, ref.namespace, ref.name, subresource), body,
            content_type="application/merge-patch+json")
        if status == 409:
            raise Conflict("patch", f"{ref.kind} {ref.name}", 409, "Conflict")
        if status == 404:
            raise ApiError("patch", f"{ref.kind} {ref.name}", 404, "NotFound")
        return payload

    async def delete(self, ref: ChildRef, *, uid: str | None = None) -> bool:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        status, _ = await self._request("delete", "DELETE", path_for(ref.api_version, ref.kind, ref.namespace,
                                                                     ref.name), body,
                                        content_type="application/json", ok=(200, 202))
        if status == 409:
            raise Conflict("delete", f"{ref.kind} {ref.name}", 409, "Conflict")
        return status != 404

    # ------------------------------------------------------------------ the reconcile cycle's I/O

    async def get_rljob(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get(API_VERSION, KIND, namespace, name)

    async def observe(self, body: Mapping[str, Any], *, now: str, ensure_all: bool = False) -> Observed:
        """The RLJob's children: both workload kinds (a childKind edit leaves one of the other kind behind
        until it is replaced; a kind whose CRD is not installed reads as absent), the spec ConfigMap and,
        for a suspended queue-labelled child, the Kueue Workloads of its namespace."""
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        child = builders.child_name(name)
        ptj, js, cm = await asyncio.gather(
            self.get(builders.PYTORCHJOB_API_VERSION, builders.PYTORCHJOB_KIND, ns, child),
            self.get(builders.JOBSET_API_VERSION, builders.JOBSET_KIND, ns, child),
            self.get("v1", "ConfigMap", ns, builders.spec_configmap_name(name)),
        )
        workloads = None
        if any(obj is not None and builders.queue_name(obj) and child_suspended(obj) for obj in (ptj, js)):
            workloads = await self.list_workloads(ns)
        judge = None
        if ((body.get("spec") or {}).get("reward") or {}).get("server"):
            judge = await self.get("apps/v1", "Deployment", ns, judge_service_name(name))
        return Observed(now=now, pytorchjob=ptj, configmap=cm, ensure_all=ensure_all, jobset=js, workloads=workloads,
                        judge=judge, kueue_missing=workloads is None and self.kueue_missing)

    async def list_workloads(self, namespace: str) -> tuple[dict[str, Any], ...] | None:
        """Kueue Workloads in `namespace`; None (logged once) when the Workload CRD is not installed."""
        try:
            status, payload = await self._request("list", "GET",
                                                  path_for(WORKLOAD_API_VERSION, WORKLOAD_KIND, namespace))
        except ApiError as exc:
            if exc.status != 403:
                raise
            status, payload = 403, None
        self.kueue_missing = status == 404
        if status in (403, 404):
            if not self._workload_warning_logged:
                self._workload_warning_logged = True
                why = ("is not installed" if status == 404 else
                       "cannot be read (403: grant get/list/watch on workloads.kueue.x-k8s.io, as the chart does)")
                log.warning("Kueue's Workload CRD (workloads.kueue.x-k8s.io, %s) %s: %s", WORKLOAD_API_VERSION, why,
                            "queue-labelled children get NoKueueWorkload (Kueue is not installed)" if status == 404
                            else "queue-labelled children are not checked for a Workload (no NoKueueWorkload condition)")
            return None
        if status == 409:
            raise ApiError("list", "workloads", status)
        return tuple((payload or {}).get("items") or ())

    async def apply(self, body: Mapping[str, Any], plan: Plan) -> list[dict[str, Any]]:
        """Children first (in order), then events, then the status; returns the objects really created."""
        created = []
        for item in plan.create:
            if await self.create(item.body):
                created.append(item.body)
                if item.event is not None:
                    self.post_event(body, item.event)
        for patch in plan.patch:
            await self.patch(patch.ref, patch.body)
        for delete in plan.delete:
            if await self.delete(delete.ref) and delete.event is not None:
                self.post_event(body, delete.event)
        if plan.status is not None:
            await self.write_status(body, plan.status)
        for event in plan.events:
            self.post_event(body, event)
        return created

    async def write_status(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"]},
                 "status": merge_diff(body.get("status") or {}, dict(status))}
        return await self.patch(ChildRef(API_VERSION, KIND, meta["namespace"], meta["name"]), patch,
                                subresource="status")

    def post_event(self, body: Mapping[str, Any], event: Event) -> None:
        """A Kubernetes Event on the RLJob, posted in the background (an event lost to an API error is
        logged and counted, never retried into a storm, and never fails the cycle)."""
        task = asyncio.ensure_future(self._post_event(build_event(body, event, self._instance)))
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    async def _post_event(self, obj: dict[str, Any]) -> None:
        try:
            await self._request("event", "POST", path_for("v1", "Event", obj["metadata"]["namespace"]), obj,
                                content_type="application/json")
        except ApiError as exc:
            if exc.namespace_gone:
                return
            log.warning("could not post event %s on %s: %s", obj["reason"], obj["involvedObject"]["name"], exc)

    async def drain_events(self, timeout: float = 5.0) -> None:
        """Wait for events still being posted (at shutdown)."""
        if self._event_tasks:
            await asyncio.wait(list(self._event_tasks), timeout=timeout)


def build_event(body: Mapping[str, Any], event: Event, instance: str) -> dict[str, Any]:
    """A core/v1 Event about the RLJob `body` (the shape `kubectl describe` shows)."""
    meta = body["metadata"]
    now = utc_now()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": body.get("apiVersion", API_VERSION), "kind": body.get("kind", KIND),
                           "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid"),
                           "resourceVersion": meta.get("resourceVersion")},
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1024],
        "source": {"component": builders.MANAGER},
        "reportingComponent": builders.MANAGER,
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
