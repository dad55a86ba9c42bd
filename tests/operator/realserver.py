"""The operator suite against a REAL kube-apiserver (RLJOB_TEST_KUBECONFIG), or the stand-in.

`make_server()` returns the stand-in (`apiserver.ApiServerThread`) unless RLJOB_TEST_KUBECONFIG
names a kubeconfig of a running API server (scripts/kube-envtest starts one). Then the tests' plain
HTTP client (`cluster.KubeClient`) reaches it through `kubectl proxy` on a loopback port, and the
operator process gets the real kubeconfig (TLS, token). A test that asks for a stand-in-only hook
(`server.call(server.server.inject, ...)`: fault injection, compaction, dropped watches, the request
log, pruning warnings) is skipped, naming the hook.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

KUBECONFIG = os.environ.get("RLJOB_TEST_KUBECONFIG") or None
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def real() -> bool:
    return KUBECONFIG is not None


class _HookNames:
    """`server.server.inject` -> "inject": the stand-in hook a test asked for, for `RealServer.call`."""

    def __getattr__(self, name: str) -> str:
        return name


# Why each stand-in hook has no real-server counterpart (the skip reason of a test that uses it).
STANDIN_ONLY = {
    "inject": "fault injection: failing or delaying chosen requests; a real server cannot be told to",
    "clear_faults": "fault injection: failing or delaying chosen requests; a real server cannot be told to",
    "compact": "forcing a watch's resourceVersion to expire (410) at a chosen moment; etcd compacts on its own "
               "schedule",
    "drop_watches": "cutting every open watch at a chosen moment; on a real server that takes an API-server "
                    "restart, which this suite does not do",
    "request_log": "the list of every request the server answered; a real server keeps no such log (audit "
                   "logging is off)",
    "unknown_field_warnings": "the recorded 'unknown field' warnings of pruned requests; a real server only "
                              "returns them to the client that sent the request",
}


class RealServer:
    def __init__(self, kubeconfig: str):
        from cluster import free_port

        self.kubeconfig = kubeconfig
        kubectl = os.environ.get("RLJOB_TEST_KUBECTL") or shutil.which("kubectl")
        if kubectl is None:
            raise RuntimeError("RLJOB_TEST_KUBECONFIG needs kubectl on PATH (or RLJOB_TEST_KUBECTL)")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([kubectl, "--kubeconfig", kubeconfig, "proxy", "--address", "127.0.0.1",
                                      "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with _OPENER.open(self.url + "/version", timeout=2) as resp:
                    self.version = resp.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()
                    raise RuntimeError(f"kubectl proxy to {kubeconfig} did not answer") from None
                time.sleep(0.1)
        self.server = _HookNames()
        self._baseline = self._open_watches()

    def start(self) -> RealServer:
        return self

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        shutil.copy(self.kubeconfig, path)
        return path

    def _open_watches(self) -> int:
        """Open WATCH requests on the server, from its own /metrics."""
        with _OPENER.open(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       # apiserver_longrunning_gauge before Kubernetes 1.23's rename
                       if line.startswith(("apiserver_longrunning_requests{", "apiserver_longrunning_gauge{"))
                       and 'verb="WATCH"' in line))

    def call(self, hook: Any, *args: Any, **kwargs: Any) -> Any:
        if hook == "watch_count":  # watches opened since this object was made (the controllers' are older)
            return max(0, self._open_watches() - self._baseline)
        why = STANDIN_ONLY.get(hook, "a hook a real API server does not offer")
        pytest.skip(f"stand-in only: needs the stand-in API server's {hook}() ({why})")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def make_server(**standin_options: Any) -> Any:
    """A started server: the real one of RLJOB_TEST_KUBECONFIG, else the stand-in with these options."""
    if KUBECONFIG is not None:
        return RealServer(KUBECONFIG)
    from apiserver import ApiServerThread

    return ApiServerThread(**standin_options).start()


def version() -> str:
    """The real server's /version document (JSON), read through kubectl."""
    kubectl = os.environ.get("RLJOB_TEST_KUBECTL") or shutil.which("kubectl") or "kubectl"
    return subprocess.run([kubectl, "--kubeconfig", str(KUBECONFIG), "get", "--raw", "/version"], check=True,
                          capture_output=True, text=True, timeout=30).stdout
