"""kube_io against the test API server over HTTP: idempotent creates, guarded writes, retries, timeouts."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import opschema
import pytest
import yaml
from apiserver import ApiServerThread
from cluster import CONFIGMAPS, RLJOBS, KubeClient
from kubernetes import client as k8s_client
from rljob_operator import kube_io
from rljob_operator.reconcile import ChildRef
from rljob_operator.settings import OperatorSettings


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerThread]:
    from realserver import make_server

    thread = make_server()
    KubeClient(thread.url).apply_crd(opschema.rljob_crd())
    yield thread
    thread.stop()


@pytest.fixture
def ns(server: ApiServerThread) -> str:
    name = f"io-{uuid.uuid4().hex[:8]}"
    KubeClient(server.url).create_namespace(name)
    return name


def make_api(server: ApiServerThread, errors: list, timeout: float = 2.0) -> kube_io.KubeApi:
    configuration = k8s_client.Configuration()
    configuration.host = server.url
    return kube_io.KubeApi(OperatorSettings(api_timeout_seconds=timeout, api_concurrency=4),
                           on_error=lambda verb, status: errors.append((verb, status)), configuration=configuration)


def configmap(ns: str, name: str = "cm") -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns}, "data": {"a": "b"}}


def test_create_is_idempotent_and_get_reads_none_for_absent(server: ApiServerThread, ns: str) -> None:
    errors: list = []
    api = make_api(server, errors)

    async def go():
        assert await api.create(configmap(ns)) is True
        assert await api.create(configmap(ns)) is False  # 409: already there
        assert (await api.get("v1", "ConfigMap", ns, "cm"))["data"] == {"a": "b"}
        assert await api.get("v1", "ConfigMap", ns, "absent") is None
        assert await api.delete(ChildRef("v1", "ConfigMap", ns, "cm")) is True
        assert await api.delete(ChildRef("v1", "ConfigMap", ns, "cm")) is False

    asyncio.run(go())
    api.close()
    assert errors == []


def test_status_writes_are_guarded_by_resource_version(server: ApiServerThread, ns: str) -> None:
    doc = yaml.safe_load((opschema.REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"] = {"name": "guarded"}
    KubeClient(server.url).create(RLJOBS, ns, doc)
    api = make_api(server, [])

    async def go():
        body = await api.get_rljob(ns, "guarded")
        await api.write_status(body, {"observedGeneration": 1, "pytorchJobName": "guarded"})
        with pytest.raises(kube_io.Conflict):  # `body` is stale now
            await api.write_status(body, {"observedGeneration": 1})
        fresh = await api.get_rljob(ns, "guarded")
        await api.write_status(fresh, {"observedGeneration": 1})  # the removed key becomes null in the patch
        return await api.get_rljob(ns, "guarded")

    final = asyncio.run(go())
    api.close()
    assert final["status"] == {"observedGeneration": 1}


def test_transient_errors_and_timeouts_are_retried(server: ApiServerThread, ns: str) -> None:
    errors: list = []
    api = make_api(server, errors, timeout=0.5)
    server.call(server.server.inject, method="POST", path=f"/namespaces/{ns}/configmaps$", status=503, times=2)
    server.call(server.server.inject, method="GET", path=f"/namespaces/{ns}/configmaps/cm$", status=None,
                delay=1.5, times=1)

    async def go():
        assert await api.create(configmap(ns)) is True
        started = time.monotonic()
        assert (await api.get("v1", "ConfigMap", ns, "cm"))["metadata"]["name"] == "cm"
        return time.monotonic() - started

    waited = asyncio.run(go())
    api.close()
    assert errors[:2] == [("create", 503), ("create", 503)]
    assert ("get", 0) in errors, "the hung read timed out (no response) and was retried"
    assert waited < 3


def test_persistent_errors_raise_after_bounded_retries(server: ApiServerThread, ns: str) -> None:
    errors: list = []
    api = make_api(server, errors)
    server.call(server.server.inject, method="POST", path=f"/namespaces/{ns}/configmaps$", status=500, times=None)
    try:
        with pytest.raises(kube_io.ApiError) as exc:
            asyncio.run(api.create(configmap(ns)))
        assert exc.value.status == 500 and exc.value.transient
        assert len(errors) == len(kube_io.RETRY_DELAYS) + 1
        server.call(server.server.clear_faults)
        server.call(server.server.inject, method="POST", path=f"/namespaces/{ns}/configmaps$", status=403, times=1)
        with pytest.raises(kube_io.ApiError) as exc:
            asyncio.run(api.create(configmap(ns, "other")))
        assert exc.value.status == 403 and not exc.value.transient  # not retried in the call
    finally:
        server.call(server.server.clear_faults)
        api.close()
    assert KubeClient(server.url).items(CONFIGMAPS, ns) == []


def test_merge_diff() -> None:
    assert kube_io.merge_diff({"a": 1, "b": {"c": 1, "d": 2}, "l": [1]}, {"b": {"c": 1, "d": 3}, "l": [1], "e": 0}) == {
        "a": None, "b": {"d": 3}, "e": 0}


def test_events_are_valid_core_v1_events() -> None:
    from rljob_operator.reconcile import Event

    body = {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob",
            "metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "resourceVersion": "5"}}
    event = kube_io.build_event(body, Event("Warning", "InvalidSpec", "x" * 5000), "operator-0")
    assert opschema.builtin_errors(event) == []
    assert event["involvedObject"] == {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "name": "j",
                                       "namespace": "ns", "uid": "u-1", "resourceVersion": "5"}
    assert len(event["message"]) == 1024 and event["metadata"]["generateName"] == "j."


def test_events_are_posted_in_the_background(server: ApiServerThread, ns: str) -> None:
    from rljob_operator.reconcile import Event

    api = make_api(server, [])
    body = {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "j", "namespace": ns}}

    async def go():
        api.post_event(body, Event("Normal", "Created", "Created PyTorchJob j."))
        await api.drain_events()

    asyncio.run(go())
    api.close()
    events = KubeClient(server.url).events_for(ns, "j")
    assert [(e["type"], e["reason"], e["source"]) for e in events] == [
        ("Normal", "Created", {"component": "rljob-operator"})]


def test_a_create_of_a_kind_whose_crd_is_missing_names_what_to_install(server: ApiServerThread, ns: str) -> None:
    """No training-operator on the cluster: the create's error (which becomes the CreateFailed condition)
    says what to install instead of 'the server could not find the requested resource'; once the CRD is
    there the same create succeeds."""
    from realserver import real

    if real():
        pytest.skip("stand-in only: needs a server without the PyTorchJob CRD, and on a shared real server the "
                    "operator suite installs it (CRDs outlive the test modules)")
    doc = yaml.safe_load((opschema.REPO / "examples" / "quickstart.yaml").read_text())
    from rljob_api.validation import parse_rljob
    from rljob_operator import builders

    job = parse_rljob({**doc, "metadata": {"name": "nocrd", "namespace": ns, "uid": "u-1"}})
    ptj = builders.build_pytorchjob(job, OperatorSettings())
    ptj["metadata"].pop("ownerReferences", None)
    api = make_api(server, [])

    async def create():
        return await api.create(ptj)

    with pytest.raises(kube_io.ApiError) as caught:
        asyncio.run(create())
    text = str(caught.value)
    assert "kubeflow.org/v1 PyTorchJob is not served" in text and "training-operator" in text, text
    assert "spec.childKind: JobSet" in text and not caught.value.namespace_gone
    KubeClient(server.url).apply_crd(opschema.pytorchjob_crd())
    assert asyncio.run(create()) is True
    api.close()


def test_workloads_read_as_unknown_with_one_log_line_where_kueue_is_absent(
        server: ApiServerThread, ns: str, caplog: pytest.LogCaptureFixture) -> None:
    """Without Kueue's Workload CRD there are no Workloads to read: it says so once in its log, and the 404
    is kept (observe's kueue_missing), so the reconcile can say that Kueue is not installed."""
    from realserver import real

    if real():
        pytest.skip("stand-in only: needs a server without the Workload CRD, and on a shared real server the "
                    "operator suite installs it (CRDs outlive the test modules)")
    api = make_api(server, [])

    async def go():
        return [await api.list_workloads(ns) for _ in range(3)]

    with caplog.at_level("WARNING", logger="rljob_operator.kube_io"):
        assert asyncio.run(go()) == [None, None, None]
    assert api.kueue_missing, "a 404 says the Workload API is not served (observe passes it on as kueue_missing)"
    api.close()
    lines = [r.getMessage() for r in caplog.records if "workloads.kueue.x-k8s.io" in r.getMessage()]
    assert len(lines) == 1 and "is not installed" in lines[0], lines


def test_observe_reads_both_child_kinds_and_the_workloads_of_a_queued_child(server: ApiServerThread,
                                                                             ns: str) -> None:
    from cluster import JOBSETS

    kube = KubeClient(server.url)
    from realserver import real

    kube.apply_crd(opschema.without_empty_string_defaults(opschema.jobset_crd()) if real() else opschema.jobset_crd())
    kube.apply_crd(opschema.workload_crd())
    doc = yaml.safe_load((opschema.REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"] = {"name": "obs", "labels": {"kueue.x-k8s.io/queue-name": "q"}}
    doc["spec"]["childKind"] = "JobSet"
    job = kube.create(RLJOBS, ns, doc)
    from rljob_api.validation import parse_rljob
    from rljob_operator import builders

    parsed = parse_rljob({**doc, "metadata": {**doc["metadata"], "namespace": ns, "uid": job["metadata"]["uid"]}})
    js = kube.create(JOBSETS, ns, builders.build_jobset(parsed, OperatorSettings()))
    api = make_api(server, [])

    async def go():
        return await api.observe(kube.get(RLJOBS, ns, "obs"), now=kube_io.utc_now())

    observed = asyncio.run(go())
    assert observed.pytorchjob is None and observed.jobset["metadata"]["uid"] == js["metadata"]["uid"]
    assert observed.workloads == ()  # suspended and queue-labelled: looked up; none yet
    assert observed.kueue_missing is False
    kube.create_workload(ns, js)
    observed = asyncio.run(go())
    assert [w["metadata"]["ownerReferences"][0]["uid"] for w in observed.workloads] == [js["metadata"]["uid"]]
    api.close()
