"""The test API server's harness layer: every gap filled on top of kmock, checked over HTTP."""
from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Iterator

import opschema
import pytest
import yaml
from apiserver import ApiServerThread, json_patch, merge_patch, parse_label_selector
from cluster import (
    CONFIGMAPS,
    CRDS,
    NAMESPACES,
    PYTORCHJOBS,
    RLJOBS,
    ApiError,
    KubeClient,
    wait_until,
)
from realserver import make_server, real
from realserver import version as realserver_version
from rljob_operator.progress import ANNOTATION, decode_progress, encode_progress, patch_progress


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerThread]:
    """The stand-in; with RLJOB_TEST_KUBECONFIG the real server, for the test_row* cases, which state
    what a real kube-apiserver does (the other tests exercise the stand-in's own mechanics)."""
    thread = make_server(bookmark_interval=0.3, gc_delay=0.02)
    yield thread
    thread.stop()


@pytest.fixture(autouse=True)
def _rows_only_on_a_real_server(request: pytest.FixtureRequest) -> None:
    if real() and not request.node.name.startswith("test_row"):
        pytest.skip("tests the stand-in's own mechanics (only the test_row* cases also run on a real server)")


def needs_kubernetes(minor: int, why: str):
    """Skip on a real server older than 1.<minor> (the stand-in models current Kubernetes)."""
    def version() -> int:
        return int(json.loads(realserver_version())["minor"].rstrip("+")) if real() else 99

    return pytest.mark.skipif(real() and version() < minor, reason=f"needs Kubernetes 1.{minor}+: {why}")


@pytest.fixture(scope="module")
def kube(server: ApiServerThread) -> KubeClient:
    client = KubeClient(server.url)
    client.apply_crd(opschema.rljob_crd())
    client.apply_crd(opschema.pytorchjob_crd())
    return client


@pytest.fixture
def ns(kube: KubeClient) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create_namespace(name)
    return name


def rljob(name: str = "job", **spec_changes) -> dict:
    doc = yaml.safe_load((opschema.REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"].update(spec_changes)
    return doc


def configmap(name: str, owners: list[dict] | None = None, **meta) -> dict:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}, "data": {"k": "v"}}
    if owners:
        body["metadata"]["ownerReferences"] = [
            {"apiVersion": o["apiVersion"], "kind": o["kind"], "name": o["metadata"]["name"],
             "uid": o["metadata"]["uid"], "controller": i == 0} for i, o in enumerate(owners)]
    return body


# ---------------------------------------------------------------------------- discovery, CRDs, namespaces


def test_crd_creation_registers_and_deletion_removes_the_resource(server: ApiServerThread, kube: KubeClient,
                                                                  ns: str) -> None:
    crd = copy.deepcopy(opschema.rljob_crd())
    crd["metadata"]["name"] = "widgets.example.com"
    crd["spec"]["group"] = "example.com"
    crd["spec"]["names"].update(kind="Widget", listKind="WidgetList", plural="widgets", singular="widget",
                                shortNames=["wdg"])
    with pytest.raises(ApiError) as exc:
        kube.request("GET", "/apis/example.com/v1alpha1")
    assert exc.value.status == 404
    kube.apply_crd(crd)  # waits for Established (test_row05_*: not at once)
    established = kube.get(CRDS, None, "widgets.example.com")
    assert {"type": "Established", "status": "True"}.items() <= established["status"]["conditions"][-1].items()
    assert established["metadata"]["uid"]
    discovery = kube.request("GET", "/apis/example.com/v1alpha1")
    names = {r["name"]: r for r in discovery["resources"]}
    assert set(names) == {"widgets", "widgets/status"}
    assert names["widgets"]["kind"] == "Widget" and names["widgets"]["namespaced"] is True
    assert "example.com" in [g["name"] for g in kube.request("GET", "/apis")["groups"]]
    widgets = ("example.com", "v1alpha1", "widgets")
    kube.create(widgets, ns, {**rljob("w1"), "apiVersion": "example.com/v1alpha1", "kind": "Widget"})
    listing = kube.list(widgets, ns)
    assert listing["kind"] == "WidgetList" and listing["apiVersion"] == "example.com/v1alpha1"
    assert [w["metadata"]["name"] for w in listing["items"]] == ["w1"]
    assert listing["items"][0]["kind"] == "Widget"
    kube.delete(CRDS, None, "widgets.example.com")
    with pytest.raises(ApiError) as exc:
        kube.list(widgets, ns)
    assert exc.value.status == 404


