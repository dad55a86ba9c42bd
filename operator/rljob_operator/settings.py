"""Operator configuration, read once from the environment (the chart sets these variables).

| variable                        | default                      | meaning |
|---------------------------------|------------------------------|---------|
| RLJOB_WORKER_IMAGE              | ghcr.io/rljob/worker:0.1.0   | worker image when an RLJob leaves spec.image unset |
| RLJOB_WORKER_MODULE             | rljob_worker                 | module torchrun runs (`torchrun -m MODULE --spec ...`) |
| RLJOB_MASTER_PORT               | 23456                        | rendezvous port, declared as the `pytorchjob-port` container port |
| RLJOB_PROGRESS_RBAC             | true                         | create a per-job ServiceAccount/Role/RoleBinding so rank 0 can report progress |
| RLJOB_METRICS_SERVICE           | false                        | also create a headless `<job>-metrics` Service for the worker metrics |
| RLJOB_RESYNC_SECONDS            | 300                          | level-based resync period of every RLJob (a kopf timer) |
| RLJOB_API_TIMEOUT_SECONDS       | 30                           | timeout of one Kubernetes API request made by the operator |
| RLJOB_API_CONCURRENCY           | 16                           | parallel Kubernetes API requests (threads and pooled connections) |
| RLJOB_OPERATOR_METRICS_PORT     | 8080                         | port of the operator's own /metrics; 0 disables it |
| RLJOB_OPERATOR_METRICS_ADDRESS  | 0.0.0.0                      | address the operator's /metrics binds (0.0.0.0: every interface, so Prometheus can scrape the pod; 127.0.0.1: local only) |
| RLJOB_KUEUE_WORKLOAD_GRACE_SECONDS | 60                        | seconds a queue-labelled child may wait for a Kueue Workload before `Admitted=False, reason NoKueueWorkload` |
| RLJOB_WATCH_SERVER_TIMEOUT      | 300                          | whole seconds one watch request asks the API server to keep the stream |
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping

from rljob_api.pod_layout import SPEC_MOUNT_PATH

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    worker_image: str = "ghcr.io/rljob/worker:0.1.0"
    worker_module: str = "rljob_worker"
    spec_mount_path: str = SPEC_MOUNT_PATH
    master_port: int = 23456
    progress_rbac: bool = True
    metrics_service: bool = False
    resync_seconds: float = 300.0
    api_timeout_seconds: float = 30.0
    api_concurrency: int = 16
    operator_metrics_port: int = 8080
    operator_metrics_address: str = "0.0.0.0"
    kueue_workload_grace_seconds: float = 60.0
    # An integer: the API server parses the watch's timeoutSeconds with ParseInt ("300.0" is a 400).
    watch_server_timeout: int = 300

    @property
    def spec_path(self) -> str:
        return f"{self.spec_mount_path}/spec.json"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        """Settings from RLJOB_* variables; a malformed value raises ValueError naming the variable."""
        env = os.environ if env is None else env
        defaults = cls()
        return cls(
            worker_image=_str(env, "RLJOB_WORKER_IMAGE", defaults.worker_image),
            worker_module=_str(env, "RLJOB_WORKER_MODULE", defaults.worker_module),
            master_port=_int(env, "RLJOB_MASTER_PORT", defaults.master_port, lo=1, hi=65535),
            progress_rbac=_bool(env, "RLJOB_PROGRESS_RBAC", defaults.progress_rbac),
            metrics_service=_bool(env, "RLJOB_METRICS_SERVICE", defaults.metrics_service),
            resync_seconds=_float(env, "RLJOB_RESYNC_SECONDS", defaults.resync_seconds, lo=1.0),
            api_timeout_seconds=_float(env, "RLJOB_API_TIMEOUT_SECONDS", defaults.api_timeout_seconds, lo=0.1),
            api_concurrency=_int(env, "RLJOB_API_CONCURRENCY", defaults.api_concurrency, lo=1, hi=256),
            operator_metrics_port=_int(env, "RLJOB_OPERATOR_METRICS_PORT", defaults.operator_metrics_port,
                                       lo=0, hi=65535),
            operator_metrics_address=_address(env, "RLJOB_OPERATOR_METRICS_ADDRESS",
                                              defaults.operator_metrics_address),
            kueue_workload_grace_seconds=_float(env, "RLJOB_KUEUE_WORKLOAD_GRACE_SECONDS",
                                                defaults.kueue_workload_grace_seconds, lo=0.0),
            watch_server_timeout=_int(env, "RLJOB_WATCH_SERVER_TIMEOUT", defaults.watch_server_timeout,
                                       lo=1, hi=86400),
        )


def _str(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "").strip()
    return value or default


def _address(env: Mapping[str, str], name: str, default: str) -> str:
    value = _str(env, name, default)
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an IP address; use e.g. 0.0.0.0 (all interfaces), "
                         "127.0.0.1 (local only) or :: (all, IPv6)") from None
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    if name not in env:
        return default
    value = env[name].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r} is not a boolean; use true or false")


def _int(env: Mapping[str, str], name: str, default: int, *, lo: int, hi: int) -> int:
    if not env.get(name, "").strip():
        return default
    try:
        value = int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer (a whole number, e.g. 300)") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is outside [{lo}, {hi}]")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, lo: float) -> float:
    if not env.get(name, "").strip():
        return default
    try:
        value = float(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not a number") from None
    if not value >= lo:
        raise ValueError(f"{name}={value} must be at least {lo}")
    return value
