"""A Kubernetes API server for tests: kmock's HTTP scaffold plus the state and rules a kube-apiserver keeps.

No kube-apiserver can be installed here, so the operator tests talk HTTP to this. kmock's
`KubernetesScaffold` gives the aiohttp server, request parsing, API discovery (`/api`, `/apis`,
`/apis/G/V`), Status-shaped errors and streamed responses. This layer adds what kmock's emulator
lacks (each item is tested in test_apiserver.py):

- `/api/v1/namespaces` (list, get, watch, create, delete), and namespaced creates need the namespace;
- metadata the server owns: uid, resourceVersion (one global counter), creationTimestamp,
  generation (bumped on spec changes of custom resources), generateName;
- lists with `kind`, `apiVersion` and `metadata.resourceVersion`; label and field selectors;
- CRDs: a created CRD is served (registered for discovery, Established) a moment later, as on a
  real server (its create response has `status.conditions: null`); deleting one removes it;
- decoding as the real server does: unknown fields are PRUNED (CRDs by their structural schema,
  built-ins by the Kubernetes OpenAPI types, ObjectMeta by its fields) and answered 200/201 with a
  `Warning: 299 - "unknown field \"spec.x\""` header (recorded: `unknown_field_warnings()`), or
  refused with `fieldValidation=Strict` (kubectl's default; 400 `strict decoding error`); a wrong
  JSON type in a built-in kind is 400;
- admission-style validation of creates and patches (422): the CRD's openAPIV3Schema, its CEL
  `x-kubernetes-validations` (cel-python; transition rules on updates; unchanged values are not
  re-checked, as with validation ratcheting; after a schema error the rules are skipped with the
  cause `some validation rules were not checked ...`), kubernetes-validate schemas for the built-in
  kinds we create, label values, annotations over 256 KiB (kubectl's client-side apply of a large
  object);
- a real `/status` subresource: patches of the main resource ignore `.status`, patches of
  `/status` ignore everything else;
- merge patch (RFC 7386), JSON patch (RFC 6902, `test` failing -> 422), strategic merge patch for
  built-in kinds only (415 on custom resources; treated as a merge patch), server-side apply
  (`application/apply-patch+yaml`, 422 without `fieldManager`; creates an absent object, then
  merges like a merge patch: no managedFields, conflicts or removal of fields a manager dropped);
  a `metadata.resourceVersion` in a merge patch is a precondition (409 Conflict); changing
  `metadata.name` is 400, `metadata.uid` 422; no-op patches do not bump the resourceVersion;
  a create carrying `metadata.resourceVersion` is 500, as on a real server;
- deletion with finalizers (deletionTimestamp first); garbage collection and namespace deletion
  are NOT done by the server but by a background controller, like kube-controller-manager
  (`controllers=False`: a server without it): ownerReference cascades, orphan (`orphan`
  finalizer; the dependents' `ownerReferences` key is removed) and foreground
  (`foregroundDeletion`) propagation, dangling owners; a deleted namespace is `Terminating`
  (creates in it are 403) until its contents are gone;
- watches and lists that honour `resourceVersion` (replay from an event log, `410 Expired` once
  compacted), `timeoutSeconds` (an integer: `300.0` is 400 as on a real server),
  `allowWatchBookmarks` (periodic BOOKMARKs), selectors;

- with `tokens={TOKEN: kube_rbac.User(...)}`: bearer-token authentication (401), RBAC from the stored
  Roles, ClusterRoles and bindings (403; system:masters may do anything), and RBAC's escalation
  prevention on writes of Roles and bindings (kube_rbac.py);
- fault injection: HTTP errors, delays before handling, delayed responses, dropped watches.

Gaps, on purpose: authorization is off unless `tokens` is given, no PUT/replace, no
defaulting, watches with label selectors do not synthesize ADDED/DELETED when an object's labels
move it in or out of the selection. The operator suite also runs against a real kube-apiserver
(RLJOB_TEST_KUBECONFIG; see README, Development).

Use `ApiServerThread` from tests (a server on its own event loop in a thread; talk to it over
HTTP with `cluster.KubeClient`), or run it alone: `python tests/operator/apiserver.py --port 8001`.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import copy
import dataclasses
import datetime
import functools
import json
import random
import re
import string
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import kube_rbac
import opschema
import yaml
from kmock._internal import rendering  # the Request/Response types kmock hands to handlers

Key = tuple[str, str, str]  # (group, version, plural)

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
BUILTINS: dict[Key, tuple[str, bool]] = {
    ("", "v1", "namespaces"): ("Namespace", False),
    ("", "v1", "configmaps"): ("ConfigMap", True),
    ("", "v1", "secrets"): ("Secret", True),
    ("", "v1", "serviceaccounts"): ("ServiceAccount", True),
    ("", "v1", "services"): ("Service", True),
    ("", "v1", "pods"): ("Pod", True),
    ("", "v1", "events"): ("Event", True),
    ("apps", "v1", "deployments"): ("Deployment", True),
    ("events.k8s.io", "v1", "events"): ("Event", True),
    ("rbac.authorization.k8s.io", "v1", "roles"): ("Role", True),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): ("RoleBinding", True),
    ("rbac.authorization.k8s.io", "v1", "clusterroles"): ("ClusterRole", False),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"): ("ClusterRoleBinding", False),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions"): ("CustomResourceDefinition", False),
}
BUILTIN_STATUS = {"Deployment"}  # built-in kinds with a status subresource (its controller writes it)
STRICT_BUILTINS = {"Deployment", "ConfigMap", "Secret", "ServiceAccount", "Service", "Role", "RoleBinding", "ClusterRole",
                   "ClusterRoleBinding", "Event"}
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
_USER: contextvars.ContextVar[kube_rbac.User | None] = contextvars.ContextVar("user", default=None)
NAMESPACES: Key = ("", "v1", "namespaces")
CRDS: Key = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
MAX_ANNOTATIONS_BYTES = 256 * 1024
CEL_NOT_CHECKED = ("some validation rules were not checked because the object was invalid; correct the existing "
                   "errors to complete validation")
APPLY_PATCH = "application/apply-patch+yaml"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_NS_PATH = re.compile(r"^/api/v1/namespaces(?:/([^/]+))?/?$")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_version(key: Key) -> str:
    return key[1] if key[0] == "" else f"{key[0]}/{key[1]}"


# ---------------------------------------------------------------------------- patches

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (returns a new object)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


class PatchError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(422, f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, list):
            doc = doc[int(p)]
        elif isinstance(doc, dict):
            doc = doc[p]
        else:
            raise KeyError(p)
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    if not isinstance(ops, list):
        raise PatchError(400, "a JSON patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        try:
            if kind == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise PatchError(422, f"the test operation failed at {op.get('path')}")
                continue
            if kind in ("move", "copy"):
                value = copy.deepcopy(_walk(doc, _pointer(op["from"])))
                if kind == "move":
                    doc = json_patch(doc, [{"op": "remove", "path": op["from"]}])
                doc = json_patch(doc, [{"op": "add", "path": op["path"], "value": value}])
                continue
            if not parts:
                if kind in ("add", "replace"):
                    doc = copy.deepcopy(op["value"])
                    continue
                raise PatchError(422, "cannot remove the whole document")
            parent, last = _walk(doc, parts[:-1]), parts[-1]
            if kind == "add":
                if isinstance(parent, list):
                    parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
                else:
                    parent[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind == "replace":
                _walk(parent, [last])  # must exist
                parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
            else:
                raise PatchError(422, f"unsupported JSON patch operation {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise PatchError(422, f"JSON patch {kind} {op.get('path')!r} failed: {exc!r}") from None
    return doc


# ---------------------------------------------------------------------------- selectors

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_label_selector(text: str | None) -> Callable[[dict[str, str]], bool]:
    """Equality (=, ==, !=), set (in, notin) and existence (k, !k) requirements, ANDed."""
    if not text:
        return lambda labels: True
    reqs: list[Callable[[dict[str, str]], bool]] = []
    for part in re.split(r",(?![^()]*\))", text):
        part = part.strip()
        if not part:
            continue
        m = _SET_RE.match(part)
        if m:
            k, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                reqs.append(lambda lb, k=k, vs=values: lb.get(k) in vs)
            else:
                reqs.append(lambda lb, k=k, vs=values: lb.get(k) not in vs)
        elif "!=" in part:
            k, v = (s.strip() for s in part.split("!=", 1))
            reqs.append(lambda lb, k=k, v=v: lb.get(k) != v)
        elif "=" in part:
            k, v = (s.strip() for s in part.replace("==", "=").split("=", 1))
            reqs.append(lambda lb, k=k, v=v: lb.get(k) == v)
        elif part.startswith("!"):
            key = part[1:].strip()
            reqs.append(lambda lb, k=key: k not in lb)
        else:
            reqs.append(lambda lb, k=part: k in lb)
    return lambda labels: all(r(labels) for r in reqs)


def parse_field_selector(text: str | None) -> Callable[[dict[str, Any]], bool]:
    """metadata.name / metadata.namespace with = or !=."""
    if not text:
        return lambda obj: True
    reqs = []
    for part in text.split(","):
        neg = "!=" in part
        field, value = (s.strip() for s in re.split(r"!=|==|=", part, maxsplit=1))
        reqs.append((field.split("."), value, neg))

    def check(obj: dict[str, Any]) -> bool:
        for path, value, neg in reqs:
            try:
                actual = _walk(obj, path)
            except (KeyError, IndexError, ValueError):
                actual = None
            if (actual == value) == neg:
                return False
        return True

    return check


# ---------------------------------------------------------------------------- CEL

@functools.cache
def _cel_program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: dict[str, Any], value: Any, old: Any, path: str) -> list[tuple[str, str]]:
    """(field, message) for every failing x-kubernetes-validations rule, walking schema and value together."""
    import celpy

    out: list[tuple[str, str]] = []
    if old is not None and value == old:
        return out  # validation ratcheting (Kubernetes >= 1.30): an unchanged value is not re-checked
    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule["rule"]
        bindings = {"self": celpy.json_to_cel(value)}
        if "oldSelf" in text:
            if old is None:
                continue  # transition rules apply to updates only
            bindings["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = _cel_program(text).evaluate(bindings)
            ok = not isinstance(result, celpy.CELEvalError) and bool(result)
        except Exception as exc:  # noqa: BLE001 - a rule that cannot evaluate fails validation, as on a server
            ok, rule = False, {**rule, "message": f"{rule.get('message') or text} (evaluation error: {exc})"}
        if not ok:
            out.append((path + rule.get("fieldPath", ""), rule.get("message") or f"failed rule: {text}"))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for k, v in value.items():
            sub = props.get(k) if k in props else (schema.get("additionalProperties")
                                                    if isinstance(schema.get("additionalProperties"), dict) else None)
            if sub:
                out.extend(cel_errors(sub, v, old.get(k) if isinstance(old, dict) else None, f"{path}.{k}"))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out.extend(cel_errors(schema["items"], v, None, f"{path}[{i}]"))
    return out


# ---------------------------------------------------------------------------- server state

@dataclasses.dataclass
class Kind:
    kind: str
    namespaced: bool
    custom: bool = False
    status_subresource: bool = False
    schema: dict[str, Any] | None = None  # the openAPIV3Schema of a CRD version
    validator: Any = None
    singular: str = ""
    shortnames: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    printer_columns: tuple[dict[str, Any], ...] = ()  # a CRD version's additionalPrinterColumns

    @functools.cached_property
    def has_cel(self) -> bool:
        return "x-kubernetes-validations" in json.dumps(self.schema or {})


@dataclasses.dataclass
class Watcher:
    key: Key
    namespace: str | None
    labels: Callable[[dict[str, str]], bool]
    fields: Callable[[dict[str, Any]], bool]
    queue: asyncio.Queue

    def matches(self, ns: str | None, obj: dict[str, Any]) -> bool:
        if self.namespace is not None and ns != self.namespace:
            return False
        return self.labels(obj.get("metadata", {}).get("labels") or {}) and self.fields(obj)


@dataclasses.dataclass
class Fault:
    """Make matching requests fail or hang. `status=None` serves them normally after the delays."""

    method: str | None
    path: re.Pattern[str]
    status: int | None = 500
    times: int | None = 1  # None: forever
    delay: float = 0.0  # before the request is handled
    delay_response: float = 0.0  # after it was handled, before the response goes out
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.times is None or self.times > 0) and (self.method is None or self.method == method) and bool(
            self.path.search(path))


_DROP = object()  # a sentinel that ends a watch stream


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    bookmark_interval: float = 10.0
    gc_delay: float = 0.05  # how long the stand-in kube-controller-manager waits before a sweep
    controllers: bool = True  # run the garbage collector and namespace controller (kube-controller-manager)
    crd_establish_delay: float = 0.05  # a new CRD's resource is served (and Established) this much later
    log_size: int = 20000
    # Bearer token -> user. None: no authentication or authorization (every request is allowed).
    # With tokens: unknown tokens are 401, requests are authorized by the stored RBAC objects
    # (403), and writes of Roles and bindings pass RBAC's escalation prevention.
    tokens: dict[str, kube_rbac.User] | None = None
    validate_builtins: bool = True
    max_requests_kept: int = 20000

    _kinds: dict[Key, Kind] = attrs.field(factory=dict, init=False)
    _store: dict[Key, dict[tuple[str | None, str], dict[str, Any]]] = attrs.field(
        factory=lambda: collections.defaultdict(dict), init=False)
    _uids: dict[str, tuple[Key, str | None, str]] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=1000, init=False)
    _log: dict[Key, collections.deque] = attrs.field(factory=lambda: collections.defaultdict(collections.deque),
                                                     init=False)
    _floor: dict[Key, int] = attrs.field(factory=lambda: collections.defaultdict(int), init=False)
    _watchers: set[int] = attrs.field(factory=set, init=False)
    _watcher_objs: dict[int, Watcher] = attrs.field(factory=dict, init=False)
    _faults: list[Fault] = attrs.field(factory=list, init=False)
    _served: int = attrs.field(default=0, init=False)
    _warnings: list[tuple[str, str, str, str]] = attrs.field(factory=list, init=False)
    _dirty: asyncio.Event | None = attrs.field(default=None, init=False)
    _controller_task: asyncio.Task | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, namespaced) in BUILTINS.items():
            self._register(key, Kind(kind=kind, namespaced=namespaced, singular=kind.lower(),
                                     status_subresource=kind in BUILTIN_STATUS))
        for ns in ("default", "kube-system"):
            self._put(NAMESPACES, None, self._stamp(NAMESPACES, {"metadata": {"name": ns}}), "ADDED")

    # ------------------------------------------------------------------ registry

    def _register(self, key: Key, kind: Kind) -> None:
        self._kinds[key] = kind
        self.resources[kmock.resource(*key)] = kmock.ResourceInfo(
            kind=kind.kind, namespaced=kind.namespaced, singular=kind.singular or kind.kind.lower(), verbs=VERBS,
            shortnames=kind.shortnames, categories=kind.categories,
            subresources={"status"} if kind.status_subresource else set())

    def _unregister(self, key: Key) -> None:
        self._kinds.pop(key, None)
        self.resources.pop(kmock.resource(*key), None)
        for (ns, name), obj in list(self._store.get(key, {}).items()):
            self._remove(key, ns, name)

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            self._register((spec["group"], version["name"], names["plural"]), Kind(
                kind=names["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced", custom=True,
                status_subresource="status" in (version.get("subresources") or {}), schema=schema,
                validator=opschema.crd_validator(crd, version["name"]) if schema else None,
                singular=names.get("singular", names["kind"].lower()), shortnames=tuple(names.get("shortNames", ())),
                categories=tuple(names.get("categories", ())),
                printer_columns=tuple(version.get("additionalPrinterColumns") or ())))

    # ------------------------------------------------------------------ storage primitives (no awaits inside)

    def _stamp(self, key: Key, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        kind = self._kinds[key]
        obj["apiVersion"], obj["kind"] = api_version(key), kind.kind
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if kind.namespaced:
            meta["namespace"] = namespace or meta.get("namespace")
        else:
            meta.pop("namespace", None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(server_owned, None)
        if kind.custom:
            meta["generation"] = 1
            if kind.status_subresource:
                obj.pop("status", None)  # the status of a new object comes from the status subresource only
        if key == NAMESPACES:
            obj["spec"] = {"finalizers": ["kubernetes"]}  # the namespace controller's: contents go first
            obj["status"] = {"phase": "Active"}
        return obj

    def _put(self, key: Key, ns: str | None, obj: dict[str, Any], event: str) -> dict[str, Any]:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        name = obj["metadata"]["name"]
        self._store[key][(ns, name)] = obj
        self._uids[obj["metadata"]["uid"]] = (key, ns, name)
        self._emit(key, ns, {"type": event, "object": obj})
        return obj

    def _remove(self, key: Key, ns: str | None, name: str, propagation: str = "Background") -> dict[str, Any]:
        obj = copy.deepcopy(self._store[key].pop((ns, name)))
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._uids.pop(obj["metadata"]["uid"], None)
        self._emit(key, ns, {"type": "DELETED", "object": obj})
        if key == CRDS:
            spec = obj["spec"]
            for version in spec["versions"]:
                self._unregister((spec["group"], version["name"], spec["names"]["plural"]))
        self._mark_dirty()  # the garbage collector looks for dependents
        return obj

    def _emit(self, key: Key, ns: str | None, event: dict[str, Any]) -> None:
        log = self._log[key]
        log.append((self._rv, ns, event))
        while len(log) > self.log_size:
            rv, _, _ = log.popleft()
            self._floor[key] = rv
        for wid in list(self._watchers):
            w = self._watcher_objs[wid]
            if w.key == key and w.matches(ns, event["object"]):
                w.queue.put_nowait((self._rv, event))

    # ------------------------------------------------------------------ kube-controller-manager stand-in
    # Like a real cluster, the API server itself only stores: garbage collection (ownerReferences,
    # orphan and foreground finalizers) and namespace deletion are done later by a controller, here a
    # background task woken by deletions (`controllers=False`: a server without kube-controller-manager).

    def _mark_dirty(self) -> None:
        if self._dirty is not None:
            self._dirty.set()

    def _start_controllers(self) -> None:
        if self._controller_task is None and self.controllers:
            self._dirty = asyncio.Event()
            self._controller_task = asyncio.get_running_loop().create_task(self._controller_loop())

    async def _controller_loop(self) -> None:
        assert self._dirty is not None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await asyncio.sleep(self.gc_delay)
            self._sweep()

    def _sweep(self) -> None:
        for (_, ns_name), ns_obj in list(self._store[NAMESPACES].items()):
            if ns_obj["metadata"].get("deletionTimestamp"):
                contents = [(key, ons, oname) for key, objs in self._store.items() if key != NAMESPACES
                            for (ons, oname) in objs if ons == ns_name]
                for key, ons, oname in contents:
                    self._delete(key, ons, oname, propagation="Background")
                if not contents:
                    self._remove(NAMESPACES, None, ns_name)
        for key, objs in list(self._store.items()):
            for (ns, name), obj in list(objs.items()):
                meta = obj["metadata"]
                finalizers = meta.get("finalizers") or []
                if not meta.get("deletionTimestamp"):
                    continue
                dependents = self._dependents(meta["uid"])
                if "orphan" in finalizers:
                    for dep in dependents:
                        self._drop_owner_refs(*dep, {meta["uid"]})
                    self._remove_finalizer(key, ns, name, "orphan")
                elif "foregroundDeletion" in finalizers:
                    for dkey, dns, dname in dependents:
                        self._delete(dkey, dns, dname, propagation="Foreground")
                    if not dependents:
                        self._remove_finalizer(key, ns, name, "foregroundDeletion")
        for key, objs in list(self._store.items()):
            for (ns, name), obj in list(objs.items()):
                refs = obj["metadata"].get("ownerReferences") or []
                dead = {r.get("uid") for r in refs if r.get("uid") not in self._uids}
                if not dead:
                    continue
                if len(dead) < len({r.get("uid") for r in refs}):
                    self._drop_owner_refs(key, ns, name, dead)  # other owners live: only the dangling refs go
                else:
                    self._delete(key, ns, name, propagation="Background")

    def _dependents(self, owner_uid: str) -> list[tuple[Key, str | None, str]]:
        return [(key, ns, name) for key, objs in self._store.items() for (ns, name), obj in objs.items()
                if any(r.get("uid") == owner_uid for r in obj["metadata"].get("ownerReferences") or [])]

    def _drop_owner_refs(self, key: Key, ns: str | None, name: str, uids: set[str]) -> None:
        new = copy.deepcopy(self._store[key][(ns, name)])
        refs = [r for r in new["metadata"].get("ownerReferences") or [] if r.get("uid") not in uids]
        if refs:
            new["metadata"]["ownerReferences"] = refs
        else:
            new["metadata"].pop("ownerReferences", None)  # as on a real server: the key goes, not `[]`
        self._put(key, ns, new, "MODIFIED")

    def _remove_finalizer(self, key: Key, ns: str | None, name: str, finalizer: str) -> None:
        new = copy.deepcopy(self._store[key][(ns, name)])
        rest = [f for f in new["metadata"].get("finalizers") or [] if f != finalizer]
        if rest:
            new["metadata"]["finalizers"] = rest
            self._put(key, ns, new, "MODIFIED")
        else:
            new["metadata"].pop("finalizers", None)
            self._store[key][(ns, name)] = new
            self._remove(key, ns, name)

    def _delete(self, key: Key, ns: str | None, name: str, *, propagation: str) -> dict[str, Any]:
        """What a DELETE does on the server: mark (finalizers, namespaces) or remove; the rest is the controllers'."""
        obj = self._store[key][(ns, name)]
        meta = obj["metadata"]
        if key == NAMESPACES:
            if meta.get("deletionTimestamp"):
                return obj
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            new["status"] = {"phase": "Terminating"}
            self._mark_dirty()
            return self._put(key, ns, new, "MODIFIED")
        finalizers = list(meta.get("finalizers") or [])
        gc_finalizer = {"Orphan": "orphan", "Foreground": "foregroundDeletion"}.get(propagation)
        if gc_finalizer and gc_finalizer not in finalizers and not meta.get("deletionTimestamp"):
            finalizers.append(gc_finalizer)
        if finalizers:
            if meta.get("deletionTimestamp") and finalizers == meta.get("finalizers"):
                return obj
            new = copy.deepcopy(obj)
            new["metadata"]["finalizers"] = finalizers
            new["metadata"].setdefault("deletionTimestamp", now_rfc3339())
            new["metadata"].setdefault("deletionGracePeriodSeconds", 0)
            self._mark_dirty()
            return self._put(key, ns, new, "MODIFIED")
        return self._remove(key, ns, name, propagation)

    # ------------------------------------------------------------------ validation

    def _invalid(self, key: Key, obj: dict[str, Any], old: dict[str, Any] | None) -> list[tuple[str, str]]:
        kind = self._kinds[key]
        meta = obj.get("metadata") or {}
        name = meta.get("name") or ""
        causes: list[tuple[str, str]] = []
        if not _NAME.match(name) or len(name) > 253:
            causes.append(("metadata.name", f"{name!r} is not a valid DNS subdomain name"))
        for k, v in (meta.get("labels") or {}).items():
            if not isinstance(v, str) or len(v) > 63:
                causes.append((f"metadata.labels.{k}", "label values must be strings of at most 63 characters"))
        annotations = meta.get("annotations") or {}
        if sum(len(k) + len(str(v)) for k, v in annotations.items()) > MAX_ANNOTATIONS_BYTES:
            # e.g. kubectl's client-side last-applied-configuration of a large object (use --server-side)
            causes.append(("metadata.annotations", f"Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes"))
        if kind.validator is not None:
            for err in kind.validator.iter_errors(obj):
                causes.append(("." .join(str(p) for p in err.absolute_path) or "(root)", err.message))
            if not causes:
                causes.extend(cel_errors(kind.schema or {}, obj, old, ""))
            elif kind.has_cel:
                causes.append(("<nil>", CEL_NOT_CHECKED))
        elif self.validate_builtins and kind.kind in STRICT_BUILTINS:
            causes.extend((e.split(":", 1)[0], e.split(":", 1)[-1].strip()) for e in opschema.builtin_errors(obj))
        return causes

    # ------------------------------------------------------------------ authentication and RBAC

    def _rbac_lookup(self, kind: str, ns: str | None, name: str) -> dict[str, Any] | None:
        key = ("rbac.authorization.k8s.io", "v1", kind.lower() + "s")
        return self._store.get(key, {}).get((ns, name))

    def _rbac_listing(self, kind: str) -> list[dict[str, Any]]:
        return list(self._store.get(("rbac.authorization.k8s.io", "v1", kind.lower() + "s"), {}).values())

    def _authenticate_and_authorize(self, request: rendering.Request) -> aiohttp.web.Response | None:
        assert self.tokens is not None
        header = request.headers.get("Authorization", "")
        user = self.tokens.get(header[7:]) if header.startswith("Bearer ") else None
        if user is None:
            return error(401, "Unauthorized", "Unauthorized")
        _USER.set(user)
        res = request.resource
        if res is None or res.plural is None:
            return None  # discovery and /version: every authenticated user (system:discovery)
        key = (res.group, res.version, res.plural)
        kind = self._kinds.get(key)
        action = request.action
        verb = ("watch" if action == kmock.action.WATCH else "list" if action == kmock.action.LIST else
                "get" if action == kmock.action.FETCH else "create" if action == kmock.action.CREATE else
                "patch" if action == kmock.action.UPDATE else
                ("delete" if request.name else "deletecollection") if action == kmock.action.DELETE else "get")
        if verb == "patch" and (request.headers.get("Content-Type") or "").startswith(APPLY_PATCH) and \
                (None if kind is None else self._store[key].get(
                    (request.namespace if kind.namespaced else None, request.name))) is None:
            verb = "create"  # server-side apply of an absent object creates it (needs both verbs)
        attrs = kube_rbac.Attributes(verb, res.group, res.plural + (f"/{request.subresource}" if request.subresource
                                                                     else ""),
                                     request.namespace if kind is None or kind.namespaced else None, request.name)
        if kube_rbac.authorize(user, attrs, self._rbac_lookup, self._rbac_listing):
            return None
        return error(403, "Forbidden", kube_rbac.forbidden_message(user, attrs),
                     {"name": request.name, "group": res.group, "kind": res.plural})

    def _escalation(self, kind: Kind, obj: dict[str, Any]) -> aiohttp.web.Response | None:
        user = _USER.get()
        if self.tokens is None or user is None or kind.kind not in RBAC_KINDS:
            return None
        missing = kube_rbac.escalation(user, obj, self._rbac_lookup, self._rbac_listing)
        if not missing:
            return None
        name = obj["metadata"]["name"]
        return error(403, "Forbidden", f'{kind.kind.lower()}s.rbac.authorization.k8s.io "{name}" is forbidden: user '
                     f'"{user.name}" (groups={list(user.groups)}) is attempting to grant RBAC permissions not '
                     f"currently held:\n" + "\n".join(missing))

    # ------------------------------------------------------------------ HTTP entry points

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        m = _NS_PATH.match(raw_request.path)
        if m is None:
            return await super().__call__(raw_request)
        # kmock's path parser cannot read /api/v1/namespaces[/NAME]: build the request here.
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        method = raw_request.method.upper()
        name = m.group(1)
        action = (kmock.action.WATCH if method == "GET" and raw_request.query.get("watch") in ("true", "1") else
                  kmock.action.FETCH if method == "GET" and name else kmock.action.LIST if method == "GET" else
                  kmock.action.CREATE if method == "POST" else kmock.action.UPDATE if method == "PATCH" else
                  kmock.action.DELETE if method == "DELETE" else None)
        request = rendering.Request(
            id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=method,
            params=dict(raw_request.query), headers=dict(raw_request.headers), body=body, text=body.decode(),
            data=data, action=action, resource=kmock.resource(*NAMESPACES), namespace=None, name=name)
        self._requests.append(request)
        try:
            return await self._handle(request)
        except rendering.StreamingError as exc:
            return exc.args[0]

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if request.url.path == "/harness/stats":  # for benchmarks that run this server as a subprocess
            return aiohttp.web.json_response({"requests": self._served, "watches": len(self._watchers),
                                              "objects": sum(len(v) for v in self._store.values())})
        self._served += 1
        self._start_controllers()
        if self.tokens is not None:
            denied = self._authenticate_and_authorize(request)
            if denied is not None:
                return denied
        if res is None or res.plural is None:
            return await super()._handle(request)  # discovery and non-Kubernetes paths: kmock's scaffold
        if len(self._requests) > self.max_requests_kept:
            del self._requests[: len(self._requests) - self.max_requests_kept // 2]
        fault = next((f for f in self._faults if f.matches(request.method.value, request.url.path_qs)), None)
        if fault is not None:
            fault.hits += 1
            if fault.times is not None:
                fault.times -= 1
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.status is not None:
                return error(fault.status, "InternalError" if fault.status >= 500 else "Injected",
                             f"injected fault for {request.method.value} {request.url.path}")
        response = await self._serve(request, (res.group, res.version, res.plural))
        if fault is not None and fault.delay_response:
            await asyncio.sleep(fault.delay_response)
        return response

    async def _serve(self, request: rendering.Request, key: Key) -> aiohttp.web.StreamResponse:
        kind = self._kinds.get(key)
        if kind is None:
            return error(404, "NotFound", f"the server could not find the requested resource ({'/'.join(key)})")
        ns = request.namespace if kind.namespaced else None
        if kind.namespaced and request.name is not None and ns is None:
            return error(404, "NotFound", "a namespaced object needs a namespace in the URL")
        action = request.action
        bad_param = _integer_param_error(request.params) if request.method.value == "GET" else None
        if bad_param is not None:
            return error(400, "BadRequest", bad_param)
        if action == kmock.action.WATCH:
            stream = self._watch(request, key, kind, ns)
            return await rendering.Response(payload=stream)(request)
        wants_table = "as=Table" in request.headers.get("Accept", "")
        if action == kmock.action.LIST:
            response = self._list(request, key, kind, ns)
            if wants_table:
                return aiohttp.web.json_response(as_table(kind, json.loads(response.text)["items"]))
            return response
        if action == kmock.action.FETCH:
            obj = self._store[key].get((ns, request.name))
            if obj is None:
                return not_found(kind, request.name)
            return aiohttp.web.json_response(as_table(kind, [obj]) if wants_table else obj)
        if action == kmock.action.CREATE:
            return self._create(request, key, kind, ns)
        if action == kmock.action.UPDATE:
            return self._patch(request, key, kind, ns)
        if action == kmock.action.DELETE:
            return self._delete_request(request, key, kind, ns)
        return error(405, "MethodNotAllowed", f"{request.method.value} is not supported by this test server")

    def _list(self, request: rendering.Request, key: Key, kind: Kind, ns: str | None) -> aiohttp.web.Response:
        labels = parse_label_selector(request.params.get("labelSelector"))
        fields = parse_field_selector(request.params.get("fieldSelector"))
        items = [obj for (ons, _), obj in sorted(self._store[key].items(), key=lambda kv: (kv[0][0] or "", kv[0][1]))
                 if (ns is None or ons == ns) and labels(obj["metadata"].get("labels") or {}) and fields(obj)]
        return aiohttp.web.json_response({
            "apiVersion": api_version(key), "kind": f"{kind.kind}List",
            "metadata": {"resourceVersion": str(self._rv), "continue": ""}, "items": items,
        })

    def _decode(self, request: rendering.Request, kind: Kind, obj: dict[str, Any]) -> aiohttp.web.Response | list[str]:
        """Decode `obj` as the API server does, in place: unknown fields are dropped (CRDs: structural
        pruning; built-ins: the Go types) and reported as warnings, or refused with `fieldValidation=Strict`
        (kubectl's default); a wrong JSON type in a built-in fails decoding (400). Returns the warnings."""
        if kind.custom:
            dropped = opschema.prune_custom(obj, kind.schema) if kind.schema else []
            type_errors: list[str] = []
        elif self.validate_builtins and kind.kind in STRICT_BUILTINS:
            dropped, type_errors, _ = opschema.check_builtin(obj)
        else:
            dropped, type_errors = [], []
        if type_errors:
            version = obj.get("apiVersion", "")
            return error(400, "BadRequest", f'{kind.kind} in version "{version.split("/")[-1]}" cannot be handled as '
                         f'a {kind.kind}: {"; ".join(type_errors)}')
        mode = request.params.get("fieldValidation", "Warn")
        if mode not in ("Strict", "Warn", "Ignore"):
            return error(400, "BadRequest", f"fieldValidation must be Strict, Warn or Ignore, got {mode!r}")
        warnings = [f'unknown field "{path}"' for path in dropped]
        if warnings and mode == "Strict":
            return error(400, "BadRequest", "strict decoding error: " + ", ".join(warnings))
        if mode == "Ignore":
            return []
        agent = request.headers.get("User-Agent", "")
        self._warnings.extend((agent, request.method.value, request.url.path, w) for w in warnings)
        return warnings

    def _create(self, request: rendering.Request, key: Key, kind: Kind, ns: str | None,
                body: Any = None) -> aiohttp.web.Response:
        body = request.data if body is None else body
        if not isinstance(body, dict):
            return error(400, "BadRequest", "the request body must be a JSON object")
        if request.subresource:
            return error(405, "MethodNotAllowed", f"cannot create the {request.subresource} subresource")
        body_ns = (body.get("metadata") or {}).get("namespace")
        if kind.namespaced and body_ns and body_ns != ns:
            return error(400, "BadRequest", f"the namespace of the object ({body_ns}) does not match the URL ({ns})")
        if kind.namespaced:
            namespace = self._store[NAMESPACES].get((None, ns))
            if namespace is None:
                return error(404, "NotFound", f'namespaces "{ns}" not found')
            if namespace["metadata"].get("deletionTimestamp"):
                return error(403, "Forbidden", f"{kind.kind.lower()}s is forbidden: unable to create new content in "
                             f"namespace {ns} because it is being terminated")
        if (body.get("metadata") or {}).get("resourceVersion"):
            return error(500, "InternalError", "resourceVersion should not be set on objects to be created")
        if not (body.get("metadata") or {}).get("name") and not (body.get("metadata") or {}).get("generateName"):
            return error(422, "Invalid", "metadata.name or metadata.generateName is required")
        obj = self._stamp(key, body, ns)
        warnings = self._decode(request, kind, obj)
        if isinstance(warnings, aiohttp.web.Response):
            return warnings
        name = obj["metadata"]["name"]
        if (ns, name) in self._store[key]:
            return error(409, "AlreadyExists", f'{kind.kind.lower()}s "{name}" already exists',
                         {"name": name, "kind": kind.kind.lower() + "s"})
        causes = self._invalid(key, obj, None)
        if causes:
            return invalid(kind, name, causes)
        escalating = self._escalation(kind, obj)
        if escalating is not None:
            return escalating
        if key == CRDS:
            # Served (and Established) a moment later, as on a real server: wait for the condition.
            obj["status"] = {"acceptedNames": {"kind": "", "plural": ""}, "conditions": None, "storedVersions": []}
            asyncio.get_running_loop().call_later(self.crd_establish_delay, self._establish, obj["metadata"]["uid"])
        self._put(key, ns, obj, "ADDED")
        refs = obj["metadata"].get("ownerReferences") or []
        if refs and not all(r.get("uid") in self._uids for r in refs):  # owners gone (or never existed)
            self._mark_dirty()
        return with_warnings(aiohttp.web.json_response(obj, status=201), warnings)

    def _establish(self, uid: str) -> None:
        where = self._uids.get(uid)
        if where is None:
            return  # deleted meanwhile
        key, ns, name = where
        crd = copy.deepcopy(self._store[key][(ns, name)])
        self._register_crd(crd)
        now = now_rfc3339()
        crd["status"] = {"acceptedNames": crd["spec"]["names"], "storedVersions": [
            v["name"] for v in crd["spec"]["versions"] if v.get("storage")], "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "lastTransitionTime": now}]}
        self._put(key, ns, crd, "MODIFIED")

    def _patch(self, request: rendering.Request, key: Key, kind: Kind, ns: str | None) -> aiohttp.web.Response:
        old = self._store[key].get((ns, request.name))
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        body = request.data
        if content_type == APPLY_PATCH:  # server-side apply (simplified: see the module docstring)
            if not request.params.get("fieldManager"):
                return error(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
                             "is required for apply patch")
            try:
                body = yaml.safe_load(request.text)
            except yaml.YAMLError as exc:
                return error(400, "BadRequest", f"error decoding YAML: {exc}")
            if not isinstance(body, dict) or body.get("kind") != kind.kind or \
                    body.get("apiVersion") != api_version(key):
                return error(400, "BadRequest", f"an apply patch must be a {api_version(key)} {kind.kind} object")
            if (body.get("metadata") or {}).get("name") not in (None, request.name):
                return error(400, "BadRequest", "the name of the object does not match the name on the URL")
            if old is None and request.subresource is None:
                return self._create(request, key, kind, ns, body={**body, "metadata": {
                    **(body.get("metadata") or {}), "name": request.name}})
        if old is None:
            return not_found(kind, request.name)
        if request.subresource not in (None, "status") or (request.subresource == "status"
                                                            and not kind.status_subresource):
            return error(404, "NotFound", f"no {request.subresource} subresource")
        try:
            if content_type == "application/merge-patch+json" or (
                    content_type == "application/strategic-merge-patch+json" and not kind.custom):
                if not isinstance(body, dict):
                    raise PatchError(400, "a merge patch must be a JSON object")
                wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
                if wanted_rv is not None and wanted_rv != old["metadata"]["resourceVersion"]:
                    return error(409, "Conflict", f'Operation cannot be fulfilled on {kind.kind.lower()}s "{request.name}": '
                                 "the object has been modified; please apply your changes to the latest version and try again")
                new = merge_patch(old, body)
            elif content_type == "application/json-patch+json":
                new = json_patch(old, body)
            elif content_type == APPLY_PATCH:
                new = merge_patch(old, body)
            else:
                return error(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted "
                             "media types include: application/json-patch+json, application/merge-patch+json, "
                             f"application/apply-patch+yaml{'' if kind.custom else ', application/strategic-merge-patch+json'}")
        except PatchError as exc:
            return error(exc.status, "Invalid" if exc.status == 422 else "BadRequest", str(exc))
        if not isinstance(new, dict):
            return error(422, "Invalid", "the patched object is not an object")
        if kind.status_subresource:
            if request.subresource == "status":
                status = new.get("status")
                new = copy.deepcopy(old)
                if status is None:
                    new.pop("status", None)
                else:
                    new["status"] = status
            elif "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        if meta.get("name", old_meta["name"]) != old_meta["name"]:
            return error(400, "BadRequest", f"the name of the object ({meta['name']}) does not match the name on "
                         f"the URL ({old_meta['name']})")
        if meta.get("namespace", old_meta.get("namespace")) != old_meta.get("namespace"):
            return error(400, "BadRequest", "the namespace of the provided object does not match the namespace sent "
                         "on the request")
        if meta.get("uid", old_meta["uid"]) != old_meta["uid"]:
            return invalid(kind, request.name, [("metadata.uid", f'Invalid value: "{meta["uid"]}": field is immutable')])
        for owned in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation",
                      "deletionTimestamp", "deletionGracePeriodSeconds"):
            if owned in old_meta:
                meta[owned] = old_meta[owned]
            else:
                meta.pop(owned, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        warnings = self._decode(request, kind, new)
        if isinstance(warnings, aiohttp.web.Response):
            return warnings
        if kind.custom and "generation" in old_meta and _spec_part(new) != _spec_part(old):
            meta["generation"] = old_meta["generation"] + 1
        if new == old:
            return with_warnings(aiohttp.web.json_response(old), warnings)  # a no-op: no new resourceVersion, no event
        causes = self._invalid(key, new, old)
        if causes:
            return invalid(kind, request.name, causes)
        escalating = self._escalation(kind, new)
        if escalating is not None:
            return escalating
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and key != NAMESPACES:
            return with_warnings(aiohttp.web.json_response(self._remove(key, ns, request.name)), warnings)
        if meta.get("ownerReferences") != old_meta.get("ownerReferences"):
            self._mark_dirty()
        return with_warnings(aiohttp.web.json_response(self._put(key, ns, new, "MODIFIED")), warnings)

    def _delete_request(self, request: rendering.Request, key: Key, kind: Kind,
                        ns: str | None) -> aiohttp.web.Response:
        obj = self._store[key].get((ns, request.name))
        if obj is None:
            return not_found(kind, request.name)
        options = request.data if isinstance(request.data, dict) else {}
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != obj["metadata"]["uid"]:
            return error(409, "Conflict", "the UID in the precondition does not match the object")
        if pre.get("resourceVersion") and pre["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            return error(409, "Conflict", "the resourceVersion in the precondition does not match the object")
        propagation = options.get("propagationPolicy") or request.params.get("propagationPolicy") or "Background"
        if options.get("orphanDependents") is True:
            propagation = "Orphan"
        return aiohttp.web.json_response(self._delete(key, ns, request.name, propagation=propagation))

    async def _watch(self, request: rendering.Request, key: Key, kind: Kind,
                     ns: str | None) -> AsyncIterator[Any]:
        params = request.params
        watcher = Watcher(key, ns, parse_label_selector(params.get("labelSelector")),
                          parse_field_selector(params.get("fieldSelector")), asyncio.Queue())
        since = params.get("resourceVersion")
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")
        timeout = int(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        if since in (None, "", "0"):
            initial = [{"type": "ADDED", "object": obj} for (ons, _), obj in self._store[key].items()
                       if watcher.matches(ons, obj)]
            last = self._rv
        elif int(since) < self._floor[key]:
            yield b""
            yield {"type": "ERROR", "object": {
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": 410,
                "reason": "Expired", "message": f"too old resource version: {since} ({self._floor[key]})"}}
            return
        else:
            initial = [event for rv, ons, event in self._log[key] if rv > int(since) and watcher.matches(ons, event["object"])]
            last = int(since)
        wid = id(watcher)
        self._watcher_objs[wid] = watcher
        self._watchers.add(wid)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            yield b""  # send the headers now, as a server does
            for event in initial:
                last = max(last, int(event["object"]["metadata"]["resourceVersion"]))
                yield event
            while True:
                wait = self.bookmark_interval if bookmarks else None
                if deadline is not None:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return
                    wait = remaining if wait is None else min(wait, remaining)
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and (deadline is None or loop.time() < deadline):
                        yield {"type": "BOOKMARK", "object": {"apiVersion": api_version(key), "kind": kind.kind,
                                                              "metadata": {"resourceVersion": str(last)}}}
                    continue
                if item is _DROP:
                    return
                last, event = item
                yield event
        finally:
            self._watchers.discard(wid)
            self._watcher_objs.pop(wid, None)

    # ------------------------------------------------------------------ test controls (call on the loop)

    def inject(self, *, method: str | None = None, path: str = ".*", status: int | None = 500,
               times: int | None = 1, delay: float = 0.0, delay_response: float = 0.0) -> Fault:
        fault = Fault(method and method.upper(), re.compile(path), status, times, delay, delay_response)
        self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self._faults.clear()

    def drop_watches(self) -> int:
        """End every open watch stream (as an API server restart or a load balancer would)."""
        for wid in list(self._watchers):
            self._watcher_objs[wid].queue.put_nowait(_DROP)
        return len(self._watchers)

    def compact(self) -> int:
        """Forget the event log: watches resuming from an older resourceVersion get 410 Expired."""
        for key in list(self._kinds):
            self._log[key].clear()
            self._floor[key] = self._rv
        return self._rv

    def unknown_field_warnings(self) -> list[tuple[str, str, str, str]]:
        """(User-Agent, method, path, warning) of every request whose unknown fields were pruned."""
        return list(self._warnings)

    def watch_count(self) -> int:
        return len(self._watchers)

    def request_log(self) -> list[tuple[str, str]]:
        return [(r.method.value, r.url.path_qs) for r in self._requests]

    def get(self, key: Key, ns: str | None, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self._store[key].get((ns, name)))


def jsonpath_values(obj: Any, path: str) -> list[Any]:
    """The subset of kubectl JSONPath that printer columns use: `.a.b`, `[n]`, `[?(@.k=="v")]`."""
    values = [obj]
    parts = re.findall(r'\.([A-Za-z0-9_]+)|\[\?\(@\.([A-Za-z0-9_]+)=="([^"]*)"\)\]|\[(\d+)\]', path)
    for field, fkey, fvalue, index in parts:
        nxt: list[Any] = []
        for v in values:
            if field and isinstance(v, dict) and field in v:
                nxt.append(v[field])
            elif fkey and isinstance(v, list):
                nxt.extend(item for item in v if isinstance(item, dict) and str(item.get(fkey)) == fvalue)
            elif index and isinstance(v, list) and int(index) < len(v):
                nxt.append(v[int(index)])
        values = nxt
    return values


def _age(timestamp: str) -> str:
    """A date cell as the API server prints it: the age, e.g. 42s, 5m, 3h, 2d."""
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def as_table(kind: Kind, objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Server-side printing (`Accept: ...;as=Table`), as the API server does for `kubectl get`: the
    name, then the CRD's additionalPrinterColumns (priority 0 shown by default, wide shows all)."""
    columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0}]
    columns += [{"name": c["name"], "type": c["type"], "priority": c.get("priority", 0)} for c in kind.printer_columns]
    if not kind.printer_columns:
        columns.append({"name": "Age", "type": "date", "priority": 0})
    rows = []
    for obj in objects:
        cells: list[Any] = [obj["metadata"]["name"]]
        paths = [c["jsonPath"] for c in kind.printer_columns] or [".metadata.creationTimestamp"]
        types = [c["type"] for c in kind.printer_columns] or ["date"]
        for path, type_ in zip(paths, types):
            found = jsonpath_values(obj, path)
            value = found[0] if found else None
            cells.append(_age(value) if type_ == "date" and value else value)
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                 "metadata": obj["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {}, "columnDefinitions": columns,
            "rows": rows}


def _integer_param_error(params: dict[str, str]) -> str | None:
    """A list/watch parameter the API server decodes with strconv.ParseInt (`timeoutSeconds=300.0` is a 400)."""
    for name in ("timeoutSeconds", "limit"):
        value = params.get(name)
        if value is not None and not re.fullmatch(r"[+-]?\d+", value):
            return f'strconv.ParseInt: parsing "{value}": invalid syntax'
    return None


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def with_warnings(response: aiohttp.web.Response, warnings: list[str]) -> aiohttp.web.Response:
    """`Warning: 299 - "..."` headers, as the API server adds them (kubectl prints them; clients may ignore them)."""
    for text in warnings:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
        response.headers.add("Warning", f'299 - "{escaped}"')
    return response


def error(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> aiohttp.web.Response:
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": code,
            "reason": reason, "message": message}
    if details:
        body["details"] = details
    return aiohttp.web.json_response(body, status=code)


def not_found(kind: Kind, name: str | None) -> aiohttp.web.Response:
    return error(404, "NotFound", f'{kind.kind.lower()}s "{name}" not found', {"name": name})


def invalid(kind: Kind, name: str, causes: list[tuple[str, str]]) -> aiohttp.web.Response:
    text = ", ".join(f"{field}: {message}" for field, message in causes)
    return error(422, "Invalid", f'{kind.kind} "{name}" is invalid: {text}',
                 {"name": name, "kind": kind.kind,
                  "causes": [{"reason": "FieldValueInvalid", "field": f, "message": m} for f, m in causes]})


# ---------------------------------------------------------------------------- running it

class ApiServerThread:
    """An ApiServer on its own event loop in a daemon thread; `call()` runs code on that loop."""

    def __init__(self, *, port: int = 0, **options: Any):
        self._port, self._options = port, options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="apiserver", daemon=True)
        self._error: BaseException | None = None
        self.server: ApiServer | None = None
        self.url = ""

    def start(self, timeout: float = 10.0) -> ApiServerThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the test API server did not start")
        if self._error is not None:
            raise RuntimeError("the test API server failed to start") from self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            self.server = ApiServer(**self._options)
            async with self.server, kmock.Server(self.server, port=self._port or None) as http:
                self.url = str(http.url).rstrip("/")
                self._loop = asyncio.get_running_loop()
                self._ready.set()
                await self._stop.wait()
                self.server.drop_watches()
                await asyncio.sleep(0.05)

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn(*args, **kwargs) on the server's loop (where its state lives) and return the result."""
        assert self._loop is not None

        async def run() -> Any:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": namespace}}],
        }))
        return path

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a Kubernetes API server for tests (kmock + harness)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for it here")
    parser.add_argument("--crd", type=Path, action="append", default=[], help="apply this CRD file at start")
    parser.add_argument("--bookmark-interval", type=float, default=30.0)
    parser.add_argument("--no-validate-builtins", action="store_true",
                        help="skip kubernetes-validate for built-in kinds (CRD schemas are still enforced)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    thread = ApiServerThread(port=args.port, bookmark_interval=args.bookmark_interval,
                             validate_builtins=not args.no_validate_builtins).start()
    from cluster import KubeClient

    for path in args.crd:
        for doc in opschema.load_yaml_all(path):
            KubeClient(thread.url).apply_crd(doc)
    if args.kubeconfig:
        thread.write_kubeconfig(args.kubeconfig)
    print(f"serving on {thread.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        thread.stop()


if __name__ == "__main__":
    main()