def test_namespaces_list_get_watch_and_scope(server: ApiServerThread, kube: KubeClient) -> None:
    names = [n["metadata"]["name"] for n in kube.items(NAMESPACES)]
    assert {"default", "kube-system"} <= set(names)
    assert kube.list(NAMESPACES)["kind"] == "NamespaceList"
    name = f"t-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, name, configmap("cm"))
    assert exc.value.status == 404, "objects need an existing namespace"
    rv = kube.list(NAMESPACES)["metadata"]["resourceVersion"]
    kube.create_namespace(name)
    assert kube.get(NAMESPACES, None, name)["status"] == {"phase": "Active"}
    events = list(kube.watch(NAMESPACES, resourceVersion=rv, timeoutSeconds="1"))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", name)]
    kube.create(CONFIGMAPS, name, configmap("cm"))
    kube.delete(NAMESPACES, None, name)
    wait_until(lambda: kube.maybe_get(NAMESPACES, None, name) is None, what="the namespace gone")
    assert kube.items(CONFIGMAPS, name) == []


def test_server_owned_metadata(kube: KubeClient, ns: str) -> None:
    a = kube.create(CONFIGMAPS, ns, configmap("a", uid="mine", creationTimestamp="2000-01-01T00:00:00Z"))
    b = kube.create(CONFIGMAPS, ns, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "b-"}})
    assert a["metadata"]["uid"] != "mine" and len(a["metadata"]["uid"]) == 36
    assert int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"]) > 1
    assert a["metadata"]["creationTimestamp"].endswith("Z") and not a["metadata"]["creationTimestamp"].startswith("2000")
    assert b["metadata"]["name"].startswith("b-") and len(b["metadata"]["name"]) == 7
    job = kube.create(RLJOBS, ns, rljob())
    assert job["metadata"]["generation"] == 1 and "status" not in job
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, ns, configmap("a"))
    assert exc.value.status == 409 and exc.value.body["reason"] == "AlreadyExists"


# ---------------------------------------------------------------------------- validation


