"""Small pure pieces: conditions, the progress annotation codec, settings from the environment."""
from __future__ import annotations

import json

import pytest
from rljob_operator import conditions as c
from rljob_operator.progress import ProgressError, decode_progress, encode_progress, is_newer
from rljob_operator.settings import OperatorSettings

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T01:00:00Z"


def test_set_condition_keeps_transition_time_unless_status_changes() -> None:
    conds = c.set_condition([], c.RUNNING, c.FALSE, c.REASON_CREATING, "a", generation=1, now=T0)
    conds = c.set_condition(conds, c.RUNNING, c.FALSE, c.REASON_PENDING, "b", generation=2, now=T1)
    assert conds == [{"type": "Running", "status": "False", "reason": "Pending", "message": "b",
                      "lastTransitionTime": T0, "observedGeneration": 2}]
    conds = c.set_condition(conds, c.RUNNING, c.TRUE, c.REASON_PYTORCHJOB_RUNNING, "c", generation=2, now=T1)
    assert conds[0]["lastTransitionTime"] == T1


def test_set_condition_keeps_order_and_appends_new_types() -> None:
    conds = c.set_condition([], c.ACCEPTED, c.TRUE, c.REASON_SPEC_ACCEPTED, "", generation=None, now=T0)
    conds = c.set_condition(conds, c.RUNNING, c.FALSE, c.REASON_CREATING, "", generation=None, now=T0)
    conds = c.set_condition(conds, c.ACCEPTED, c.FALSE, c.REASON_INVALID_SPEC, "", generation=None, now=T1)
    assert [x["type"] for x in conds] == ["Accepted", "Running"]
    assert "observedGeneration" not in conds[0]


@pytest.mark.parametrize(("status", "reason"), [("Maybe", "Fine"), ("True", "not camel"), ("True", "")])
def test_set_condition_rejects_bad_status_or_reason(status: str, reason: str) -> None:
    with pytest.raises(ValueError):
        c.set_condition([], c.RUNNING, status, reason, "", generation=1, now=T0)


def test_every_reason_constant_is_one_camelcase_word() -> None:
    names = [n for n in dir(c) if n.startswith(("REASON_", "EVENT_"))]
    assert len(names) > 20
    for name in names:
        assert c.is_reason(getattr(c, name)), name


def test_progress_round_trip() -> None:
    value = encode_progress(7, total_steps=30, reward_mean=0.123456789, val_reward_mean=None,
                            last_checkpoint={"step": 5, "uri": "s3://b/x/step_000005"}, time=T0)
    assert len(value) < 200 and " " not in value
    assert decode_progress(value) == {"step": 7, "totalSteps": 30, "progressPercentage": 23,
                                      "rewardMean": 0.123457, "lastCheckpoint": {"step": 5, "uri": "s3://b/x/step_000005"},
                                      "lastUpdatedTime": T0}


def test_progress_drops_non_finite_rewards_and_clamps_percentage() -> None:
    value = encode_progress(40, total_steps=30, reward_mean=float("nan"), time=T0)
    doc = decode_progress(value)
    assert "rewardMean" not in doc and doc["progressPercentage"] == 100


def test_progress_carries_the_count_of_non_finite_rewards() -> None:
    """NaN rewards used to leave no trace but `nan` in a log line: the count reaches status.trainer."""
    doc = decode_progress(encode_progress(3, reward_mean=float("nan"), nonfinite_rewards=24, time=T0))
    assert doc["nonfiniteRewards"] == 24 and "rewardMean" not in doc
    assert "nonfiniteRewards" not in decode_progress(encode_progress(3, nonfinite_rewards=0, time=T0))
    with pytest.raises(ProgressError, match="nonfiniteRewards"):
        decode_progress('{"step": 1, "time": "t", "nonfiniteRewards": -1}')


def test_progress_carries_the_tracker_runs_and_the_status_model_takes_them() -> None:
    from rljob_api.models import TrainerStatus

    runs = [{"tracker": "mlflow", "runId": "abc", "url": "http://mlflow:5000/#/experiments/1/runs/abc"},
            {"tracker": "wandb", "runId": "r1"}]  # a W&B offline run has no URL
    doc = decode_progress(encode_progress(3, tracker_runs=runs, time=T0))
    assert doc["trackerRuns"] == runs
    assert TrainerStatus.model_validate(doc).tracker_runs[0].url == runs[0]["url"]
    for bad in ([{"tracker": "neptune", "runId": "x"}], [{"tracker": "mlflow", "runId": ""}],
                [{"tracker": "mlflow", "runId": "x", "url": "javascript:alert(1)"}]):
        with pytest.raises(ProgressError, match="trackerRuns"):
            decode_progress(json.dumps({"step": 1, "time": T0, "trackerRuns": bad}))


