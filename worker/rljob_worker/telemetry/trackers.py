"""Experiment trackers (MLflow, Weights & Biases) beside Prometheus: rank 0 only, never blocking a step.

The run loop talks to one :class:`RunTrackers` (``spec.tracking``)::

    trackers = RunTrackers.open(spec, job=..., namespace=..., workdir=..., state=<from the checkpoint>,
                                telemetry=telemetry)
    trackers.backfill(history)                     # after a resume: steps the tracker lost, from the checkpoint
    trackers.log_metrics(step, logged)             # each metrics.jsonl line; returns at once
    trackers.log_table(step, "validation/samples", columns, rows)
    trackers.state()                               # into the checkpoint's trainer state: the run ids
    trackers.runs()                                # into RLJob.status.trainer.trackerRuns
    trackers.close()                               # flush (bounded), finish the runs

One RLJob is one tracker run: the run id is kept in the checkpoint's trainer state and the run is reopened
on resume. Steps are logged with explicit step numbers, and a resumed run asks the tracker for the last
step it holds: steps the killed process had already delivered are not sent again (a resumed step repeats
the same computation, so the first delivery stands), and steps it had not delivered are sent from the
checkpoint's history (:meth:`RunTrackers.backfill`) or by the re-run. No step is sent twice, none is
missing.

Delivery: every tracker has its own thread and a bounded queue (``RLJOB_TRACKER_QUEUE``, default 10000
records). A failed call is retried (same record, in order, backing off up to 10 s), counted in
``rljob_tracker_errors_total{tracker}`` and logged at most once a minute; what was queued is sent when the
tracker is back. A record the tracker rejects as invalid (``backend.rejects(exc)``: MLflow's
INVALID_PARAMETER_VALUE) would fail the same way forever: it is logged, counted as dropped and skipped,
so that one bad record never holds back the steps behind it. A full queue drops its oldest record (``rljob_tracker_dropped_total``). At the end
:meth:`RunTrackers.close` waits at most ``RLJOB_TRACKER_FLUSH_S`` (default 60) seconds; what is still queued
then is counted as dropped. A tracker that cannot be opened at start (wrong URI, missing or refused
credential, client not installed; one that times out is tried OPEN_ATTEMPTS times) is a one-line warning
and the run goes on without it, or a :class:`~rljob_worker.startup_errors.StartupError` with
``spec.tracking.required``.

Credentials come from the environment only (``MLFLOW_TRACKING_TOKEN``, ``WANDB_API_KEY``, wired from a
Secret by the operator); nothing here logs them.
"""
from __future__ import annotations

import collections
import importlib.metadata
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Key present in every training step's metrics: its history tells which steps a tracker holds.
STEP_KEY = "timing/step_s"
ERROR_LOG_INTERVAL_S = 60.0
_MAX_BACKOFF_S = 10.0
# A tracker that took the connection but did not answer within the request timeout is alive and busy (a server
# under load, its database starting): opening it is tried again before the run goes on without it. A refused
# connection, an unknown host or a rejected credential fails at once.
OPEN_ATTEMPTS = 3
OPEN_RETRY_WAIT_S = 2.0


def worker_versions() -> dict[str, str]:
    """Versions of the packages that decide what a run computes (vllm only where installed)."""
    out = {}
    for name, dist in (("rljob", "rljob"), ("torch", "torch"), ("megatron-core", "megatron-core"),
                       ("transformers", "transformers"), ("vllm", "vllm")):
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def flatten(doc: Any, prefix: str = "") -> dict[str, str]:
    """A nested spec as {"training.lr": "0.003", ...} (lists as JSON), for MLflow params."""
    if isinstance(doc, Mapping):
        out: dict[str, str] = {}
        for key, value in doc.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    value = doc if isinstance(doc, str) else json.dumps(doc)
    return {prefix.rstrip("."): value}


# ---------------------------------------------------------------------------- one tracker's delivery


