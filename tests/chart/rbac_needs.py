"""What the operator really asks of the Kubernetes API, derived from its code, as RBAC needs.

The chart's RBAC must grant exactly this (tests/chart/test_rbac.py). Three sources, none of them a
hand-kept list in the test:

1. Our own API calls (operator/rljob_operator/kube_io.py): the REAL handler cycle
   (`handlers.run_cycle`: get the RLJob, observe children, the pure `reconcile`, `KubeApi.apply`)
   runs through a real `KubeApi` whose one HTTP function is replaced by an in-memory object store
   that records every (method, path). A lifecycle walk (create with every optional child,
   resync, suspend, a spec change while suspended, re-create, progress report, a childKind edit to
   JobSet, its suspend and resume, a queue-labelled JobSet) drives every code
   path that issues a request; `kube_io_request_verbs()` reads kube_io's source to make sure no
   request verb went unexercised. Events the operator posts go through `kopf.event` (recorded).
2. kopf's own calls, from kopf's registry after importing the handlers: list+watch of every
   resource a handler serves; patch of resources with changing handlers (progress and diff-base
   annotations) or handlers that need a finalizer (timers); create of core/v1 events (kopf posts
   handler outcomes and our `kopf.event`s); and, from the operator's real startup settings,
   cluster observation (CRDs; namespaces when not cluster-wide) unless scanning is disabled, and
   peering objects unless standalone.
3. The mode, read with the operator's own argument parser from the Deployment's args, and the
   settings, read with `OperatorSettings.from_env` from the Deployment's env.

A need is (apiGroup, resource, verb), with subresources as "rljobs/status".
"""
from __future__ import annotations

import ast
import asyncio
import copy
import dataclasses
import itertools
import json
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE_IO = REPO / "operator" / "rljob_operator" / "kube_io.py"
UID = "6d1c7e2a-0000-4000-8000-000000000001"
NAMESPACE = "team-a"

Need = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

METHOD_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$")


def need_of(method: str, path: str) -> Need:
    m = _PATH.match(path.split("?")[0])
    if m is None:
        raise ValueError(f"not a resource path: {path}")
    group = "" if m["core"] else m["group"]
    resource = m["plural"] + (f"/{m['sub']}" if m["sub"] else "")
    if method == "GET":
        verb = "get" if m["name"] else "list"
    elif method == "DELETE" and not m["name"]:
        verb = "deletecollection"
    else:
        verb = METHOD_VERBS[method]
    return group, resource, verb


# ---------------------------------------------------------------------------- 1. our own API calls


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


