"""tests/operator: builders, reconcile, the API-server harness and the real operator over HTTP.

Helpers live next to this file (opschema.py, apiserver.py, cluster.py) and are put on sys.path
here, because the suite runs with --import-mode=importlib.
"""
from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def api_server() -> Iterator:
    """The test API server (kmock + harness), or the real one of RLJOB_TEST_KUBECONFIG (realserver.py),
    with the RLJob, PyTorchJob, JobSet and Kueue Workload CRDs applied."""
    import opschema
    from cluster import KubeClient
    from realserver import make_server, real

    server = make_server(bookmark_interval=5.0)
    try:  # a failed CRD apply must not leave the server (or a real server's kubectl proxy) running
        kube = KubeClient(server.url)
        kube.apply_crd(opschema.rljob_crd())
        kube.apply_crd(opschema.pytorchjob_crd())
        jobset = opschema.without_empty_string_defaults(opschema.jobset_crd()) if real() else opschema.jobset_crd()
        kube.apply_crd(jobset)
        kube.apply_crd(opschema.workload_crd())
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def kube(api_server):
    from cluster import KubeClient

    return KubeClient(api_server.url)


class OperatorHandle:
    """The running operator of a test module; `restart(kill=True)` replaces the process."""

    def __init__(self, api_server, workdir, **options):
        self.api_server, self.workdir, self.options = api_server, workdir, options
        self.kubeconfig = api_server.write_kubeconfig(workdir / "kubeconfig.json")
        self.generation = 0
        self.proc = None

    def start(self):
        from cluster import OperatorProcess, wait_until

        self.generation += 1
        self.proc = OperatorProcess(self.kubeconfig, self.workdir / f"operator-{self.generation}.log",
                                    **self.options).start()
        self.proc.wait_ready()
        # /metrics answers before kopf has opened its watches; an RLJob applied in a namespace made
        # in that gap was once never handled (a module's first test, 1 of 4 full CI runs). Wait for
        # the operator's first watch (its namespace watch: the module's server has no other client;
        # on a real server, watches opened since the test connected).
        server = self.api_server
        wait_until(lambda: server.call(server.server.watch_count) >= 1, timeout=30, interval=0.1,
                   what="the operator's first watch", on_timeout=lambda: self.logs()[-4000:])
        from realserver import real

        if real():
            self._first_reconcile()
        return self

    def _first_reconcile(self) -> None:
        """A real server just started opens its controllers' watches for a while after the test connected, so
        the watch count above can be theirs: the first test then created its RLJob before the operator watched
        and waited out its 8 s (2 of 3 runs once). An RLJob in a namespace of its own, reconciled (it has
        conditions), proves the operator's watches are open; its namespace is deleted after."""
        import opschema
        import yaml
        from cluster import NAMESPACES, RLJOBS, KubeClient, wait_until

        kube = KubeClient(self.api_server.url)
        namespace = f"rlj-ready-{uuid.uuid4().hex[:8]}"
        kube.create_namespace(namespace)
        doc = yaml.safe_load((opschema.REPO / "examples" / "quickstart.yaml").read_text())
        doc["metadata"] = {"name": "ready"}
        doc["spec"]["suspend"] = True  # nothing runs
        kube.create(RLJOBS, namespace, doc)
        wait_until(lambda: (kube.get(RLJOBS, namespace, "ready").get("status") or {}).get("conditions"), timeout=60,
                   interval=0.2, what="the operator's first reconcile", on_timeout=lambda: self.logs()[-4000:])
        kube.delete(NAMESPACES, None, namespace)

    def restart(self, *, kill: bool = True):
        if kill:
            self.proc.kill()
        else:
            self.proc.stop()
        return self.start()

    def logs(self) -> str:
        return "\n".join((self.workdir / f"operator-{g}.log").read_text(errors="replace")
                         for g in range(1, self.generation + 1) if (self.workdir / f"operator-{g}.log").exists())

    def __getattr__(self, name):
        return getattr(self.proc, name)


@pytest.fixture(scope="module")
def operator(api_server, tmp_path_factory) -> Iterator[OperatorHandle]:
    """`python -m rljob_operator --namespace 'rlj-*'` against the test API server (a subprocess)."""
    import cluster

    handle = OperatorHandle(api_server, tmp_path_factory.mktemp("operator"), namespaces=["rlj-*"],
                            env={"RLJOB_RESYNC_SECONDS": str(cluster.RESYNC_SECONDS),
                                 "RLJOB_KUEUE_WORKLOAD_GRACE_SECONDS": str(cluster.KUEUE_GRACE_SECONDS)}).start()
    yield handle
    handle.proc.stop()


@pytest.fixture
def ns(kube) -> str:
    """A fresh namespace the operator serves."""
    name = f"rlj-{uuid.uuid4().hex[:8]}"
    kube.create_namespace(name)
    return name
