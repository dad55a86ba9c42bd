"""Experiment trackers for real: a real MLflow tracking server (`mlflow server`, SQLite store) and W&B in offline
mode (its transaction log read back). A run logs every metrics.jsonl line to both; a SIGKILLed run resumes the
same tracker runs with every step exactly once; a tracking server killed mid-run costs no training step and
gets what was queued when it is back; a wrong URI is a one-line warning (an error with `required`)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Self

import pytest

pytest.importorskip("mlflow", reason="the tracking extra: pip install -e '.[tracking]'")
pytest.importorskip("wandb", reason="the tracking extra: pip install -e '.[tracking]'")

sys.path.insert(0, str(Path(__file__).parent))
from rljob_api.validation import parse_spec
from rljob_worker.telemetry import trackers
from rljob_worker.telemetry.trackers import (
    STEP_KEY,
    RunTrackers,
    _Delivery,
    mlflow_metric_name,
    wandb_offline_history,
)
from test_learning import HARNESS, logged_steps, quickstart_spec

JOB = "test/test"  # the harness runs job "test" in namespace "test": the default run name


def tracked_spec(mlflow_uri: str, experiment: str, *, steps: int, save_freq: int = -1, test_freq: int = -1,
                 val_before: bool = False) -> dict:
    spec = quickstart_spec()
    spec["training"].update(totalTrainingSteps=steps, testFreq=test_freq, valBeforeTrain=val_before)
    spec["checkpoint"].update(saveFreq=save_freq, maxToKeep=2, exportHf=False)
    spec["tracking"] = {"mlflow": {"trackingUri": mlflow_uri, "experiment": experiment},
                        "wandb": {"project": "rljob-tests", "mode": "offline"}}
    return spec


def start(spec: dict, workdir: Path, env: dict | None = None) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, str(HARNESS), str(workdir / "spec.json"), str(workdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "WANDB_SILENT": "true", **(env or {})})


def finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for_step(workdir: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s >= step for s in logged_steps(workdir / "metrics.jsonl")):
            return
        assert proc.poll() is None, f"trainer exited early ({proc.returncode}): {proc.stdout.read()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def jsonl_lines(workdir: Path) -> dict[int, list[dict]]:
    """Every metrics.jsonl line by step (a resumed step has two: before the kill and after)."""
    by_step: dict[int, list[dict]] = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record.pop("step"), []).append(record)
    return by_step


def the_mlflow_run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"one RLJob is one run; found {[r.info.run_id for r in runs]}"
    return runs[0]


def mlflow_rows(client, run_id: str, keys) -> dict[int, dict[str, float]]:
    """{step: {key: value}} from the server; fails on a key logged twice at one step."""
    rows: dict[int, dict[str, float]] = {}
    for key in keys:
        for m in client.get_metric_history(run_id, mlflow_metric_name(key)):
            assert key not in rows.setdefault(m.step, {}), f"{key} logged twice at step {m.step}"
            rows[m.step][key] = m.value
    return rows


def wandb_rows(workdir: Path) -> dict[int, dict]:
    """{step: row} over every offline segment of the one run under workdir/wandb; fails on a step logged twice."""
    segments = sorted((workdir / "wandb").glob("offline-run-*"))
    run_ids = {p.name.rsplit("-", 1)[1] for p in segments}
    assert len(run_ids) == 1, f"one RLJob is one W&B run; found {run_ids}"
    rows: dict[int, dict] = {}
    for row in wandb_offline_history(workdir, run_ids.pop()):
        step = row["_step"]
        assert step not in rows, f"step {step} logged twice to W&B"
        rows[step] = row
    return rows


def assert_holds_one_line_per_step(tracker_rows: dict[int, dict], lines: dict[int, list[dict]], steps) -> None:
    """Every training step is in the tracker exactly once, equal (same keys, same values) to one of the
    metrics.jsonl lines of that step."""
    assert sorted(s for s, row in tracker_rows.items() if STEP_KEY in row) == list(steps)
    for step in steps:
        row = tracker_rows[step]
        assert any(all(row.get(k) == v for k, v in line.items()) for line in lines[step]), (
            f"step {step}: the tracker's {row} equals no metrics.jsonl line of that step: {lines[step]}")


@pytest.mark.services
def test_run_logs_every_step_to_mlflow_and_wandb_equal_to_metrics_jsonl(tmp_path, mlflow_server):
    experiment = f"quickstart-{uuid.uuid4().hex[:8]}"
    spec = tracked_spec(mlflow_server.uri, experiment, steps=6, test_freq=3, val_before=True)
    code, out = finish(start(spec, tmp_path))
    assert code == 0, out[-4000:]
    lines = jsonl_lines(tmp_path)
    assert sorted(lines) == list(range(1, 7)) and all(len(v) == 1 for v in lines.values())
    keys = set().union(*(line[0] for line in lines.values()))

    client = mlflow_server.client()
    run = the_mlflow_run(client, experiment)
    assert run.info.status == "FINISHED" and run.info.run_name == JOB
    assert_holds_one_line_per_step(mlflow_rows(client, run.info.run_id, keys), lines, range(1, 7))
    # validation scores at the validations (before training, steps 3 and 6), samples as a table each time
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/reward_mean")] == [0, 3, 6]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/pass_at_1")] == [0, 3, 6]
    tables = sorted(a.path for a in client.list_artifacts(run.info.run_id, "validation/samples"))
    assert tables == [f"validation/samples/step_{s:06d}.json" for s in (0, 3, 6)]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, tables[-1], str(tmp_path))).read_text())
    assert table["columns"] == ["prompt", "response", "ground_truth", "reward"] and len(table["data"]) == 8
    # the spec as params, the worker's versions as tags
    import torch

    assert run.data.params["training.lr"] == "0.003" and run.data.params["rollout.engine"] == "hf"
    assert run.data.tags["version.torch"] == torch.__version__ and "version.megatron-core" in run.data.tags

    rows = wandb_rows(tmp_path)
    assert_holds_one_line_per_step(rows, lines, range(1, 7))
    tables = {s: row for s, row in rows.items() if row.get("validation/samples/_type") == "table-file"}
    assert sorted(tables) == [0, 3, 6] and all(t["validation/samples/nrows"] == 8 for t in tables.values())
    assert "tracker call failed" not in out and "MLFLOW_TRACKING_TOKEN" not in out


@pytest.mark.services
def test_sigkill_and_resume_continue_the_same_runs_without_duplicate_or_missing_steps(tmp_path, mlflow_server):
    import psutil

    experiment = f"resume-{uuid.uuid4().hex[:8]}"
    spec = tracked_spec(mlflow_server.uri, experiment, steps=12, save_freq=4)
    proc = start(spec, tmp_path)
    wait_for_step(tmp_path, 6, proc)  # past the step-4 checkpoint: steps 5 and 6 run again after the resume
    tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]  # the W&B service too: a pod dies whole
    for p in tree:
        p.kill()
    proc.wait()
    code, out = finish(start(spec, tmp_path))
    assert code == 0, out[-4000:]
    assert "resumed from step 4" in out
    lines = jsonl_lines(tmp_path)
    assert sorted(lines) == list(range(1, 13)) and len(lines[5]) == 2  # step 5 was trained twice
    keys = set().union(*(line[0] for line in lines.values()))

    client = mlflow_server.client()
    run = the_mlflow_run(client, experiment)
    assert run.info.status == "FINISHED"
    assert_holds_one_line_per_step(mlflow_rows(client, run.info.run_id, keys), lines, range(1, 13))
    assert_holds_one_line_per_step(wandb_rows(tmp_path), lines, range(1, 13))
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2  # one segment per process, one run id


@pytest.mark.services
def test_tracking_server_killed_mid_run_costs_no_step_and_gets_the_queue_when_back(tmp_path, mlflow_server):
    """The server is SIGKILLed right after the first step (a step takes ~0.1 s on an idle machine: steps
    enough that the run is still training when the kill lands, even when stopping the server takes 15 s),
    training goes on through the outage, and every step reaches the server once it is back."""
    experiment, steps = f"outage-{uuid.uuid4().hex[:8]}", 400
    spec = tracked_spec(mlflow_server.uri, experiment, steps=steps)
    spec["tracking"].pop("wandb")
    # the end of the run waits (bounded) for a server still restarting: restarts take minutes on a loaded machine
    proc = start(spec, tmp_path, {"RLJOB_TRACKER_FLUSH_S": "900"})
    wait_for_step(tmp_path, 1, proc)
    up_at: list[float] = []
    try:
        mlflow_server.stop(kill=True)
        down_since = time.monotonic()
        down_at = max(logged_steps(tmp_path / "metrics.jsonl"))  # the step when the server was gone
        assert down_at < steps, f"the run finished ({down_at} steps) before the server was down: raise `steps`"
        time.sleep(20)
        during = max(logged_steps(tmp_path / "metrics.jsonl"))
        print(f"server down at step {down_at}; step {during} 20 s later")
    finally:
        # training goes on while the server starts
        restart = threading.Thread(target=lambda: (mlflow_server.start(), up_at.append(time.monotonic())))
        restart.start()
    code, out = finish(proc, timeout=1500)
    restart.join()
    assert code == 0, out[-4000:]
    assert during > down_at, f"training stalled while the tracker was down: step {down_at} -> {during}"
    lines = jsonl_lines(tmp_path)
    assert sorted(lines) == list(range(1, steps + 1))
    client = mlflow_server.client()
    run = the_mlflow_run(client, experiment)
    assert_holds_one_line_per_step(mlflow_rows(client, run.info.run_id, set(lines[1][0])), lines,
                                   range(1, steps + 1))
    failures = [line for line in out.splitlines() if "tracker call failed" in line]
    assert up_at, "the tracking server did not come back"
    assert 1 <= len(failures) <= 1 + (up_at[0] - down_since) // 60, failures  # once a minute at most
    assert "tracker reachable again" in out and "dropped" not in out


@pytest.mark.services
def test_wrong_tracking_uri_is_a_one_line_warning_or_with_required_an_error(tmp_path, free_port):
    closed = f"http://127.0.0.1:{free_port()}"
    spec = tracked_spec(closed, "nowhere", steps=1)
    spec["tracking"].pop("wandb")
    code, out = finish(start(spec, tmp_path / "warn"))
    assert code == 0, out[-4000:]
    warnings = [line for line in out.splitlines() if "spec.tracking.mlflow" in line]
    assert len(warnings) == 1 and f"cannot open a run at {closed}" in warnings[0], warnings
    assert "Traceback" not in out and sorted(jsonl_lines(tmp_path / "warn")) == [1]

    spec["tracking"]["required"] = True
    work = tmp_path / "required"
    work.mkdir()
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "RLJOB_WORKDIR": str(work), "RLJOB_CHECKPOINT_URI": f"file://{work}/ckpt",
           "RLJOB_METRICS_PORT": "0"}
    proc = subprocess.run([sys.executable, "-m", "rljob_worker", "--spec", str(work / "spec.json")],
                          check=False, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"rljob worker: spec\.tracking\.mlflow: cannot open a run at .*required is true", proc.stderr)
    assert "Traceback" not in proc.stderr and not (work / "metrics.jsonl").exists()


class HoldFirstConnection:
    """A TCP proxy in front of a tracking server that takes the first connection and never answers on it (a
    server too busy to reply in time); every later connection is passed through both ways."""

    def __init__(self, upstream_port: int, port: int):
        self.uri = f"http://127.0.0.1:{port}"
        self.upstream_port, self.held = upstream_port, 0
        self._listener = socket.create_server(("127.0.0.1", port))
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed (__exit__)
            self._sockets.append(conn)
            if self.held == 0:
                self.held += 1
                continue  # read nothing, answer nothing
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets.append(upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for t in self._threads:
            t.join(timeout=5)


@pytest.mark.services
def test_a_tracker_that_answers_too_late_is_opened_again_not_dropped(tmp_path, mlflow_server, free_port, monkeypatch,
                                                                       caplog):
    """A tracking server that takes the connection but answers after the client's timeout (loaded, its database
    starting) used to cost the run all of its tracking: one warning and training without it. Opening is now tried
    again while the tracker times out; a refused connection still fails at once (the wrong-URI test above)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(trackers, "OPEN_RETRY_WAIT_S", 0.1)
    experiment = f"slow-{uuid.uuid4().hex[:8]}"
    with HoldFirstConnection(int(mlflow_server.uri.rsplit(":", 1)[1]), free_port()) as proxy:
        doc = tracked_spec(proxy.uri, experiment, steps=1)
        doc["tracking"].pop("wandb")
        with caplog.at_level(logging.WARNING, logger=trackers.__name__):
            run = RunTrackers.open(parse_spec(doc), job="test", namespace="test", workdir=tmp_path, state=None)
        try:
            assert [r["tracker"] for r in run.runs()] == ["mlflow"], caplog.text
            run.log_metrics(1, {STEP_KEY: 1.5})
        finally:
            run.close()
        assert proxy.held == 1
    assert f"did not answer in time (attempt 1 of {trackers.OPEN_ATTEMPTS})" in caplog.text
    assert "training without it" not in caplog.text
    client = mlflow_server.client()
    history = client.get_metric_history(the_mlflow_run(client, experiment).info.run_id, STEP_KEY)
    assert [(m.step, m.value) for m in history] == [(1, 1.5)]


