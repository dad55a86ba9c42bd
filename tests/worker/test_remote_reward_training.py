"""The trainer with its reward served over HTTP: the quickstart scored by a real http-json verifier on
127.0.0.1 (behind a secret header) follows the in-process reward curve exactly (same seed), the
validation's pass@k too, and the secret appears in no output, metrics line or checkpoint file."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rljob_api.models import secret_header_env

sys.path.insert(0, str(Path(__file__).parent))
from reward_servers import Verifier
from test_learning import HARNESS, quickstart_spec, read_metrics, rewards

SECRET = "sk-verifier-8c41d0b2e9"


def run(spec: dict, workdir: Path, env: dict | None = None) -> tuple[list[dict], str]:
    """The trainer to completion: (per-step metrics, stdout + stderr)."""
    import os

    workdir.mkdir(parents=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HARNESS), str(workdir / "spec.json"), str(workdir)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})}, check=False)
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(workdir), proc.stdout + proc.stderr


def remote_spec(spec: dict, url: str) -> dict:
    spec = json.loads(json.dumps(spec))
    spec["reward"] = {"remote": {"url": url + "/score", "batchSize": 16, "concurrency": 2, "headersSecretRef": {
        "name": "verifier-key", "headers": {"Authorization": "token"}}}}
    return spec


def assert_secret_nowhere(secret: str, output: str, workdir: Path) -> int:
    assert secret not in output
    files = [p for p in workdir.rglob("*") if p.is_file()]
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
    return len(files)


@pytest.mark.slow
def test_quickstart_scored_over_http_matches_in_process(tmp_path):
    """4 steps and a validation with 4 samples per prompt: the rewards, advantages' effect (the next steps'
    rewards) and pass@k are identical to the in-process reward's; the checkpoint holds no secret."""
    spec = quickstart_spec()
    spec["rollout"].update(valN=4, valTemperature=1.0)
    spec["training"].update(totalTrainingSteps=4, testFreq=4, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=4, exportHf=False)
    server = Verifier(required_headers={"Authorization": f"Bearer {SECRET}"})
    try:
        env = {secret_header_env("verifier-key", "token"): f"Bearer {SECRET}"}
        remote, output = run(remote_spec(spec, server.url), tmp_path / "remote", env)
        local, local_output = run(spec, tmp_path / "local")
    finally:
        server.close()
    np.testing.assert_array_equal(rewards(remote), rewards(local))  # same seed: the same floats
    # validation goes to telemetry and the status, and its log line: reward, accuracy, pass@valN
    validation = [re.sub(r"^.*(validation at step)", r"\1", line) for line in local_output.splitlines()
                  if "validation at step" in line]
    assert len(validation) == 1 and "pass@4 " in validation[0], local_output[-3000:]
    assert validation[0] in output
    first = remote[0]
    # 32 samples in batches of 16, nothing retried; the probe's empty batch is not a scoring request
    assert (first["reward/remote_requests"], first["reward/remote_retries"], first["reward/remote_failures"]) == (2, 0, 0)
    assert first["reward/synthetic/target-token/count"] == 32
    assert first["reward/synthetic/target-token/mean"] == first["reward/mean"]
    assert sorted(set(server.scored.values())) == [1]  # every sample id answered once
    assert len(server.scored) == 4 * 32 + 8 * 4  # 4 steps of 32 samples, one validation of 8 prompts x 4
    ckpt = tmp_path / "remote" / "ckpt"
    assert any(ckpt.rglob("COMMIT")), "the run should have committed a checkpoint to search"
    assert all(r["outcome"] == "ok" for r in server.requests)  # the header came along every time
    assert assert_secret_nowhere(SECRET, output, tmp_path / "remote") > 5  # metrics.jsonl, checkpoint files


@pytest.mark.slow
def test_quickstart_learns_with_its_reward_over_http(tmp_path):
    """The whole quickstart (30 steps) scored by the verifier: the same curve as in-process, which learns."""
    server = Verifier()
    try:
        records, _ = run(remote_spec(quickstart_spec(), server.url), tmp_path / "remote",
                         {secret_header_env("verifier-key", "token"): "unused"})
    finally:
        server.close()
    r = rewards(records)
    assert r[:5].mean() < 0.3 and r[-5:].mean() > 0.9, r


@pytest.mark.slow
def test_remote_faults_during_training_are_counted_and_zeroed(tmp_path):
    """A verifier that fails every try for one batch (onFailure zero) and drops a connection once: the run
    goes on, the failed samples are scored 0 and counted, the retried batch is scored exactly once."""
    spec = quickstart_spec()
    spec["training"].update(totalTrainingSteps=2, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    spec["reward"] = {"remote": {"url": "", "batchSize": 16, "concurrency": 1, "retries": 1, "backoffSeconds": 0.05,
                                 "onFailure": "zero"}}
    server = Verifier()
    # the probe; step 1: the first batch is dropped once, then retried; step 2: the second batch fails both tries
    server.faults = [None, "drop", None, None, None, "500", "500"]
    try:
        spec["reward"]["remote"]["url"] = server.url
        records, output = run(spec, tmp_path / "run")
    finally:
        server.close()
    one, two = records
    assert (one["reward/remote_requests"], one["reward/remote_retries"], one["reward/remote_failures"]) == (3, 1, 0)
    assert (two["reward/remote_retries"], two["reward/remote_failures"], two["reward/remote_zeroed"]) == (1, 16, 16)
    assert "16 of 32 samples of reward route * (remote http://127.0.0.1" in output
    assert "HTTP 500" in output.split("16 of 32 samples of reward route")[1].splitlines()[0]  # the cause
    assert sorted(set(server.scored.values())) == [1] and len(server.scored) == 32 + 16
