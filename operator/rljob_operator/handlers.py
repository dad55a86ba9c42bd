"""Thin kopf handlers: every trigger runs the same cycle -- read, `reconcile`, apply.

    kopf run -m rljob_operator.handlers --namespace NS     (or: python -m rljob_operator -n NS)

Triggers: RLJob create / update of `spec` / resume (operator start), PyTorchJob and JobSet events
(watched server-side by our managed-by label; objects re-listed after a watch error count as events,
so a status written while the watch was down is not left to the resync), Kueue Workload events
(for NoKueueWorkload), new worker progress annotations, and a per-job resync that
every finished cycle schedules RLJOB_RESYNC_SECONDS ahead (our own timer: kopf's @kopf.timer would
add a finalizer to every RLJob). One asyncio lock per RLJob serialises cycles for the same job.

Errors: a failed API call during apply writes `Running=False, reason CreateFailed` when nothing
runs yet, then raises `kopf.TemporaryError` (kopf retries with backoff); for event-triggered
cycles, where kopf does not retry, the cycle is re-run from a backoff timer instead.

kopf settings (startup): no finalizer (nothing outside the cluster to clean up; children go by
ownerReferences), standalone unless `--peering` is given, progress and diff-base in annotations
(the RLJob status schema has no room for kopf's bookkeeping), bounded watch and request
timeouts, server-side label selector on PyTorchJobs, events reported as `rljob-operator`.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from typing import Any

import kopf
from rljob_api.models import GROUP, PLURAL, VERSION

from rljob_operator import builders, kube_io, metrics
from rljob_operator.progress import ANNOTATION as PROGRESS_ANNOTATION
from rljob_operator.progress import is_newer
from rljob_operator.reconcile import apply_failed_status, failure_events, reconcile
from rljob_operator.settings import OperatorSettings

RLJOB = (GROUP, VERSION, PLURAL)
PYTORCHJOB = ("kubeflow.org", "v1", "pytorchjobs")
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
WORKLOAD = ("kueue.x-k8s.io", "v1beta2", "workloads")
CHILD_KINDS = {builders.PYTORCHJOB_KIND, builders.JOBSET_KIND}
CONFLICT_RETRIES = 5
EVENT_RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

SETTINGS = OperatorSettings.from_env()  # read once; the timer interval below needs it at import
log = logging.getLogger("rljob_operator")


@dataclasses.dataclass
class _State:
    api: kube_io.KubeApi | None = None
    locks: dict[tuple[str, str], asyncio.Lock] = dataclasses.field(default_factory=dict)  # one per RLJob
    retries: dict[tuple[str, str], asyncio.TimerHandle] = dataclasses.field(default_factory=dict)  # pending re-runs


state = _State()


# ---------------------------------------------------------------------------- the cycle


async def run_cycle(namespace: str, name: str, *, trigger: str, ensure_all: bool = False, retry: int = 0,
                    body: Any = None) -> None:
    """Read the RLJob and its children, plan, apply. Raises kopf.TemporaryError on API errors.

    `body` is the RLJob as kopf just saw it; it saves one read on the first attempt (a stale one is
    caught by the resourceVersion-guarded status write, and the next attempt reads it fresh).
    """
    assert state.api is not None, "the startup handler did not run"
    api = state.api
    key = (namespace, name)
    lock = state.locks.setdefault(key, asyncio.Lock())
    async with lock:
        started = time.monotonic()
        result = "error"
        try:
            for attempt in range(CONFLICT_RETRIES):
                if attempt or body is None:
                    body = await api.get_rljob(namespace, name)
                else:
                    body = copy.deepcopy({k: body[k] for k in body})  # kopf's view -> a plain dict
                if body is None:
                    result = "gone"
                    return
                observed = await api.observe(body, now=kube_io.utc_now(), ensure_all=ensure_all)
                plan = reconcile(body, observed, SETTINGS)
                for note in plan.notes:
                    log.warning("%s/%s: %s", namespace, name, note)
                try:
                    created = await api.apply(body, plan)
                except kube_io.Conflict:
                    result = "conflict"
                    continue
                except kube_io.ApiError as exc:
                    if exc.namespace_gone:  # a namespace deletion took the children first
                        log.info("%s/%s: namespace is being deleted; nothing to do (%s)", namespace, name, exc)
                        result = "gone"
                        return
                    await _report_failure(api, body, plan, exc)
                    raise kopf.TemporaryError(str(exc), delay=_backoff(retry, exc)) from None
                metrics.record_created(created)
                metrics.record_conditions(namespace, name, plan.status or body.get("status"))
                result = "ok" if plan.accepted else "invalid"
                if plan.requeue_after is not None:
                    result = "requeue"
                    schedule(namespace, name, plan.requeue_after, trigger="requeue")
                else:
                    schedule(namespace, name, SETTINGS.resync_seconds, trigger="resync")
                return
            raise kopf.TemporaryError(f"{CONFLICT_RETRIES} write conflicts in a row", delay=1)
        finally:
            metrics.record_cycle(trigger, result, time.monotonic() - started)


async def _report_failure(api: kube_io.KubeApi, body: dict[str, Any], plan: Any, exc: kube_io.ApiError) -> None:
    """Errors become conditions: write CreateFailed (when nothing runs yet) before kopf retries."""
    status = apply_failed_status(body, plan, str(exc), kube_io.utc_now())
    if status is None:
        return
    try:
        fresh = await api.get_rljob(body["metadata"]["namespace"], body["metadata"]["name"])
        if fresh is not None and fresh.get("status") != status:
            await api.write_status(fresh, status)
            for event in failure_events(fresh, status):
                api.post_event(fresh, event)
    except kube_io.ApiError as again:
        log.warning("could not record the failure in the status: %s", again)


def _backoff(retry: int, exc: kube_io.ApiError) -> float:
    base = 1.0 if exc.transient else 10.0
    return min(60.0, base * (2 ** min(retry, 6)))


def schedule(namespace: str, name: str, delay: float, *, trigger: str, attempt: int = 0) -> None:
    """Run a cycle for the job after `delay` (one pending run per job; the earliest wins).

    Every finished cycle schedules the job's next resync this way: a level-based timer per RLJob
    without kopf's @kopf.timer, which would put a finalizer on every RLJob.
    """
    loop = asyncio.get_running_loop()
    key = (namespace, name)
    pending = state.retries.get(key)
    if pending is not None and not pending.cancelled() and pending.when() <= loop.time() + delay:
        return
    if pending is not None:
        pending.cancel()

    def fire() -> None:
        state.retries.pop(key, None)
        asyncio.ensure_future(_run_in_background(namespace, name, trigger=trigger, attempt=attempt))

    state.retries[key] = loop.call_later(delay, fire)


async def _run_in_background(namespace: str, name: str, *, trigger: str, attempt: int = 0) -> None:
    """A cycle where kopf will not retry (event handlers, resyncs, requeues): retry here with backoff."""
    try:
        await run_cycle(namespace, name, trigger=trigger, retry=attempt, ensure_all=trigger == "resync")
    except kopf.TemporaryError as exc:
        delay = EVENT_RETRY_DELAYS[min(attempt, len(EVENT_RETRY_DELAYS) - 1)]
        log.warning("%s/%s: %s; retrying in %.0fs", namespace, name, exc, delay)
        schedule(namespace, name, delay, trigger="retry", attempt=attempt + 1)


# ---------------------------------------------------------------------------- startup


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"  # unused: no handler needs one
    if not settings.peering.mandatory:
        settings.peering.standalone = True
    settings.posting.reporting_component = builders.MANAGER
    settings.posting.event_name_prefix = "rljob-"
    settings.watching.server_timeout = SETTINGS.watch_server_timeout
    settings.watching.client_timeout = SETTINGS.watch_server_timeout + 60
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = SETTINGS.api_timeout_seconds
    settings.networking.connect_timeout = 10
    for group, _, plural in (PYTORCHJOB, JOBSET):
        settings.watching.label_selectors[group, plural] = f"{builders.LABEL_MANAGED_BY}={builders.MANAGER}"
    settings.execution.max_workers = 4  # no sync handlers; the API client has its own pool
    state.api = kube_io.KubeApi(SETTINGS, on_error=metrics.record_api_error)
    if metrics.start_server(SETTINGS.operator_metrics_port, SETTINGS.operator_metrics_address):
        logger.info("serving operator metrics on %s:%d/metrics", SETTINGS.operator_metrics_address,
                    SETTINGS.operator_metrics_port)


@kopf.on.cleanup()
async def shutdown(**_: Any) -> None:
    for handle in state.retries.values():
        handle.cancel()
    if state.api is not None:
        await state.api.drain_events()
        state.api.close()


# ---------------------------------------------------------------------------- RLJob triggers


@kopf.on.resume(*RLJOB)
@kopf.on.create(*RLJOB)
@kopf.on.update(*RLJOB, field="spec")
async def rljob_changed(namespace: str, name: str, retry: int, body: kopf.Body, **_: Any) -> None:
    await run_cycle(namespace, name, trigger="change", retry=retry, body=body)


def _new_progress(type: str | None, annotations: dict[str, str], status: dict[str, Any], **_: Any) -> bool:
    return type in ("ADDED", "MODIFIED") and is_newer(annotations.get(PROGRESS_ANNOTATION), status.get("trainer"))


@kopf.on.event(*RLJOB, annotations={PROGRESS_ANNOTATION: kopf.PRESENT}, when=_new_progress)
async def progress_reported(namespace: str, name: str, **_: Any) -> None:
    await _run_in_background(namespace, name, trigger="progress")


@kopf.on.event(*RLJOB, when=lambda type, **_: type == "DELETED")
async def rljob_deleted(namespace: str, name: str, **_: Any) -> None:
    key = (namespace, name)
    metrics.forget(namespace, name)
    handle = state.retries.pop(key, None)
    if handle is not None:
        handle.cancel()
    lock = state.locks.get(key)
    if lock is not None and not lock.locked():
        state.locks.pop(key, None)


# ---------------------------------------------------------------------------- child and Workload events

RELIST_DELAY = 0.5  # seconds: the re-listed children of many jobs coalesce with their RLJobs' own cycles


async def child_event(type: str | None, namespace: str, labels: dict[str, str], trigger: str) -> None:
    """A PyTorchJob or JobSet changed. `type` None is an object kopf (re-)listed: at start-up, and after
    a watch ended with an error (410 Expired, an API-server restart). Its status may have changed while
    no watch was open, so it is reconciled too, through `schedule` (one pending cycle per job: the
    operator's start-up listing does not double the RLJobs' own resume cycles)."""
    name = labels[builders.LABEL_JOB]
    if type is None:
        schedule(namespace, name, RELIST_DELAY, trigger=f"{trigger}-relist")
    else:
        await _run_in_background(namespace, name, trigger=trigger)


_CHILD_LABELS = {builders.LABEL_MANAGED_BY: builders.MANAGER, builders.LABEL_JOB: kopf.PRESENT}


@kopf.on.event(*PYTORCHJOB, labels=_CHILD_LABELS)
async def pytorchjob_event(type: str | None, namespace: str, labels: dict[str, str], **_: Any) -> None:
    await child_event(type, namespace, labels, "pytorchjob")


@kopf.on.event(*JOBSET, labels=_CHILD_LABELS)
async def jobset_event(type: str | None, namespace: str, labels: dict[str, str], **_: Any) -> None:
    await child_event(type, namespace, labels, "jobset")


@kopf.on.event(*WORKLOAD)
async def workload_event(namespace: str, meta: kopf.Meta, **_: Any) -> None:
    """Kueue created, admitted or evicted a Workload: reconcile the RLJob whose child owns it (the child
    is named after its RLJob). Workloads of other jobs are ignored without an API call."""
    for ref in meta.get("ownerReferences") or ():
        key = (namespace, ref.get("name", ""))
        if ref.get("kind") in CHILD_KINDS and key in state.locks:  # an RLJob this operator has reconciled
            schedule(namespace, key[1], 0.0, trigger="workload")