def test_creates_and_patches_are_validated_against_the_crd_schema(kube: KubeClient, ns: str) -> None:
    with pytest.raises(ApiError) as exc:  # a wrong type (unknown fields are pruned instead: test_row02_*)
        kube.create(RLJOBS, ns, rljob("bad", nnodes="two"))
    assert exc.value.status == 422
    assert any("nnodes" in c["field"] for c in exc.value.body["details"]["causes"])
    cel = rljob("cel", megatron={"tensorModelParallelSize": 3})
    with pytest.raises(ApiError) as exc:
        kube.create(RLJOBS, ns, cel)
    assert exc.value.status == 422 and "divisible" in exc.value.body["message"]
    kube.create(RLJOBS, ns, rljob("good"))
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "good", {"spec": {"nnodes": "two"}})
    assert exc.value.status == 422
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "good", {"status": {"trainer": {"step": "x"}}}, subresource="status")
    assert exc.value.status == 422
    ptj = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "p"},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {"containers": [
               {"name": "pytorch", "image": "x", "imagePullPolcy": "Always"}]}}}}}}
    with pytest.raises(ApiError) as exc:
        kube.create(PYTORCHJOBS, ns, ptj, fieldValidation="Strict")
    assert exc.value.status == 400 and "imagePullPolcy" in exc.value.body["message"]
    ptj["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    with pytest.raises(ApiError) as exc:
        kube.create(PYTORCHJOBS, ns, ptj)
    assert exc.value.status == 422 and "replicas" in exc.value.body["message"]


def test_transition_rules_see_old_self(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    crd = copy.deepcopy(opschema.rljob_crd())
    crd["metadata"]["name"] = "gadgets.example.com"
    crd["spec"]["group"] = "example.com"
    crd["spec"]["names"].update(kind="Gadget", listKind="GadgetList", plural="gadgets", singular="gadget")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["model"]["x-kubernetes-validations"] = [
        {"rule": "self.path == oldSelf.path", "message": "model.path is immutable"}]
    kube.apply_crd(crd)
    gadgets = ("example.com", "v1alpha1", "gadgets")
    kube.create(gadgets, ns, {**rljob("g"), "apiVersion": "example.com/v1alpha1", "kind": "Gadget"})
    with pytest.raises(ApiError) as exc:
        kube.patch(gadgets, ns, "g", {"spec": {"model": {"path": "/other"}}})
    assert exc.value.status == 422 and "immutable" in exc.value.body["message"]
    kube.patch(gadgets, ns, "g", {"spec": {"suspend": True}})
    kube.delete(CRDS, None, "gadgets.example.com")


# ---------------------------------------------------------------------------- status, generation, conflicts


def test_status_is_a_real_subresource_and_generation_tracks_the_spec(kube: KubeClient, ns: str) -> None:
    job = kube.create(RLJOBS, ns, rljob())
    rv0 = job["metadata"]["resourceVersion"]
    after = kube.patch(RLJOBS, ns, "job", {"status": {"observedGeneration": 7}})
    assert "status" not in after and after["metadata"]["resourceVersion"] == rv0, "status ignored, no-op"
    after = kube.patch(RLJOBS, ns, "job", {"status": {"observedGeneration": 1}, "spec": {"nnodes": 2}},
                       subresource="status")
    assert after["status"] == {"observedGeneration": 1} and after["spec"]["nnodes"] == 1
    assert after["metadata"]["generation"] == 1
    after = kube.patch(RLJOBS, ns, "job", {"metadata": {"annotations": {"a": "b"}}})
    assert after["metadata"]["generation"] == 1, "metadata changes do not bump the generation"
    after = kube.patch(RLJOBS, ns, "job", {"spec": {"suspend": True}})
    assert after["metadata"]["generation"] == 2 and after["status"] == {"observedGeneration": 1}
    after = kube.patch(RLJOBS, ns, "job", {"metadata": {"generation": 9, "creationTimestamp": "2000-01-01T00:00:00Z"}})
    assert after["metadata"]["generation"] == 2 and after["metadata"]["creationTimestamp"] == job["metadata"][
        "creationTimestamp"], "server-owned metadata is reset (name and uid changes are refused: test_row07_*)"


def test_resource_version_preconditions_and_json_patch_tests(kube: KubeClient, ns: str) -> None:
    job = kube.create(RLJOBS, ns, rljob())
    rv = job["metadata"]["resourceVersion"]
    fresh = kube.patch(RLJOBS, ns, "job", {"metadata": {"resourceVersion": rv}, "status": {"observedGeneration": 1}},
                       subresource="status")
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "job", {"metadata": {"resourceVersion": rv}, "status": {"observedGeneration": 2}},
                   subresource="status")
    assert exc.value.status == 409 and exc.value.body["reason"] == "Conflict"
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
           {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "job", ops, content_type="application/json-patch+json")
    assert exc.value.status == 422
    ops[0]["value"] = fresh["metadata"]["resourceVersion"]
    done = kube.patch(RLJOBS, ns, "job", ops, content_type="application/json-patch+json")
    assert done["metadata"]["finalizers"] == ["x"]
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "job", {"spec": {}}, content_type="application/x-unknown")
    assert exc.value.status == 415


def test_patch_helpers() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None, "d": 3}, "l": [2]}) == {
        "a": {"c": 2, "d": 3}, "l": [2]}
    doc = {"a": [1, 2], "b": {"c": 1}}
    assert json_patch(doc, [{"op": "add", "path": "/a/-", "value": 3}, {"op": "remove", "path": "/b/c"},
                            {"op": "move", "from": "/a", "path": "/z"}]) == {"b": {}, "z": [1, 2, 3]}
    select = parse_label_selector("app=x,tier!=db,env in (a, b),!legacy,team")
    assert select({"app": "x", "env": "a", "team": "t"})
    assert not select({"app": "x", "env": "c", "team": "t"})
    assert not select({"app": "x", "env": "a", "team": "t", "legacy": "1"})


# ---------------------------------------------------------------------------- deletion and garbage collection


