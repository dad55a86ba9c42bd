"""The test API server's harness layer: every gap filled on top of kmock, checked over HTTP."""
from __future__ import annotations

import copy
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
from rljob_operator.progress import ANNOTATION, decode_progress, encode_progress, patch_progress


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerThread]:
    thread = ApiServerThread(bookmark_interval=0.3, gc_delay=0.02).start()
    yield thread
    thread.stop()


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
    created = kube.create(CRDS, None, crd)
    established = kube.get(CRDS, None, "widgets.example.com")
    assert {"type": "Established", "status": "True"}.items() <= established["status"]["conditions"][0].items()
    assert created["metadata"]["uid"]
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
    assert kube.items(CONFIGMAPS, name) == []


def test_server_owned_metadata(kube: KubeClient, ns: str) -> None:
    a = kube.create(CONFIGMAPS, ns, configmap("a", uid="mine", resourceVersion="1"))
    b = kube.create(CONFIGMAPS, ns, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "b-"}})
    assert a["metadata"]["uid"] != "mine" and len(a["metadata"]["uid"]) == 36
    assert int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"]) > 1
    assert a["metadata"]["creationTimestamp"].endswith("Z")
    assert b["metadata"]["name"].startswith("b-") and len(b["metadata"]["name"]) == 7
    job = kube.create(RLJOBS, ns, rljob())
    assert job["metadata"]["generation"] == 1 and "status" not in job
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, ns, configmap("a"))
    assert exc.value.status == 409 and exc.value.body["reason"] == "AlreadyExists"


# ---------------------------------------------------------------------------- validation


def test_creates_and_patches_are_validated_against_the_crd_schema(kube: KubeClient, ns: str) -> None:
    bad = rljob("bad")
    bad["spec"]["bogus"] = True
    with pytest.raises(ApiError) as exc:
        kube.create(RLJOBS, ns, bad)
    assert exc.value.status == 422
    assert any("bogus" in c["message"] for c in exc.value.body["details"]["causes"])
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
        kube.create(PYTORCHJOBS, ns, ptj)
    assert exc.value.status == 422 and "imagePullPolcy" in exc.value.body["message"]
    with pytest.raises(ApiError) as exc:
        kube.create(CONFIGMAPS, ns, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "n"},
                                     "data": {"k": 1}})
    assert exc.value.status == 422


def test_transition_rules_see_old_self(server: ApiServerThread, kube: KubeClient, ns: str) -> None:
    crd = copy.deepcopy(opschema.rljob_crd())
    crd["metadata"]["name"] = "gadgets.example.com"
    crd["spec"]["group"] = "example.com"
    crd["spec"]["names"].update(kind="Gadget", listKind="GadgetList", plural="gadgets", singular="gadget")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["model"]["x-kubernetes-validations"] = [
        {"rule": "self.path == oldSelf.path", "message": "model.path is immutable"}]
    kube.create(CRDS, None, crd)
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
    after = kube.patch(RLJOBS, ns, "job", {"metadata": {"uid": "x", "generation": 9, "name": "other"}})
    assert after["metadata"]["name"] == "job" and after["metadata"]["generation"] == 2
    assert after["metadata"]["uid"] == job["metadata"]["uid"]


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
        kube.patch(RLJOBS, ns, "job", {"spec": {}}, content_type="application/apply-patch+yaml")
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
    wait_until(lambda: kube.get(CONFIGMAPS, ns, "orphan")["metadata"].get("ownerReferences") == [],
               what="orphaned dependent")
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
    events = list(kube.watch(CONFIGMAPS, ns, labelSelector="app=x", allowWatchBookmarks="true", timeoutSeconds="1"))
    assert 0.9 < time.monotonic() - started < 3, "the server ends the stream after timeoutSeconds"
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
