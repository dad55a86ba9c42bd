"""The alert rules file: promtool checks it, promtool unit-tests it at its real thresholds, and a real
Prometheus evaluates it (thresholds shortened, see obs_support.RULE_REWRITES) against simulated trainers."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from obs_support import EXPECTED_FIRING, HERE, RULE_REWRITES, RULES_FILE, load_rules, wait_until


def alert_names() -> list[str]:
    return [r["alert"] for r in load_rules() if "alert" in r]


def test_promtool_check_rules(promtool_bin):
    out = subprocess.run([promtool_bin, "check", "rules", str(RULES_FILE)], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in out.stdout


def test_promtool_unit_tests_at_real_thresholds(promtool_bin):
    out = subprocess.run([promtool_bin, "test", "rules", "alerts_test.yaml"], cwd=HERE, check=False, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_unit_test_and_a_live_check():
    tested = {case["alertname"] for test in yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
              for case in test.get("alert_rule_test", [])}
    fired_in_unit_tests = {case["alertname"] for test in yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
                           for case in test.get("alert_rule_test", []) if case.get("exp_alerts")}
    names = alert_names()
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) == tested == fired_in_unit_tests
    assert set(names) == set(RULE_REWRITES) == set(EXPECTED_FIRING)


def test_rules_are_well_formed():
    for rule in load_rules():
        assert rule["alert"].startswith("RLJob"), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        # Worker alerts name the job; the expression must keep the rljob/namespace labels.
        if "rljob_operator_" not in rule["expr"]:
            assert "$labels.rljob" in rule["annotations"]["summary"], rule["alert"]


def test_every_rule_evaluates_on_real_data_and_fires_where_expected(observed_run):
    """Each alert expression runs on a real Prometheus against the simulated trainers (and the operator
    metrics exporter), returns data where its condition holds, and stays quiet for the healthy run."""
    prom = observed_run.prom

    def firing() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {name: set() for name in RULE_REWRITES}
        for alert in prom.alerts():
            if alert["state"] == "firing":
                out.setdefault(alert["labels"]["alertname"], set()).add(alert["labels"].get("rljob", ""))
        return out

    # The slowest is the checkpoint alert: 3 x the 2 s floor after the sick run's only checkpoint.
    seen = wait_until(lambda: (f := firing()) == EXPECTED_FIRING and f, timeout=40, what=f"alerts {EXPECTED_FIRING}",
                      last=firing)
    assert seen == EXPECTED_FIRING
    for group in prom.rules():
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    # Evaluated a few more times, the healthy run still fires nothing (no flapping into alerts).
    time.sleep(3)
    assert firing() == EXPECTED_FIRING


def test_stalled_trainer_fires_the_stall_expression(observed_run):
    """The brief's stall test, on the production expression with only its threshold shortened:
    the sick trainer hangs inside actor_update without heartbeats; the healthy one keeps beating."""
    prom = observed_run.prom
    (rule,) = [r for r in load_rules() if r.get("alert") == "RLJobTrainingStalled"]
    expr = rule["expr"]
    for old, new in RULE_REWRITES["RLJobTrainingStalled"]:
        expr = expr.replace(old, new)
    result = prom.wait_for(expr, timeout=30)
    assert {r["metric"]["rljob"] for r in result} == {"sick"}
    assert float(result[0]["value"][1]) > 5
    # It is stuck in actor_update, and says so.
    active = prom.query('rljob_stage_active{rljob="sick"} == 1')
    assert [r["metric"]["stage"] for r in active] == ["actor_update"]
    # The unshortened production rule does not fire yet (the hang is seconds old, not 15 minutes).
    assert prom.query(rule["expr"]) == []