def test_garbage_collection_follows_owner_references(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    owner = kube.create(RLJOBS, ns, rljob("owner"))
    other = kube.create(RLJOBS, ns, rljob("other"))
    kube.create(CONFIGMAPS, ns, configmap("child", [owner]))
    kube.create(CONFIGMAPS, ns, configmap("shared", [owner, other]))
    grandchild_owner = kube.get(CONFIGMAPS, ns, "child")
    kube.create(CONFIGMAPS, ns, configmap("grandchild", [grandchild_owner]))
    kube.create(CONFIGMAPS, ns, configmap("free"))
    kube.delete(RLJOBS, ns, "owner")
    wait_until(lambda: kube.maybe_get(CONFIGMAPS, ns, "grandchild") is None, what="cascading deletion")
    assert kube.maybe_get(CONFIGMAPS, ns, "child") is None
    shared = kube.get(CONFIGMAPS, ns, "shared")
    assert [r["name"] for r in shared["metadata"]["ownerReferences"]] == ["other"], "a live owner keeps it"
    assert kube.maybe_get(CONFIGMAPS, ns, "free") is not None
    kube.create(CONFIGMAPS, ns, configmap("orphan", [other]))
    kube.delete(RLJOBS, ns, "other", {"propagationPolicy": "Orphan"})
    wait_until(lambda: "ownerReferences" not in kube.get(CONFIGMAPS, ns, "orphan")["metadata"],
               what="orphaned dependent (the key goes, as on a real server: test_row11_*)")
    assert kube.maybe_get(CONFIGMAPS, ns, "shared") is not None


def test_dangling_owner_reference_is_collected(kube: KubeClient, ns: str) -> None:
    ghost = {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "ghost", "uid": "no-such-uid"}}
    kube.create(CONFIGMAPS, ns, configmap("dangling", [ghost]))
    wait_until(lambda: kube.maybe_get(CONFIGMAPS, ns, "dangling") is None, what="dangling dependent deleted")


def test_finalizers_delay_deletion(kube: KubeClient, ns: str) -> None:
    kube.create(CONFIGMAPS, ns, configmap("held", finalizers=["example.com/hold"]))
    deleted = kube.delete(CONFIGMAPS, ns, "held")
    assert deleted["metadata"]["deletionTimestamp"]
    assert kube.get(CONFIGMAPS, ns, "held")["metadata"]["deletionTimestamp"]
    kube.patch(CONFIGMAPS, ns, "held", {"metadata": {"finalizers": None}})
    assert kube.maybe_get(CONFIGMAPS, ns, "held") is None
    with pytest.raises(ApiError) as exc:
        kube.delete(CONFIGMAPS, ns, "held")
    assert exc.value.status == 404


# ---------------------------------------------------------------------------- watches


def test_watch_replays_from_resource_version_and_expires_after_compaction(server: ApiServerThread,
                                                                        kube: KubeClient, ns: str) -> None:
    rv = kube.list(CONFIGMAPS, ns)["metadata"]["resourceVersion"]
    kube.create(CONFIGMAPS, ns, configmap("w1"))
    kube.patch(CONFIGMAPS, ns, "w1", {"data": {"k": "v2"}})
    kube.delete(CONFIGMAPS, ns, "w1")
    events = list(kube.watch(CONFIGMAPS, ns, resourceVersion=rv, timeoutSeconds="1"))
    assert [e["type"] for e in events if e["type"] != "BOOKMARK"] == ["ADDED", "MODIFIED", "DELETED"]
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events if e["type"] != "BOOKMARK"]
    assert rvs == sorted(rvs) and rvs[0] > int(rv)
    server.call(server.server.compact)
    events = list(kube.watch(CONFIGMAPS, ns, resourceVersion=rv, timeoutSeconds="1"))
    assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410


def test_watch_initial_state_selectors_bookmarks_and_timeout(kube: KubeClient, ns: str) -> None:
    kube.create(CONFIGMAPS, ns, configmap("mine", labels={"app": "x"}))
    kube.create(CONFIGMAPS, ns, configmap("theirs", labels={"app": "y"}))
    assert [c["metadata"]["name"] for c in kube.items(CONFIGMAPS, ns, labelSelector="app=x")] == ["mine"]
    assert [c["metadata"]["name"] for c in kube.items(CONFIGMAPS, ns, fieldSelector="metadata.name=theirs")] == [
        "theirs"]
    started = time.monotonic()
    events = list(kube.watch(CONFIGMAPS, ns, labelSelector="app=x", allowWatchBookmarks="true", timeoutSeconds="1",
                             timeout=30))  # a server that ignored timeoutSeconds: the stream ends after 30 s quiet
    assert 0.9 < time.monotonic() - started < 15, "the server ends the stream after timeoutSeconds"
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events if e["type"] != "BOOKMARK"] == [
        ("ADDED", "mine")]
    bookmarks = [e for e in events if e["type"] == "BOOKMARK"]
    assert bookmarks and int(bookmarks[-1]["object"]["metadata"]["resourceVersion"]) > 0