class _Delivery:
    """A thread sending one tracker's records in order from a bounded queue; retries until close."""

    def __init__(self, backend: Any, telemetry: Any, maxsize: int):
        self.backend, self.telemetry = backend, telemetry
        self.name = backend.name
        self._queue: collections.deque[tuple[str, tuple]] = collections.deque()
        self._maxsize = maxsize
        self._cond = threading.Condition()
        self._closing = False
        self._abandon = False
        self._busy = False
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._errors_since_log = 0
        self._failing = False
        self._warned_full = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"rljob-tracker-{self.name}", daemon=True)
        self._thread.start()

    def put(self, kind: str, *args: Any) -> None:
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self._maxsize:
                self._queue.popleft()  # the oldest goes: the newest steps matter most to whoever watches
                self._count_dropped(1)
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("%s: tracker queue full (%d records); dropping the oldest (counted in "
                                "rljob_tracker_dropped_total)", self.name, self._maxsize)
            self._queue.append((kind, args))
            self._cond.notify()

    def _count_dropped(self, n: int) -> None:
        self.dropped += n
        if self.telemetry is not None:
            self.telemetry.record_tracker_dropped(self.name, n)

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._abandon or (self._closing and not self._queue):
                    return
                kind, args = self._queue[0]
                self._busy = True
            try:
                getattr(self.backend, kind)(*args)
            except Exception as exc:  # noqa: BLE001  (a tracker outage never reaches training)
                if self.backend.rejects(exc):
                    self._skip_rejected(args, exc)
                    continue
                self._on_error(exc)
                with self._cond:
                    self._busy = False
                    if self._abandon:
                        return
                    self._cond.wait(timeout=backoff)  # close() wakes it for the final attempts
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            backoff = 0.5
            with self._cond:
                self._busy = False
                if self._queue and self._queue[0][1] is args:
                    self._queue.popleft()
                self._cond.notify_all()
            if self._failing:
                self._failing = False
                log.warning("%s: tracker reachable again; sending what was queued (%d records)", self.name,
                            len(self._queue))

    def _skip_rejected(self, args: tuple, exc: BaseException) -> None:
        if self.telemetry is not None:
            self.telemetry.record_tracker_error(self.name)
        log.warning("%s: tracker rejected a record as invalid; dropped, the next ones go on: %s", self.name,
                    _one_line(exc))
        with self._cond:
            self._busy = False
            if self._queue and self._queue[0][1] is args:
                self._queue.popleft()
                self._count_dropped(1)
            self._cond.notify_all()

    def _on_error(self, exc: BaseException) -> None:
        if self.telemetry is not None:
            self.telemetry.record_tracker_error(self.name)
        self._failing = True
        self._errors_since_log += 1
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            log.warning("%s: tracker call failed (%d failures since the last report; training goes on, %d "
                        "records queued): %s", self.name, self._errors_since_log, len(self._queue),
                        _one_line(exc))
            self._last_error_log, self._errors_since_log = now, 0

    def close(self, timeout_s: float) -> int:
        """Send what is queued for at most ``timeout_s``; returns the records left undelivered."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._cond.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                self._cond.notify_all()
            left = len(self._queue)
            self._abandon = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        if left:
            self._count_dropped(left)
            log.warning("%s: %d records were still undelivered after %.0fs at the end of the run; dropped",
                        self.name, left, timeout_s)
        return left


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------------- MLflow

_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- ]")


def mlflow_metric_name(name: str) -> str:
    """The MLflow name of a metric: MLflow takes letters, digits, ``_ - . /`` and spaces only, so
    ``val/pass@4`` is logged as ``val/pass_at_4`` and any other character becomes ``_``."""
    return _MLFLOW_BAD_CHARS.sub("_", name.replace("@", "_at_"))



class MlflowBackend:
    """MLflow through ``MlflowClient`` (REST; ``MLFLOW_TRACKING_TOKEN`` read from the environment)."""

    name = "mlflow"

    def __init__(self, cfg: Any, *, run_name: str, tags: Mapping[str, str]):
        # One attempt per call, bounded: the delivery thread retries, and a hung server must not hold it for
        # MLflow's default 120 s x 7 retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        self.cfg, self.uri = cfg, cfg.tracking_uri.rstrip("/")
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_name, self.tags = run_name, dict(tags)
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    def open(self, run_id: str | None, params: Mapping[str, str]) -> int | None:
        """Reopen ``run_id`` (or the run tagged with this RLJob's uid) or create one; the last step it holds."""
        client = self.client
        if run_id is None and self.tags.get("rljob.uid"):
            found = client.search_runs(
                [self._experiment_id()], filter_string=f"tags.`rljob.uid` = '{self.tags['rljob.uid']}'",
                max_results=1)
            run_id = found[0].info.run_id if found else None
        if run_id is not None:
            run = client.get_run(run_id)
            self.run_id, self.experiment_id = run_id, run.info.experiment_id
            client.update_run(run_id, status="RUNNING")
            history = client.get_metric_history(run_id, STEP_KEY)
            return max((m.step for m in history), default=None)
        from mlflow.entities import Param

        run = client.create_run(self._experiment_id(), run_name=self.run_name, tags=self.tags)
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        items = [Param(k, v[:6000]) for k, v in params.items()]
        for lo in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(self.run_id, params=items[lo:lo + 100])
        return None

    def _experiment_id(self) -> str:
        if self.experiment_id is None:
            exp = self.client.get_experiment_by_name(self.cfg.experiment)
            self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(self.cfg.experiment)
        return self.experiment_id

    @property
    def url(self) -> str | None:
        return f"{self.uri}/#/experiments/{self.experiment_id}/runs/{self.run_id}" if self.run_id else None

    def metrics(self, step: int, values: Mapping[str, float], wall_ms: int) -> None:
        from mlflow.entities import Metric

        # One log_batch per step (at most 1000 metrics): a step is in the store whole or not at all.
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_metric_name(k), v, wall_ms, step)
                                                    for k, v in values.items()])

    @staticmethod
    def rejects(exc: BaseException) -> bool:
        """The server (or the client's own check) refused the record itself: sending it again cannot help."""
        return getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE"

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.client.log_dict(self.run_id, {"step": step, "columns": list(columns), "data": [list(r) for r in rows]},
                             f"{name}/step_{step:06d}.json")

    def finish(self, completed: bool) -> None:
        if completed:  # a preempted or failed attempt leaves the run RUNNING: the next pod reopens it
            self.client.set_terminated(self.run_id, status="FINISHED")


