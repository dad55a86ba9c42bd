"""The operator's own Prometheus metrics (prometheus-client lives here only), served on /metrics.

    rljob_operator_reconciles_total{trigger, result}      reconcile cycles; result: ok, invalid, requeue, conflict, error
    rljob_operator_reconcile_duration_seconds{trigger}    latency of one cycle (read, plan, apply)
    rljob_operator_api_errors_total{verb, code}           failed Kubernetes API calls (code 0: no response)
    rljob_operator_children_created_total{kind}           children really created (not 409)
    rljob_operator_rljobs{condition, status}              RLJobs by condition type and status, as last written
plus the default process metrics (process_resident_memory_bytes, ...).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rljob_operator import conditions as c

RECONCILES = Counter("rljob_operator_reconciles", "Reconcile cycles by trigger and result.", ["trigger", "result"])
RECONCILE_SECONDS = Histogram(
    "rljob_operator_reconcile_duration_seconds", "Duration of one reconcile cycle (read, plan, apply).", ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
API_ERRORS = Counter("rljob_operator_api_errors", "Failed Kubernetes API calls by verb and HTTP status.",
                     ["verb", "code"])
CHILDREN_CREATED = Counter("rljob_operator_children_created", "Children created (409s not counted).", ["kind"])


class _JobsByCondition(Collector):
    """rljob_operator_rljobs{condition, status}: counted at scrape time from the last written conditions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], dict[str, str]] = {}

    def set(self, namespace: str, name: str, conditions: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            self._jobs[(namespace, name)] = {cond["type"]: cond["status"] for cond in conditions}

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("rljob_operator_rljobs", "RLJobs by condition type and status.",
                                   labels=["condition", "status"])
        with self._lock:
            jobs = list(self._jobs.values())
        for type_ in c.CONDITION_TYPES:
            for status in (c.TRUE, c.FALSE, c.UNKNOWN):
                family.add_metric([type_, status], sum(1 for j in jobs if j.get(type_) == status))
        yield family


JOBS = _JobsByCondition()
REGISTRY.register(JOBS)
_server_started = False


def start_server(port: int, addr: str = "0.0.0.0") -> bool:
    """Serve /metrics on `port` (0 disables); idempotent."""
    global _server_started
    if port == 0 or _server_started:
        return False
    start_http_server(port, addr=addr)
    _server_started = True
    return True


def record_cycle(trigger: str, result: str, seconds: float) -> None:
    RECONCILES.labels(trigger, result).inc()
    RECONCILE_SECONDS.labels(trigger).observe(seconds)


def record_api_error(verb: str, status: int) -> None:
    API_ERRORS.labels(verb, str(status)).inc()


def record_created(objects: Iterable[Mapping[str, Any]]) -> None:
    for obj in objects:
        CHILDREN_CREATED.labels(obj["kind"]).inc()


def record_conditions(namespace: str, name: str, status: Mapping[str, Any] | None) -> None:
    if status and status.get("conditions"):
        JOBS.set(namespace, name, status["conditions"])


def forget(namespace: str, name: str) -> None:
    JOBS.forget(namespace, name)