def test_dropped_watches_end(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    import threading

    got: list[list[dict]] = []
    t = threading.Thread(target=lambda: got.append(list(kube.watch(CONFIGMAPS, ns, timeout=10))))
    t.start()
    wait_until(lambda: server.call(server.server.watch_count) >= 1, what="watch registered")
    assert server.call(server.server.drop_watches) >= 1
    t.join(timeout=5)
    assert not t.is_alive() and got == [[]]


# ---------------------------------------------------------------------------- faults


def test_injected_faults(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    fault = server.call(server.server.inject, method="POST", path=f"/namespaces/{ns}/configmaps$", status=503,
                        times=1)
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, ns, configmap("f"))
    assert exc.value.status == 503
    kube.create(CONFIGMAPS, ns, configmap("f"))
    assert fault.hits == 1
    server.call(server.server.inject, method="GET", path=f"/namespaces/{ns}/configmaps/f$", status=None,
                delay_response=0.5)
    started = time.monotonic()
    assert kube.get(CONFIGMAPS, ns, "f")["metadata"]["name"] == "f"
    assert time.monotonic() - started >= 0.45
    server.call(server.server.clear_faults)


# ---------------------------------------------------------------------------- the worker's progress report


def test_worker_progress_patch_over_http(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    kube.create(RLJOBS, ns, rljob("reporting"))
    value = encode_progress(3, total_steps=10, reward_mean=0.5)
    patch_progress(value, name="reporting", namespace=ns, api_base=server.url, token="t")
    stored = kube.get(RLJOBS, ns, "reporting")
    assert decode_progress(stored["metadata"]["annotations"][ANNOTATION])["progressPercentage"] == 30
    assert stored["metadata"]["generation"] == 1


# ---------------------------------------------------------------------------- like a real kube-apiserver
# One test per row of the differences a real kube-apiserver (1.20 and 1.36) showed (issue 20).


def test_row01_watch_timeout_must_be_an_integer(kube: KubeClient, ns: str) -> None:
    for params in ({"timeoutSeconds": "300.0"}, {"timeoutSeconds": "1.5"}, {"limit": "2.0"}):
        for watch in ("true", None):
            with pytest.raises(ApiError) as exc:
                kube.list(CONFIGMAPS, ns, **params, **({"watch": watch} if watch else {}))
            assert exc.value.status == 400 and exc.value.body["reason"] == "BadRequest"
            value = next(iter(params.values()))
            assert exc.value.body["message"] == f'strconv.ParseInt: parsing "{value}": invalid syntax'
    assert list(kube.watch(CONFIGMAPS, ns, timeoutSeconds="1")) == []


def _raw(server: ApiServerThread, method: str, path: str, body: dict | None = None, *,
         content_type: str = "application/json", data: bytes | None = None) -> tuple[int, dict, list[str]]:
    """(status, JSON body, Warning headers) of one request."""
    import json
    import urllib.error
    import urllib.request

    raw = data if data is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(server.url + path, data=raw, method=method, headers={"Content-Type": content_type})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get_all("Warning") or []
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers.get_all("Warning") or []


@needs_kubernetes(25, "server-side field validation (the Warning header, fieldValidation)")
def test_row02_unknown_fields_are_pruned_with_a_warning(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    job = rljob("pruned")
    job["spec"]["bogus"] = True
    job["spec"]["training"]["lrr"] = 0.1
    status, body, warnings = _raw(server, "POST", f"/apis/rljob.dev/v1alpha1/namespaces/{ns}/rljobs", job)
    assert status == 201 and "bogus" not in body["spec"] and "lrr" not in body["spec"]["training"]
    assert sorted(warnings) == ['299 - "unknown field \\"spec.bogus\\""', '299 - "unknown field \\"spec.training.lrr\\""']
    assert "bogus" not in kube.get(RLJOBS, ns, "pruned")["spec"]
    # Patches and the status subresource alike; built-in kinds by their Go types.
    status, body, warnings = _raw(server, "PATCH", f"/apis/rljob.dev/v1alpha1/namespaces/{ns}/rljobs/pruned/status",
                                  {"status": {"observedGeneration": 1, "phase": "Running"}},
                                  content_type="application/merge-patch+json")
    assert status == 200 and body["status"] == {"observedGeneration": 1}
    assert warnings == ['299 - "unknown field \\"status.phase\\""']
    status, body, warnings = _raw(server, "POST", f"/api/v1/namespaces/{ns}/configmaps", {
        **configmap("cm-pruned"), "bogus": 1})
    assert status == 201 and "bogus" not in body and warnings == ['299 - "unknown field \\"bogus\\""']
    # fieldValidation=Ignore: pruned without a warning.
    status, body, warnings = _raw(server, "POST", f"/api/v1/namespaces/{ns}/configmaps?fieldValidation=Ignore", {
        **configmap("cm-quiet"), "bogus": 1})
    assert status == 201 and "bogus" not in body and warnings == []
    assert ("PATCH", f"/apis/rljob.dev/v1alpha1/namespaces/{ns}/rljobs/pruned/status", 'unknown field "status.phase"') \
        in [w[1:] for w in server.call(server.server.unknown_field_warnings)]  # (the stand-in's record)


@needs_kubernetes(25, "server-side field validation (fieldValidation=Strict)")
def test_row03_unknown_fields_with_strict_field_validation_are_400(kube: KubeClient, ns: str) -> None:
    job = rljob("strict")
    job["spec"]["bogus"] = True
    with pytest.raises(ApiError) as exc:
        kube.create(RLJOBS, ns, job, fieldValidation="Strict")
    assert exc.value.status == 400 and exc.value.body["reason"] == "BadRequest"
    assert exc.value.body["message"] == 'strict decoding error: unknown field "spec.bogus"'
    assert kube.maybe_get(RLJOBS, ns, "strict") is None
    kube.create(RLJOBS, ns, rljob("strict"))
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "strict", {"spec": {"bogus": 1}}, fieldValidation="Strict")
    assert exc.value.status == 400


def test_row04_a_wrong_json_type_in_a_builtin_is_400(kube: KubeClient, ns: str) -> None:
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, ns, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "n"},
                                     "data": {"k": 1}})
    assert exc.value.status == 400 and "cannot be handled as a ConfigMap" in exc.value.body["message"]
    with pytest.raises(ApiError) as exc:  # a custom resource's wrong type is a validation error (422)
        kube.create(RLJOBS, ns, rljob("typed", nnodes="two"))
    assert exc.value.status == 422


