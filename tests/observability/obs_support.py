"""Helpers of the observability tests (imported by conftest.py and the test modules).

Constants (paths, the live test's rule rewrites and expected alerts), the simulated trainer
process (:class:`FakeTrainer`, running ``fake_trainer.py``), the operator's metrics exporter fed
made-up reconciles (:class:`OperatorExporter`) and dashboard helpers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RULES_FILE = REPO / "charts" / "rljob-operator" / "files" / "alerts.rules.yaml"
DASHBOARD_DIR = REPO / "charts" / "rljob-operator" / "dashboards"
DASHBOARD_FILES = sorted(DASHBOARD_DIR.glob("*.json"))
NAMESPACE = "ml-test"

#: Per alert: (text in the expression, its replacement) pairs and the ``for`` used in the live test.
#: Only durations and thresholds change, never the shape of the expression. Each text must occur
#: in the rule (a test checks), so changing a rule without looking here fails loudly.
RULE_REWRITES: dict[str, list[tuple[str, str]]] = {
    "RLJobTrainingStalled": [("> 900", "> 5")],
    "RLJobRewardNotFinite": [],
    "RLJobLossNotFinite": [],
    "RLJobRewardCollapsed": [("[10m]", "[3s]"), ("[2h]", "[5m]")],
    "RLJobNoRewardSignal": [("[30m]", "[3s]")],
    "RLJobCheckpointOverdue": [("300)", "2)")],
    "RLJobFailed": [],
    "RLJobOperatorErrors": [],
}

#: Who each alert must fire for in the live test: the value of label ``rljob``, or "" for the
#: operator-level alerts, which carry no job.
EXPECTED_FIRING: dict[str, set[str]] = {
    "RLJobTrainingStalled": {"sick"},
    "RLJobRewardNotFinite": {"diverged"},
    "RLJobLossNotFinite": {"diverged"},
    "RLJobRewardCollapsed": {"sick"},
    "RLJobNoRewardSignal": {"sick"},
    "RLJobCheckpointOverdue": {"sick"},
    "RLJobFailed": {""},
    "RLJobOperatorErrors": {""},
}


def load_rules(path: Path = RULES_FILE) -> list[dict[str, Any]]:
    """All rules of a rules file, flattened over groups."""
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def write_test_rules(dest: Path) -> Path:
    """A copy of the alert rules with RULE_REWRITES applied and every ``for`` set to 0s."""
    doc = yaml.safe_load(RULES_FILE.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert")
            if name is None:
                continue
            if name not in RULE_REWRITES:
                raise AssertionError(f"alert {name} has no entry in RULE_REWRITES (tests/observability/obs_support.py)")
            for old, new in RULE_REWRITES[name]:
                if old not in rule["expr"]:
                    raise AssertionError(f"{name}: {old!r} no longer occurs in its expression:\n{rule['expr']}")
                rule["expr"] = rule["expr"].replace(old, new)
            rule["for"] = "0s"
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


# --------------------------------------------------------------------------- simulated trainers


class ExporterProcess:
    """A test script in its own process group that prints ``PORT <n>`` once it serves /metrics."""

    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env, start_new_session=True)
        self.port = self._read_port(timeout=30)

    def _read_port(self, timeout: float) -> int:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = result[0] if result else ""
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"{self.name} did not print its port (got {line!r}); "
                               f"log:\n{self.log_path.read_text()[-3000:]}")
        return int(line.split()[1])

    def go(self) -> None:
        """Send the line the script waits for before it starts its work."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


class FakeTrainer(ExporterProcess):
    """``fake_trainer.py --mode MODE``: the real TrainerTelemetry driven with sleeps; trains after go()."""

    def __init__(self, job: str, mode: str, log_path: Path):
        self.job, self.mode = job, mode
        super().__init__(f"fake trainer {job}", [str(HERE / "fake_trainer.py"), "--job", job, "--namespace",
                                                 NAMESPACE, "--mode", mode], log_path)


class OperatorExporter(ExporterProcess):
    """``fake_operator.py``: the operator's REAL metrics module fed made-up reconciles (own process, so
    the pytest process's default registry, which operator tests read, is left alone)."""

    def __init__(self, log_path: Path):
        super().__init__("operator metrics", [str(HERE / "fake_operator.py")], log_path)


@dataclasses.dataclass
class ObservedRun:
    """What the ``observed_run`` fixture started (see conftest.py)."""

    prom: Any  # tests/conftest.py PrometheusServer
    healthy: FakeTrainer
    diverged: FakeTrainer
    sick: FakeTrainer
    operator: OperatorExporter
    rules_path: Path


def wait_until(check, timeout: float, interval: float = 0.25, what: str = "condition", last=None):
    """Poll check() until truthy; return its value, or fail naming ``what`` (and ``last()``, if given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}"
                        + (f"; last seen: {last()}" if last is not None else ""))
        time.sleep(interval)


# --------------------------------------------------------------------------- dashboards

#: A Grafana variable reference: ${name}, ${name:format}, $name or [[name]].
VAR_REF = re.compile(r"\$\{(\w+)(?::[\w]+)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")
#: Grafana's interval variables as the live tests fill them in (scrapes every second: 1m is plenty).
RATE_SUBSTITUTIONS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows keep their panels inside
    return out


def dashboard_targets() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(file name, panel, target) for every query of every dashboard."""
    return [(path.name, panel, target) for path in DASHBOARD_FILES for panel in all_panels(load_dashboard(path))
            for target in panel.get("targets", [])]


def strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return []


def substitute_vars(expr: str, values: dict[str, str]) -> str:
    """Replace every variable reference by its value (KeyError for a variable not in ``values``)."""
    return VAR_REF.sub(lambda m: values[m.group(1) or m.group(2) or m.group(3)], expr)


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [v for r in result if math.isfinite(v := float(r["value"][1]))]