def test_progress_carries_pass_at_k_into_the_status() -> None:
    """The worker's last validation pass@k / mean@n reach status.trainer.valPassAtK (and the status model)."""
    from rljob_api.models import TrainerStatus

    doc = decode_progress(encode_progress(3, val_pass_at_k={"pass@1": 0.25, "pass@4": 0.5, "mean@4": 0.3}, time=T0))
    assert doc["valPassAtK"] == {"pass@1": 0.25, "pass@4": 0.5, "mean@4": 0.3}
    assert TrainerStatus.model_validate(doc).val_pass_at_k == doc["valPassAtK"]
    for bad in ({"val/pass@1": 0.5}, {"pass@1": float("nan")}, {f"pass@{k}": 0.1 for k in range(1, 18)}):
        with pytest.raises(ProgressError, match="valPassAtK"):
            encode_progress(3, val_pass_at_k=bad, time=T0)
    with pytest.raises(ProgressError, match="valPassAtK"):
        decode_progress('{"step": 1, "time": "t", "valPassAtK": {"pass@1": "high"}}')


@pytest.mark.parametrize("value", [
    "not json", "[]", '{"time": "t"}', '{"step": -1, "time": "t"}', '{"step": 1}', '{"step": true, "time": "t"}',
    '{"step": 1, "time": "t", "totalSteps": 0}', '{"step": 1, "time": "t", "rewardMean": "high"}',
    '{"step": 1, "time": "t", "lastCheckpoint": {"step": 1}}', json.dumps({"step": 1, "time": "x" * 5000}),
])
def test_progress_rejects_malformed_annotations(value: str) -> None:
    with pytest.raises(ProgressError):
        decode_progress(value)


@pytest.mark.parametrize("kwargs", [{"step": -1}, {"step": 1, "total_steps": 0},
                                    {"step": 1, "last_checkpoint": {"step": 1, "uri": ""}}])
def test_encode_rejects_bad_input(kwargs: dict) -> None:
    with pytest.raises(ProgressError):
        encode_progress(**kwargs)


def test_is_newer() -> None:
    value = encode_progress(3, time=T1)
    assert is_newer(value, None)
    assert is_newer(value, {"step": 2, "lastUpdatedTime": T0})
    assert not is_newer(value, {"step": 3, "lastUpdatedTime": T1})
    assert not is_newer("garbage", None) and not is_newer(None, None)


def test_settings_from_env() -> None:
    assert OperatorSettings.from_env({}) == OperatorSettings()
    s = OperatorSettings.from_env({"RLJOB_WORKER_IMAGE": "r/w:2", "RLJOB_PROGRESS_RBAC": "false",
                                   "RLJOB_RESYNC_SECONDS": "12.5", "RLJOB_API_CONCURRENCY": "4"})
    assert (s.worker_image, s.progress_rbac, s.resync_seconds, s.api_concurrency) == ("r/w:2", False, 12.5, 4)
    assert s.spec_path == "/etc/rljob/spec.json"


def test_watch_server_timeout_is_a_whole_number() -> None:
    """kopf sends it as the watch's `timeoutSeconds`, which the API server parses with ParseInt:
    `300.0` is answered 400 and the operator never starts."""
    for env in ({}, {"RLJOB_WATCH_SERVER_TIMEOUT": "120"}):
        value = OperatorSettings.from_env(env).watch_server_timeout
        assert type(value) is int and str(value).isdigit()
    with pytest.raises(ValueError, match="RLJOB_WATCH_SERVER_TIMEOUT='300.5' is not an integer"):
        OperatorSettings.from_env({"RLJOB_WATCH_SERVER_TIMEOUT": "300.5"})