def test_row05_a_new_crd_is_served_a_moment_later(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    crd = copy.deepcopy(opschema.rljob_crd())
    crd["metadata"]["name"] = "slowpokes.example.com"
    crd["spec"]["group"] = "example.com"
    crd["spec"]["names"].update(kind="Slowpoke", listKind="SlowpokeList", plural="slowpokes", singular="slowpoke")
    crd["spec"]["names"].pop("shortNames", None)
    crd["spec"]["names"].pop("categories", None)
    if not real():
        server.call(setattr, server.server, "crd_establish_delay", 0.5)
    try:
        created = kube.create(CRDS, None, crd)
        assert created["status"]["conditions"] is None
        if not real():  # a real server's gap is too short to hit reliably
            with pytest.raises(ApiError) as exc:
                kube.list(("example.com", "v1alpha1", "slowpokes"), ns)
            assert exc.value.status == 404
        kube.apply_crd(crd)  # waits for Established
        assert kube.list(("example.com", "v1alpha1", "slowpokes"), ns)["items"] == []
        conds = {c["type"]: c["status"] for c in kube.get(CRDS, None, "slowpokes.example.com")["status"]["conditions"]}
        assert conds == {"NamesAccepted": "True", "Established": "True"}
    finally:
        if not real():
            server.call(setattr, server.server, "crd_establish_delay", 0.05)
        kube.delete(CRDS, None, "slowpokes.example.com")


def test_row06_create_with_a_resource_version_is_500(kube: KubeClient, ns: str) -> None:
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, ns, configmap("rv", resourceVersion="5"))
    assert exc.value.status == 500
    assert exc.value.body["message"] == "resourceVersion should not be set on objects to be created"


def test_row07_patching_name_is_400_and_uid_is_422(kube: KubeClient, ns: str) -> None:
    job = kube.create(RLJOBS, ns, rljob("named"))
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "named", {"metadata": {"name": "other"}})
    assert exc.value.status == 400 and "does not match the name on the URL" in exc.value.body["message"]
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "named", {"metadata": {"uid": "x"}})
    assert exc.value.status == 422 and "field is immutable" in exc.value.body["message"]
    assert kube.get(RLJOBS, ns, "named")["metadata"]["uid"] == job["metadata"]["uid"]


