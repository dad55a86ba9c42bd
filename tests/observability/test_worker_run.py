"""A REAL worker run scraped by a REAL Prometheus: `python -m rljob_worker` with the quickstart spec
(tiny Qwen2 on CPU, megatron-core, HF rollout engine), shortened to a few steps, scraped every second
(through linger_worker.py, which only keeps /metrics up 2.5 s after the run, so the end is scraped).

Checks that the metrics arrive with sane values (the step increases, the stages add up to the step
time) and that every dashboard expression over worker metrics returns data for this run, except
those whose metrics this CPU configuration does not produce (:data:`NOT_PRODUCED_HERE`, each with
its reason). Operator panels are covered by test_dashboards.py (the operator's metrics module fed made-up reconciles).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from obs_support import RATE_SUBSTITUTIONS, REPO, dashboard_targets, finite_values, substitute_vars

JOB, NS, STEPS = "quick", "obs-real", 4

#: Worker metrics the dashboards use that this run legitimately lacks.
NOT_PRODUCED_HERE = {
    "rljob_gpu_memory_allocated_bytes": "CPU run: record_gpu_memory() needs CUDA",
    "rljob_gpu_memory_reserved_bytes": "CPU run: record_gpu_memory() needs CUDA",
    "rljob_gpu_memory_max_allocated_bytes": "CPU run: record_gpu_memory() needs CUDA",
    "rljob_gpu_memory_total_bytes": "CPU run: record_gpu_memory() needs CUDA",
    "rljob_actor_kl": "quickstart has klCoef 0: no reference model, no KL",
    "rljob_actor_entropy": "quickstart has entropyCoeff 0: the trainer skips the entropy",
    "rljob_mfu_ratio": "the trainer does not report perf/mfu (yet)",
    "rljob_train_tokens_per_second": "the trainer does not report throughput/train_tokens_per_s (yet)",
    **{name: "quickstart is GRPO: no critic (the PPO row is checked against the fake trainer in test_dashboards, "
       "and the PPO trainer's metrics keys in test_ppo)" for name in (
        "rljob_critic_value_loss", "rljob_critic_explained_variance", "rljob_critic_value_clip_fraction",
        "rljob_critic_vpred_mean", "rljob_critic_update_seconds")},
}


def quick_spec(ckpt_uri: str) -> dict:
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())["spec"]
    spec["training"].update(totalTrainingSteps=STEPS, testFreq=2, valBeforeTrain=False)
    spec["checkpoint"].update(uri=ckpt_uri, saveFreq=2, exportHf=False)
    return spec


@pytest.fixture(scope="module")
def worker_run(prometheus_server_session, free_port, tmp_path_factory):
    """Run the worker to completion under Prometheus: (prom, time of the last scrape, steps seen, log)."""
    tmp = tmp_path_factory.mktemp("worker-run")
    port = free_port()
    prom = prometheus_server_session([f"127.0.0.1:{port}"])
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(quick_spec(f"file://{tmp}/ckpt")))
    env = {**os.environ, "RLJOB_NAME": JOB, "RLJOB_NAMESPACE": NS, "RLJOB_METRICS_PORT": str(port),
           "RLJOB_WORKDIR": str(tmp / "work"), "PYTHONUNBUFFERED": "1"}
    log_path = tmp / "worker.log"
    with open(log_path, "w") as log:
        # = python -m rljob_worker --spec ..., keeping /metrics up 2.5 s after the end (see linger_worker.py)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("linger_worker.py")), "--spec", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
    steps_seen: list[float] = []
    last_scrape = None
    deadline = time.monotonic() + 480
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"worker still running after 480 s:\n{log_path.read_text()[-3000:]}"
            result = prom.query(f'timestamp(rljob_step{{rljob="{JOB}"}})')
            if result:
                last_scrape = float(result[0]["value"][1])
                step = float(prom.query(f'rljob_step{{rljob="{JOB}"}}', time=last_scrape)[0]["value"][1])
                if not steps_seen or step != steps_seen[-1]:
                    steps_seen.append(step)
            time.sleep(0.3)
        assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{log_path.read_text()[-5000:]}"
        assert last_scrape is not None, f"Prometheus never scraped the worker:\n{log_path.read_text()[-3000:]}"
        yield prom, last_scrape, steps_seen, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        prom.stop()


def at_end(run, expr: str) -> float:
    """The single value of expr at the worker's last scrape."""
    prom, t, _steps, _log = run
    result = prom.query(expr, time=t)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def test_metrics_arrive_with_sane_values(worker_run):
    prom, t, steps_seen, _log = worker_run
    sel = f'rljob="{JOB}", namespace="{NS}", rank="0"'
    # The step rose through the run to the last one.
    assert steps_seen == sorted(steps_seen) and len(steps_seen) >= 2, steps_seen
    assert steps_seen[-1] == STEPS
    assert at_end(worker_run, f"rljob_total_steps{{{sel}}}") == STEPS
    assert at_end(worker_run, f"rljob_steps_total{{{sel}}}") == STEPS
    assert at_end(worker_run, f"rljob_step_seconds_count{{{sel}}}") == STEPS
    # The stages inside the step add up to the step time (validation and checkpoint follow it), at
    # every scrape of the run where no step was half done (as many rollouts as steps).
    ratio = (f'sum(rljob_stage_seconds_sum{{{sel}, stage!~"validation|checkpoint"}}) / on() '
             f'rljob_step_seconds_sum{{{sel}}} and on() '
             f'(rljob_stage_seconds_count{{{sel}, stage="rollout"}} - ignoring(stage) rljob_steps_total{{{sel}}} == 0)')
    series = prom.api("query_range", {"query": ratio, "start": t - 600, "end": t, "step": 1})["result"]
    ratios = [float(v) for s in series for _ts, v in s["values"]]
    assert ratios, "no scrape between steps"
    assert all(0.9 <= r <= 1.01 for r in ratios), ratios
    stages = {r["metric"]["stage"] for r in prom.query(f"rljob_stage_seconds_count{{{sel}}}", time=t)}
    assert {"rollout", "reward", "actor_update", "weight_sync", "checkpoint", "validation"} <= stages
    assert at_end(worker_run, f'rljob_stage_seconds_count{{{sel}, stage="rollout"}}') == STEPS
    assert at_end(worker_run, f'rljob_stage_seconds_count{{{sel}, stage="checkpoint"}}') == 2
    assert at_end(worker_run, f'rljob_stage_seconds_count{{{sel}, stage="validation"}}') == 2
    assert at_end(worker_run, f"sum(rljob_stage_active{{{sel}}})") == 0
    # Scalars in range.
    mean = at_end(worker_run, f"rljob_reward_mean{{{sel}}}")
    assert at_end(worker_run, f"rljob_reward_min{{{sel}}}") <= mean <= at_end(worker_run, f"rljob_reward_max{{{sel}}}")
    assert 0 <= mean <= 1
    assert 0 <= at_end(worker_run, f"rljob_validation_accuracy{{{sel}}}") <= 1
    assert at_end(worker_run, f"rljob_validation_step{{{sel}}}") == STEPS
    assert at_end(worker_run, f"rljob_actor_grad_norm{{{sel}}}") > 0
    assert at_end(worker_run, f"rljob_rollout_tokens_per_second{{{sel}}}") > 0
    assert 0 < at_end(worker_run, f"rljob_response_length_mean_tokens{{{sel}}}") <= 16
    # Checkpoints at steps 2 and 4, committed during the run; heartbeat fresh at the end.
    assert at_end(worker_run, f"rljob_last_checkpoint_step{{{sel}}}") == STEPS
    assert at_end(worker_run, f"rljob_checkpoints_total{{{sel}}}") == 2
    assert at_end(worker_run, f"rljob_checkpoint_interval_seconds_estimate{{{sel}}}") > 0
    started = at_end(worker_run, f"rljob_start_timestamp_seconds{{{sel}}}")
    assert started < at_end(worker_run, f"rljob_last_checkpoint_timestamp_seconds{{{sel}}}") <= t + 1
    assert t - at_end(worker_run, f"rljob_heartbeat_timestamp_seconds{{{sel}}}") < 30
    (info,) = prom.query(f"rljob_job_info{{{sel}}}", time=t)
    assert (info["metric"]["model"], info["metric"]["algorithm"], info["metric"]["nnodes"]) == (
        "builtin://tiny-qwen2", "grpo", "1")


def test_dashboard_expressions_return_data_for_the_worker_run(worker_run):
    prom, t, _steps, _log = worker_run
    values = {**RATE_SUBSTITUTIONS, "namespace": NS, "rljob": JOB}
    checked, failures = 0, []
    for file, panel, target in dashboard_targets():
        expr = target["expr"]
        if "rljob_operator_" in expr or "ALERTS" in expr:
            continue  # operator panels: test_dashboards.py, against the operator's metrics module
        query = substitute_vars(expr, values)
        result = prom.query(query, time=t)  # a parse error raises here
        if any(name in expr for name in NOT_PRODUCED_HERE):
            continue
        checked += 1
        if not finite_values(result):
            failures.append(f"{file} / {panel['title']} / {target['refId']}: {query} -> {result}")
    assert not failures, "no data for:\n" + "\n".join(failures)
    assert checked >= 35