@pytest.mark.parametrize(("env", "needle"), [
    ({"RLJOB_PROGRESS_RBAC": "maybe"}, "RLJOB_PROGRESS_RBAC"),
    ({"RLJOB_MASTER_PORT": "70000"}, "RLJOB_MASTER_PORT"),
    ({"RLJOB_API_CONCURRENCY": "many"}, "RLJOB_API_CONCURRENCY"),
    ({"RLJOB_RESYNC_SECONDS": "0"}, "RLJOB_RESYNC_SECONDS"),
])
def test_settings_errors_name_the_variable(env: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        OperatorSettings.from_env(env)


def test_operator_cli_needs_a_scope() -> None:
    from rljob_operator.__main__ import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-A", "-n", "x"])
    args = build_parser().parse_args(["-n", "team-a", "--namespace", "rl-*", "--metrics-port", "0"])
    assert args.namespaces == ["team-a", "rl-*"] and args.metrics_port == 0 and args.peering is None


def test_metrics_bind_address_and_kueue_grace_settings() -> None:
    assert OperatorSettings().operator_metrics_address == "0.0.0.0"  # the default is unchanged: every interface
    assert OperatorSettings().kueue_workload_grace_seconds == 60.0
    s = OperatorSettings.from_env({"RLJOB_OPERATOR_METRICS_ADDRESS": "127.0.0.1",
                                   "RLJOB_KUEUE_WORKLOAD_GRACE_SECONDS": "5"})
    assert (s.operator_metrics_address, s.kueue_workload_grace_seconds) == ("127.0.0.1", 5.0)
    assert OperatorSettings.from_env({"RLJOB_OPERATOR_METRICS_ADDRESS": "::"}).operator_metrics_address == "::"
    with pytest.raises(ValueError, match="RLJOB_OPERATOR_METRICS_ADDRESS='localhost' is not an IP address"):
        OperatorSettings.from_env({"RLJOB_OPERATOR_METRICS_ADDRESS": "localhost"})
    with pytest.raises(ValueError, match="RLJOB_KUEUE_WORKLOAD_GRACE_SECONDS"):
        OperatorSettings.from_env({"RLJOB_KUEUE_WORKLOAD_GRACE_SECONDS": "-1"})


def test_the_metrics_server_binds_the_configured_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from rljob_operator import metrics

    calls = []
    monkeypatch.setattr(metrics, "start_http_server", lambda port, addr: calls.append((port, addr)))
    monkeypatch.setattr(metrics, "_server_started", False)
    assert metrics.start_server(9999, "127.0.0.1") is True
    assert calls == [(9999, "127.0.0.1")]


def test_progress_with_many_long_quarantined_entries_still_reports_the_step() -> None:
    """200 quarantined steps with long URIs: the report goes through (a real PATCH to a server on
    127.0.0.1) within the annotation's cap; the list keeps the newest entries and counts the rest."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rljob_operator.progress import ANNOTATION, MAX_VALUE_BYTES
    from rljob_worker.telemetry.status_report import StatusReporter

    received: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body["metadata"]["annotations"][ANNOTATION])
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        prefix = "s3://bucket/" + "deep/" * 60 + "ns/job/quarantine/"
        quarantined = [{"step": s, "uri": f"{prefix}step_{s:06d}-20260101T000000Z", "reason": "sha256 mismatch " * 20}
                       for s in range(1, 201)]
        reporter = StatusReporter("job", "ns", f"http://127.0.0.1:{server.server_port}", enabled=True)
        assert reporter.report(step=1234, total_steps=2000, reward_mean=0.5, val_reward_mean=None, force=True,
                               last_checkpoint={"step": 1230, "uri": prefix + "x" * 900}, quarantined=quarantined)
    finally:
        server.shutdown()
        server.server_close()
    (value,) = received
    assert len(value.encode()) <= MAX_VALUE_BYTES
    doc = decode_progress(value)
    assert doc["step"] == 1234 and doc["lastCheckpoint"]["step"] == 1230
    listed = [q["step"] for q in doc["quarantinedCheckpoints"]]
    assert 1 <= len(listed) < 200 and listed == list(range(201 - len(listed), 201))  # the newest, oldest first
    assert doc["quarantinedCheckpointsOmitted"] == 200 - len(listed)
    # a short list is sent whole, with no count of omitted entries
    small = decode_progress(encode_progress(3, quarantined=quarantined[:2], time=T0))
    assert [q["step"] for q in small["quarantinedCheckpoints"]] == [1, 2] and "quarantinedCheckpointsOmitted" not in small