def test_row08_server_side_apply(kube: KubeClient, ns: str) -> None:
    import json

    apply = "application/apply-patch+yaml"
    cm = configmap("applied")
    with pytest.raises(ApiError) as exc:
        kube.patch(CONFIGMAPS, ns, "applied", cm, content_type=apply)
    assert exc.value.status == 422 and "fieldManager" in exc.value.body["message"]
    body = yaml.safe_dump(cm).encode()  # YAML, as kubectl apply --server-side sends it
    import urllib.request

    def send(data: bytes) -> dict:
        req = urllib.request.Request(f"{kube.base_url}/api/v1/namespaces/{ns}/configmaps/applied?fieldManager=test",
                                     data=data, method="PATCH", headers={"Content-Type": apply})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10) as resp:
            assert resp.status in (200, 201)
            return json.loads(resp.read())

    assert send(body)["data"] == {"k": "v"}, "apply creates an absent object"
    cm["data"] = {"k": "v2", "extra": "1"}  # (not the key "n": a YAML 1.1 boolean to the server's parser)
    assert send(yaml.safe_dump(cm).encode())["data"] == {"k": "v2", "extra": "1"}
    assert kube.get(CONFIGMAPS, ns, "applied")["data"] == {"k": "v2", "extra": "1"}


def test_row09_strategic_merge_patch_on_a_custom_resource_is_415(kube: KubeClient, ns: str) -> None:
    kube.create(RLJOBS, ns, rljob("smp"))
    with pytest.raises(ApiError) as exc:
        kube.patch(RLJOBS, ns, "smp", {"spec": {"suspend": True}}, content_type="application/strategic-merge-patch+json")
    assert exc.value.status == 415
    kube.create(CONFIGMAPS, ns, configmap("smp"))
    done = kube.patch(CONFIGMAPS, ns, "smp", {"data": {"k": "w"}}, content_type="application/strategic-merge-patch+json")
    assert done["data"] == {"k": "w"}, "built-in kinds take strategic merge patches"


def test_row10_garbage_collection_is_a_controller_not_the_server(kube: KubeClient, ns: str) -> None:
    """Without kube-controller-manager a real server collects nothing; with it, dependents go afterwards."""
    if real():
        pytest.skip("starts a stand-in without controllers (the real server's own controllers are under test in "
                    "test_row11/12 and the operator's deletion test)")
    bare = ApiServerThread(controllers=False).start()
    try:
        client = KubeClient(bare.url)
        client.apply_crd(opschema.rljob_crd())
        client.create_namespace("gc")
        owner = client.create(RLJOBS, "gc", rljob("owner"))
        client.create(CONFIGMAPS, "gc", configmap("child", [owner]))
        client.delete(RLJOBS, "gc", "owner")
        time.sleep(0.5)
        assert client.maybe_get(CONFIGMAPS, "gc", "child") is not None, "no controller, no garbage collection"
        client.delete(NAMESPACES, None, "gc")
        time.sleep(0.3)
        assert client.get(NAMESPACES, None, "gc")["status"]["phase"] == "Terminating"
    finally:
        bare.stop()
    owner = kube.create(RLJOBS, ns, rljob("owner"))
    kube.create(CONFIGMAPS, ns, configmap("child", [owner]))
    kube.delete(RLJOBS, ns, "owner")
    assert kube.maybe_get(CONFIGMAPS, ns, "child") is not None, "not in the DELETE's own response time"
    wait_until(lambda: kube.maybe_get(CONFIGMAPS, ns, "child") is None, what="the controller's collection")


def test_row11_orphaned_dependents_lose_the_owner_references_key(kube: KubeClient, ns: str) -> None:
    owner = kube.create(RLJOBS, ns, rljob("parent"))
    kube.create(CONFIGMAPS, ns, configmap("kept", [owner]))
    deleted = kube.delete(RLJOBS, ns, "parent", {"propagationPolicy": "Orphan"})
    assert "orphan" in deleted["metadata"]["finalizers"] and deleted["metadata"]["deletionTimestamp"]
    wait_until(lambda: kube.maybe_get(RLJOBS, ns, "parent") is None, what="the owner gone after orphaning")
    assert "ownerReferences" not in kube.get(CONFIGMAPS, ns, "kept")["metadata"]


def test_row12_namespace_deletion_is_asynchronous(server: ApiServerThread, kube: KubeClient) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.create_namespace(name)
    assert kube.get(NAMESPACES, None, name)["spec"] == {"finalizers": ["kubernetes"]}
    kube.create(CONFIGMAPS, name, configmap("held", finalizers=["example.com/hold"]))
    deleted = kube.delete(NAMESPACES, None, name)
    assert deleted["status"]["phase"] == "Terminating" and deleted["metadata"]["deletionTimestamp"]
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, name, configmap("late"))
    assert exc.value.status == 403 and "being terminated" in exc.value.body["message"]
    wait_until(lambda: kube.get(CONFIGMAPS, name, "held")["metadata"].get("deletionTimestamp"),
               what="the contents being deleted")
    time.sleep(0.3)
    assert kube.get(NAMESPACES, None, name)["status"]["phase"] == "Terminating", "held by its content's finalizer"
    kube.patch(CONFIGMAPS, name, "held", {"metadata": {"finalizers": None}})
    # (a real namespace controller re-checks a namespace with content left after a backoff)
    wait_until(lambda: kube.maybe_get(NAMESPACES, None, name) is None, timeout=90, what="the namespace gone")