class FlakyBackend:
    """A tracker whose calls fail while ``down`` is set (the delivery's contract, without a server)."""

    name = "mlflow"

    def __init__(self):
        self.down = threading.Event()
        self.got: list[int] = []

    def metrics(self, step, values, wall_ms):
        if self.down.is_set():
            raise ConnectionError("connection refused")
        if "bad@name" in values:
            raise ValueError("invalid metric name 'bad@name'")
        self.got.append(step)

    @staticmethod
    def rejects(exc):
        return isinstance(exc, ValueError)


class Counts:
    def __init__(self):
        self.errors = self.dropped = 0

    def record_tracker_error(self, tracker):
        self.errors += 1

    def record_tracker_dropped(self, tracker, records=1):
        self.dropped += records


def test_delivery_keeps_order_through_an_outage_and_drops_the_oldest_when_full():
    backend, counts = FlakyBackend(), Counts()
    delivery = _Delivery(backend, counts, maxsize=5)
    backend.down.set()
    started = time.monotonic()
    for step in range(1, 9):  # 8 records into a queue of 5 while the tracker is down: 1, 2, 3 dropped
        delivery.put("metrics", step, {"x": 1.0}, 0)
    assert time.monotonic() - started < 0.5, "put() must never wait for the tracker"
    time.sleep(0.3)
    assert backend.got == [] and counts.errors >= 1 and counts.dropped == 3
    backend.down.clear()
    assert delivery.close(timeout_s=30) == 0
    assert backend.got == [4, 5, 6, 7, 8]  # in order, each once

    backend2, counts2 = FlakyBackend(), Counts()
    stuck = _Delivery(backend2, counts2, maxsize=100)
    backend2.down.set()
    for step in range(1, 4):
        stuck.put("metrics", step, {"x": 1.0}, 0)
    assert stuck.close(timeout_s=1) == 3 and counts2.dropped == 3  # still down at the end: counted, not waited on


def test_delivery_skips_a_record_the_tracker_rejects_and_sends_the_rest():
    """A record refused as invalid fails the same way on every retry: it is dropped (counted) at once
    instead of holding back every later step until the end of the run."""
    backend, counts = FlakyBackend(), Counts()
    delivery = _Delivery(backend, counts, maxsize=100)
    delivery.put("metrics", 1, {"x": 1.0}, 0)
    delivery.put("metrics", 2, {"bad@name": 1.0}, 0)
    delivery.put("metrics", 3, {"x": 1.0}, 0)
    assert delivery.close(timeout_s=30) == 0
    assert backend.got == [1, 3] and counts.dropped == 1 and counts.errors == 1


def test_mlflow_metric_names_are_ones_mlflow_accepts():
    from mlflow.utils.validation import _validate_metric_name

    for name, expected in (("val/pass@4", "val/pass_at_4"), ("val/math#1/mean@8", "val/math_1/mean_at_8"),
                           ("actor/grad_norm", "actor/grad_norm")):
        assert mlflow_metric_name(name) == expected
        _validate_metric_name(expected)  # raises on a name the server would refuse