class RecordingStore:
    """Stands in for `KubeApi._request_sync`: an in-memory object store that records each request."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self._rv = itertools.count(1)

    def put(self, path: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._rv))
        self.objects[path] = obj

    def __call__(self, method: str, path: str, body: Any, content_type: str | None,
                 query: list[tuple[str, str]] | None) -> tuple[int, Any]:
        self.requests.append((method, path, copy.deepcopy(body)))
        m = _PATH.match(path)
        assert m is not None, path
        obj_path = path[: -len(m["sub"]) - 1] if m["sub"] else path
        if method == "GET":
            obj = self.objects.get(obj_path)
            return (200, copy.deepcopy(obj)) if obj is not None else (404, {"reason": "NotFound"})
        if method == "POST":
            meta = body["metadata"]
            name = meta.get("name") or f"{meta['generateName']}{next(self._rv)}"
            body = {**body, "metadata": {**meta, "name": name}}
            item = f"{path}/{name}"
            if item in self.objects:
                return 409, {"reason": "AlreadyExists"}
            self.put(item, body)
            return 201, copy.deepcopy(self.objects[item])
        if method == "PATCH":
            if obj_path not in self.objects:
                return 404, {"reason": "NotFound"}
            patch = copy.deepcopy(body)
            patch.get("metadata", {}).pop("resourceVersion", None)
            self.put(obj_path, _merge_patch(self.objects[obj_path], patch))
            return 200, copy.deepcopy(self.objects[obj_path])
        if method == "DELETE":
            return (200, {"status": "Success"}) if self.objects.pop(obj_path, None) else (404, {"reason": "NotFound"})
        raise AssertionError(f"unexpected method {method} {path}")


@dataclasses.dataclass
class Recording:
    needs: set[Need]
    requests: list[tuple[str, str, Any]]
    events: list[dict[str, Any]]
    created: list[dict[str, Any]]  # request bodies of every create, in order


def _quickstart(pod_monitor: bool) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"].update({"namespace": NAMESPACE, "uid": UID, "generation": 1})
    doc["spec"].setdefault("metrics", {}).update({"enabled": True, "podMonitor": pod_monitor})
    # an operator-run judge (spec.reward.server): its Deployment and Service are children too
    doc["spec"]["reward"] = {"remote": {"protocol": "openai-chat", "judge": {"model": "judge", "promptTemplate": "{completion}"}},
                             "server": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}}
    return doc


def record_operator_calls(settings: Any, *, pod_monitor: bool, monkeypatch: Any) -> Recording:
    """Run the operator's real reconcile cycles over a lifecycle walk; return what they asked for."""
    import kopf
    from kubernetes import client as k8s_client
    from rljob_operator import handlers, kube_io

    store = RecordingStore()
    events: list[dict[str, Any]] = []
    api = kube_io.KubeApi(settings, configuration=k8s_client.Configuration())
    monkeypatch.setattr(api, "_request_sync", store)
    monkeypatch.setattr(kopf, "event", lambda body, **kw: events.append({"involved": body["kind"], **kw}))
    monkeypatch.setattr(handlers, "SETTINGS", settings)
    monkeypatch.setattr(handlers.state, "api", api)
    logging.getLogger("rljob_operator").setLevel(logging.ERROR)

    body = _quickstart(pod_monitor)
    name = body["metadata"]["name"]
    job_path = kube_io.path_for(body["apiVersion"], body["kind"], NAMESPACE, name)
    store.put(job_path, body)

    def edit(change: Mapping[str, Any]) -> None:
        obj = store.objects[job_path]
        obj["metadata"]["generation"] += 1
        store.put(job_path, _merge_patch(obj, change))

    async def walk() -> None:
        async def cycle(**kw: Any) -> None:
            await handlers.run_cycle(NAMESPACE, name, trigger="rbac-test", **kw)

        await cycle(ensure_all=True)                   # create every child, write the status
        await cycle(ensure_all=True)                   # resync: everything exists (409s)
        edit({"spec": {"suspend": True}})
        await cycle()                                  # suspend: patch the PyTorchJob
        edit({"spec": {"training": {"lr": 1.0e-3}}})
        await cycle()                                  # spec change while suspended: delete + rewrite
        await cycle()                                  # the PyTorchJob is gone: create it again
        from rljob_operator.progress import ANNOTATION, encode_progress
        edit({"metadata": {"annotations": {ANNOTATION: encode_progress(3, total_steps=30, reward_mean=0.5)}}})
        await cycle()                                  # progress: status.trainer
        edit({"spec": {"childKind": "JobSet"}})
        await cycle()                                  # childKind edit while suspended: delete the PyTorchJob
        await cycle()                                  # ... and create a JobSet
        edit({"spec": {"suspend": False}})
        await cycle()                                  # resume: patch the JobSet
        edit({"spec": {"suspend": True}})
        await cycle()                                  # suspend: patch it again
        edit({"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "team-a"}}, "spec": {"training": {"lr": 2e-3}}})
        await cycle()                                  # spec change while suspended: delete the JobSet
        edit({"spec": {"suspend": False}})
        await cycle()                                  # create a queue-labelled (suspended) JobSet
        await cycle()                                  # queued: look for its Kueue Workload
        for handle in handlers.state.retries.values():
            handle.cancel()
        handlers.state.retries.clear()

    try:
        asyncio.run(walk())
    finally:
        api.close()

    needs = {need_of(method, path) for method, path, _ in store.requests}
    if events:
        needs.add(kopf_event_need())
    created = [b for method, _, b in store.requests if method == "POST"]
    events += [b for b in created if b.get("kind") == "Event"]  # kube_io posts events itself
    return Recording(needs=needs, requests=store.requests, events=events, created=created)


def kube_io_request_verbs() -> set[tuple[str, str]]:
    """(verb label, HTTP method) of every `self._request("verb", "METHOD", ...)` in kube_io.py."""
    tree = ast.parse(KUBE_IO.read_text())
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_request"
                and len(node.args) >= 2 and all(isinstance(a, ast.Constant) for a in node.args[:2])):
            found.add((node.args[0].value, node.args[1].value))
    return found


def declared_table() -> set[Need] | None:
    """kube_io's own declared permission table, if the operator exposes one."""
    from rljob_operator import kube_io

    for attr in ("REQUIRED_PERMISSIONS", "API_CALLS", "RBAC_NEEDS"):
        table = getattr(kube_io, attr, None)
        if table is not None:
            return {(g, r, v) for g, r, verbs in _rows(table) for v in verbs}
    return None


def _rows(table: Any) -> Iterable[tuple[str, str, Iterable[str]]]:
    if isinstance(table, Mapping):
        for (group, resource), verbs in table.items():
            yield group, resource, ([verbs] if isinstance(verbs, str) else verbs)
    else:
        for row in table:
            if isinstance(row, Mapping):
                yield row.get("apiGroup", row.get("group", "")), row["resource"], row["verbs"]
            else:
                group, resource, verbs = row
                yield group, resource, ([verbs] if isinstance(verbs, str) else verbs)


# ---------------------------------------------------------------------------- 2. kopf's own calls


def kopf_event_need() -> Need:
    from kopf._cogs.structs import references

    return references.EVENTS.group, references.EVENTS.any_name or references.EVENTS.plural, "create"


def kopf_startup_settings(monkeypatch: Any) -> Any:
    """kopf's settings as the operator's startup handler leaves them (no API client, no port opened)."""
    import kopf
    from rljob_operator import handlers, kube_io, metrics

    monkeypatch.setattr(kube_io, "KubeApi", lambda *a, **kw: None)
    monkeypatch.setattr(metrics, "start_server", lambda *a, **kw: False)
    monkeypatch.setattr(handlers.state, "api", None)
    settings = kopf.OperatorSettings()
    asyncio.run(handlers.configure(settings=settings, logger=logging.getLogger("rbac-test")))
    return settings


def kopf_needs(*, clusterwide: bool, standalone: bool, settings: Any) -> tuple[set[Need], set[Need]]:
    """(namespaced needs, cluster-scoped needs) of kopf itself for the registered handlers."""
    import kopf
    import rljob_operator.handlers  # noqa: F401  (registers the handlers)
    from kopf._cogs.structs import references

    registry = kopf.get_default_registry()
    namespaced: set[Need] = set()
    cluster: set[Need] = set()

    def res(selector: Any) -> tuple[str, str]:
        return selector.group or "", selector.plural or selector.any_name

    for attr in ("_watching", "_changing", "_spawning", "_indexing", "_webhooks"):
        sub = getattr(registry, attr, None)
        for handler in sub.get_all_handlers() if sub is not None else ():
            if attr == "_webhooks":
                raise AssertionError("admission webhooks need RBAC this test does not derive; extend it")
            group, plural = res(handler.selector)
            namespaced |= {(group, plural, "list"), (group, plural, "watch")}
            if attr in ("_changing", "_spawning") or getattr(handler, "requires_finalizer", False):
                # progress/diff-base annotations (changing), finalizers (timers, daemons, deletion handlers)
                namespaced.add((group, plural, "patch"))
            if attr in ("_changing", "_spawning"):
                namespaced.add(kopf_event_need())  # kopf posts handler outcomes as events
                if _writes_status(settings):
                    namespaced.add((group, f"{plural}/status", "patch"))
    if not settings.scanning.disabled:
        crds = references.CRDS
        cluster |= {(crds.group, crds.any_name, "list"), (crds.group, crds.any_name, "watch")}
        if not clusterwide:
            nss = references.NAMESPACES
            cluster |= {(nss.group, nss.any_name, "list"), (nss.group, nss.any_name, "watch")}
    if not standalone:
        raise AssertionError("kopf peering needs kopfpeerings RBAC that the chart does not grant; extend both")
    return namespaced, cluster


def _writes_status(settings: Any) -> bool:
    """Whether kopf keeps handler progress or the diff-base in `.status` (then it patches /status)."""
    import kopf

    status_kinds = (kopf.StatusProgressStorage, kopf.SmartProgressStorage, kopf.StatusDiffBaseStorage)
    return any(isinstance(storage, status_kinds) for storage in
               (settings.persistence.progress_storage, settings.persistence.diffbase_storage))


# ---------------------------------------------------------------------------- RBAC rules as needs


def rule_needs(rules: Iterable[Mapping[str, Any]]) -> set[Need]:
    out: set[Need] = set()
    for rule in rules:
        assert "nonResourceURLs" not in rule, rule
        assert not rule.get("resourceNames"), f"the operator's rules are not per-name: {rule}"
        for group, resource, verb in itertools.product(rule["apiGroups"], rule["resources"], rule["verbs"]):
            out.add((group, resource, verb))
    return out


def format_needs(needs: Iterable[Need]) -> str:
    rows: dict[tuple[str, str], list[str]] = {}
    for group, resource, verb in sorted(needs):
        rows.setdefault((group, resource), []).append(verb)
    return json.dumps({f"{g or 'core'}/{r}": v for (g, r), v in sorted(rows.items())}, indent=1)