# ---------------------------------------------------------------------------- Weights & Biases


class WandbBackend:
    """W&B through ``wandb.init`` (``WANDB_API_KEY`` from the environment; offline writes <workdir>/wandb)."""

    name = "wandb"

    def __init__(self, cfg: Any, *, run_name: str, tags: Mapping[str, str], directory: Path):
        import wandb

        self.wandb, self.cfg, self.run_name, self.tags = wandb, cfg, run_name, dict(tags)
        self.directory = directory
        self.run = None

    def open(self, run_id: str | None, params: Mapping[str, Any]) -> int | None:
        wandb = self.wandb
        new = run_id is None
        run_id = run_id or uuid.uuid4().hex[:16]
        last = wandb_offline_last_step(self.directory, run_id) if self.cfg.mode == "offline" else None
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.cfg.project, entity=self.cfg.entity, name=self.run_name, id=run_id, resume="allow",
            mode=self.cfg.mode, dir=str(self.directory), config=dict(params) if new else None,
            tags=[f"{k}={v}"[:64] for k, v in self.tags.items()], reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, init_timeout=60, x_disable_stats=True,
                                    x_disable_machine_info=True))
        if self.cfg.mode == "online" and self.run.starting_step:
            last = int(self.run.starting_step) - 1  # W&B keeps steps up to starting_step - 1
        return last

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    @property
    def url(self) -> str | None:
        return (self.run.url or None) if self.run is not None and self.cfg.mode == "online" else None

    def metrics(self, step: int, values: Mapping[str, float], wall_ms: int) -> None:
        self.run.log(dict(values), step=step)

    def table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.run.log({name: self.wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    @staticmethod
    def rejects(exc: BaseException) -> bool:
        return False  # offline or online, W&B takes any key; its errors are outages, retried

    def finish(self, completed: bool) -> None:
        self.run.finish(exit_code=0 if completed else 1)


def wandb_offline_records(run_file: Path) -> Iterable[Any]:
    """The protobuf records of one W&B transaction log (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log records (crc32, little-endian length, type FULL/FIRST/MIDDLE/LAST) in 32 KiB
    blocks. A torn last record (a killed writer) ends the scan."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file}: not a W&B transaction log")
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        if len(payload) < length or (kind == 0 and length == 0):
            return
        pos += 7 + length
        if kind in (1, 2):
            parts = payload
        else:
            parts += payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def wandb_offline_history(directory: Path, run_id: str) -> list[dict[str, Any]]:
    """Every history row of the offline segments of ``run_id`` under ``directory``/wandb, oldest segment first;
    each row's values as JSON-decoded, with ``_step``."""
    rows = []
    for run_file in sorted((directory / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for record in wandb_offline_records(run_file):
            if record.WhichOneof("record_type") == "history":
                row = {}
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                if record.history.HasField("step"):
                    row.setdefault("_step", record.history.step.num)
                rows.append(row)
    return rows


def wandb_offline_last_step(directory: Path, run_id: str) -> int | None:
    """The highest step the offline segments of ``run_id`` hold (None: none, or unreadable)."""
    try:
        steps = [int(row["_step"]) for row in wandb_offline_history(directory, run_id) if "_step" in row]
    except Exception as exc:  # noqa: BLE001  (an unreadable log: resume as if nothing was logged)
        log.warning("wandb: cannot read the offline run %s under %s: %s", run_id, directory, _one_line(exc))
        return None
    return max(steps, default=None)


# ---------------------------------------------------------------------------- the run's trackers


class RunTrackers:
    """The configured trackers of one run (rank 0). Every method returns at once and never raises."""

    def __init__(self, deliveries: list[_Delivery], last_steps: dict[str, int | None]):
        self._deliveries = deliveries
        self._last_steps = last_steps  # tracker -> highest step it already held when opened

    @classmethod
    def open(cls, spec: Any, *, job: str, namespace: str, workdir: Path, state: Mapping[str, Any] | None,
             telemetry: Any = None, spec_doc: Mapping[str, Any] | None = None) -> RunTrackers:
        """Open (or reopen, from the checkpoint's ``state``) every tracker of ``spec.tracking``."""
        from rljob_worker.startup_errors import StartupError

        tracking, state = spec.tracking, dict(state or {})
        versions = worker_versions()
        run_name = f"{namespace}/{job}"
        tags = {"rljob.job": job, "rljob.namespace": namespace, **{f"version.{k}": v for k, v in versions.items()}}
        if os.environ.get("RLJOB_UID"):
            tags["rljob.uid"] = os.environ["RLJOB_UID"]
        maxsize = max(1, int(os.environ.get("RLJOB_TRACKER_QUEUE", "10000")))
        deliveries, last_steps = [], {}
        for name, cfg in (("mlflow", tracking.mlflow), ("wandb", tracking.wandb)):
            if cfg is None:
                continue
            field = f"spec.tracking.{name}"
            try:
                if name == "mlflow":
                    backend: Any = MlflowBackend(cfg, run_name=cfg.run_name or run_name, tags=tags)
                    params = {**flatten(spec_doc or {}), **{f"version.{k}": v for k, v in versions.items()}}
                else:
                    backend = WandbBackend(cfg, run_name=cfg.run_name or run_name, tags=tags,
                                           directory=Path(workdir))
                    params = {**(spec_doc or {}), "versions": versions}
                last = _open_patiently(field, backend, (state.get(name) or {}).get("run_id"), params)
            except Exception as exc:  # noqa: BLE001  (ImportError, a wrong URI, a refused credential, ...)
                what = _open_problem(name, cfg, exc)
                if tracking.required:
                    raise StartupError(f"{field}: {what}; spec.tracking.required is true") from None
                log.warning("%s: %s; training without it (set spec.tracking.required to fail instead)", field, what)
                continue
            log.info("%s: logging to run %s%s%s", field, backend.run_id, " " if backend.url else "",
                     backend.url or "")
            deliveries.append(_Delivery(backend, telemetry, maxsize))
            last_steps[name] = last
        return cls(deliveries, last_steps)

    # ------------------------------------------------------------------ what the loop calls
    def backfill(self, history: Iterable[Any]) -> None:
        """After a resume: the checkpoint's steps (``StepResult``s) a tracker does not hold yet (lost in the
        queue of the killed process)."""
        for result in history:
            self.log_metrics(result.step, result.metrics)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One metrics.jsonl line: the same keys and values, at ``step``; skipped by a tracker that has it."""
        values = {}
        for key, raw in metrics.items():
            try:
                values[str(key)] = float(raw)
            except (TypeError, ValueError):
                continue
        wall_ms = int(time.time() * 1000)
        for d in self._deliveries:
            last = self._last_steps.get(d.name)
            if last is not None and step <= last:
                continue
            d.put("metrics", int(step), values, wall_ms)

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        for d in self._deliveries:
            last = self._last_steps.get(d.name)
            if last is not None and step <= last:
                continue
            d.put("table", int(step), name, list(columns), [list(r) for r in rows])

    def state(self) -> dict[str, Any]:
        """For the checkpoint's trainer state: each tracker's run id."""
        return {d.name: {"run_id": d.backend.run_id} for d in self._deliveries if d.backend.run_id}

    def runs(self) -> list[dict[str, Any]]:
        """For RLJob.status.trainer.trackerRuns."""
        out = []
        for d in self._deliveries:
            if d.backend.run_id:
                entry = {"tracker": d.name, "runId": d.backend.run_id}
                if d.backend.url:
                    entry["url"] = d.backend.url
                out.append(entry)
        return out

    def close(self, completed: bool = True) -> None:
        """Flush (at most RLJOB_TRACKER_FLUSH_S seconds in all), then close the runs (finished when
        ``completed``)."""
        budget = float(os.environ.get("RLJOB_TRACKER_FLUSH_S", "60"))
        deadline = time.monotonic() + budget
        for d in self._deliveries:
            d.close(max(0.0, deadline - time.monotonic()))
            try:
                d.backend.finish(completed)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: cannot close the run: %s", d.name, _one_line(exc))
        self._deliveries = []


def _timed_out(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from (or while handling) is a request timeout: MLflow's client
    wraps requests' ``Timeout``, or, with its retries off, a retry error whose chain ends in the socket's
    ``TimeoutError``."""
    try:
        from requests.exceptions import Timeout
    except ImportError:  # no HTTP client installed: only the standard library's timeouts
        Timeout = TimeoutError
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (TimeoutError, Timeout)):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _open_patiently(field: str, backend: Any, run_id: str | None, params: Mapping[str, Any]) -> int | None:
    """``backend.open``, tried again (OPEN_ATTEMPTS in all) while the tracker times out. A retry reopens the run an
    earlier attempt created, where its id came back (else the RLJob uid tag finds it)."""
    for attempt in range(1, OPEN_ATTEMPTS):
        try:
            return backend.open(backend.run_id or run_id, params)
        except Exception as exc:
            if not _timed_out(exc):
                raise
            log.warning("%s: the tracker did not answer in time (attempt %d of %d); trying again in %.0f s",
                        field, attempt, OPEN_ATTEMPTS, OPEN_RETRY_WAIT_S)
            time.sleep(OPEN_RETRY_WAIT_S)
    return backend.open(backend.run_id or run_id, params)  # the last attempt: whatever it raises is the answer


def _open_problem(name: str, cfg: Any, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"the {name} client is not installed (pip install 'rljob[tracking]')"
    where = cfg.tracking_uri if name == "mlflow" else f"project {cfg.project} ({cfg.mode})"
    hint = ("check trackingUri and the token in tokenSecretRef (MLFLOW_TRACKING_TOKEN)" if name == "mlflow"
            else "check the API key in apiKeySecretRef (WANDB_API_KEY), or use mode offline")
    return f"cannot open a run at {where}: {_one_line(exc)}; {hint}"