def test_row14_annotations_over_256k_are_refused(kube: KubeClient, ns: str) -> None:
    big = configmap("big", annotations={"kubectl.kubernetes.io/last-applied-configuration": "x" * (256 * 1024)})
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, ns, big)
    assert exc.value.status == 422
    assert "metadata.annotations: Too long: must have at most 262144 bytes" in exc.value.body["message"]


@needs_kubernetes(25, "CEL validation rules (x-kubernetes-validations)")
def test_row15_cel_rules_are_not_checked_after_a_schema_error(kube: KubeClient, ns: str) -> None:
    with pytest.raises(ApiError) as exc:
        kube.create(RLJOBS, ns, rljob("both", nnodes="two", megatron={"tensorModelParallelSize": 3}))
    causes = exc.value.body["details"]["causes"]
    assert exc.value.status == 422 and any(c["field"] == "spec.nnodes" for c in causes)
    assert {"field": "<nil>", "message": "some validation rules were not checked because the object was invalid; "
            "correct the existing errors to complete validation"}.items() <= causes[-1].items()
    assert not any("divisible" in c["message"] for c in causes)


def test_row13_authentication_rbac_and_escalation_prevention() -> None:
    from kube_rbac import User

    if real():
        pytest.skip("starts a stand-in with its own tokens (the real server's RBAC: tests/chart, e2e/README.md)")
    server = ApiServerThread(tokens={"admin-token": User("admin", ("system:masters",)),
                                     "alice-token": User("alice", ("system:authenticated",))}).start()
    try:
        admin, alice = KubeClient(server.url, token="admin-token"), KubeClient(server.url, token="alice-token")
        for client in (KubeClient(server.url), KubeClient(server.url, token="wrong")):
            with pytest.raises(ApiError) as exc:
                client.items(NAMESPACES)
            assert exc.value.status == 401 and exc.value.body["reason"] == "Unauthorized"
        admin.apply_crd(opschema.rljob_crd())
        for name in ("a", "b"):
            admin.create_namespace(name)
            admin.create(CONFIGMAPS, name, configmap("cm"))
        rbac = ("rbac.authorization.k8s.io", "v1")
        admin.create((*rbac, "roles"), "a", {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                                             "metadata": {"name": "alice"}, "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]},
            {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
             "verbs": ["create"]}]})
        admin.create((*rbac, "rolebindings"), "a", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "alice"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "alice"},
            "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]})
        assert alice.get(CONFIGMAPS, "a", "cm")["data"] == {"k": "v"}
        for call in (lambda: alice.get(CONFIGMAPS, "b", "cm"), lambda: alice.create(CONFIGMAPS, "a", configmap("x")),
                     lambda: alice.items(RLJOBS, "a")):
            with pytest.raises(ApiError) as exc:
                call()
            assert exc.value.status == 403 and 'User "alice" cannot' in exc.value.body["message"]
        # Escalation prevention: a Role may grant only what its author holds.
        progress = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "progress"},
                    "rules": [{"apiGroups": ["rljob.dev"], "resources": ["rljobs"], "resourceNames": ["job"],
                               "verbs": ["get", "patch"]}]}
        with pytest.raises(ApiError) as exc:
            alice.create((*rbac, "roles"), "a", progress)
        assert exc.value.status == 403 and "attempting to grant RBAC permissions not currently held" in \
            exc.value.body["message"]
        admin.patch((*rbac, "roles"), "a", "alice", {"rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]},
            {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": ["create"]},
            {"apiGroups": ["rljob.dev"], "resources": ["rljobs"], "verbs": ["get", "patch"]}]})
        alice.create((*rbac, "roles"), "a", progress)
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "b"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
                   "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": "a"}]}
        with pytest.raises(ApiError) as exc:  # a binding to a role she does not hold (here: not even there)
            alice.create((*rbac, "rolebindings"), "a", binding)
        assert exc.value.status == 403
        binding["roleRef"] = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "progress"}
        alice.create((*rbac, "rolebindings"), "a", binding)
    finally:
        server.stop()
