"""Fixtures for the observability tests: simulated trainers, the operator metrics exporter, a real Prometheus.

``observed_run`` (session) starts:

- three ``fake_trainer.py`` processes driving the real :class:`TrainerTelemetry`: ``healthy``
  (steps forever), ``diverged`` (the same with NaN reward and loss) and ``sick`` (reward
  collapse, failing checkpoints, then a hang inside a stage), all in namespace ``obs_support.NAMESPACE``;
- ``fake_operator.py``: the operator's real metrics module (``rljob_operator.metrics``) in its own process,
  fed made-up reconciles, API errors and RLJob conditions (the operator itself is not started);
- the REAL Debian Prometheus (``prometheus_server_session`` from tests/conftest.py) scraping
  all of them every second and evaluating a copy of the alert rules whose thresholds are shortened
  by ``obs_support.RULE_REWRITES`` (15 minutes of silence is too long to wait for in a test).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from obs_support import FakeTrainer, ObservedRun, OperatorExporter, write_test_rules


@pytest.fixture(scope="package")  # (this folder is a package: the processes stop after its last test)
def observed_run(prometheus_server_session, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedRun]:
    tmp = tmp_path_factory.mktemp("observability")
    started: list[Any] = []
    try:
        healthy = FakeTrainer("healthy", "healthy", tmp / "healthy.log")
        started.append(healthy)
        diverged = FakeTrainer("diverged", "diverged", tmp / "diverged.log")
        started.append(diverged)
        sick = FakeTrainer("sick", "sick", tmp / "sick.log")
        started.append(sick)
        operator = OperatorExporter(tmp / "operator.log")
        started.append(operator)
        rules = write_test_rules(tmp / "alerts.test.rules.yaml")
        targets = [healthy.target, diverged.target, sick.target, operator.target]
        prom = prometheus_server_session(targets, rule_files=[rules])
        started.append(prom)
        # Every target scraped once: now let the trainers train, so Prometheus sees all their values.
        prom.wait_for(f'count(up{{job="rljob"}} == 1) == {len(targets)}', timeout=30)
        for trainer in (healthy, diverged, sick):
            trainer.go()
        prom.wait_for('count_over_time(rljob_step{rljob="healthy"}[1m]) >= 3', timeout=30)
        yield ObservedRun(prom, healthy, diverged, sick, operator, rules)
    finally:
        for thing in reversed(started):
            thing.stop()
