"""reward.numWorkers > 0 scores in worker processes: results match inline scoring, and a hanging
reward function fails the step with a message naming the sample and reward.timeoutSeconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_learning import HARNESS, quickstart_spec, rewards, run_trainer


def spec_with(tmp_path: Path, reward: str, **reward_fields) -> dict:
    spec = quickstart_spec()
    spec["training"].update(totalTrainingSteps=3, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    spec["reward"] = {"function": reward, **reward_fields}
    return spec


def test_reward_workers_match_inline(tmp_path):
    inline = rewards(run_trainer(spec_with(tmp_path, "target-token"), tmp_path / "inline"))
    pooled = rewards(run_trainer(spec_with(tmp_path, "target-token", numWorkers=2), tmp_path / "pooled"))
    assert list(pooled) == list(inline)


@pytest.mark.parametrize("workers", [0, 1])
def test_hanging_reward_times_out_with_a_clear_error(tmp_path, workers):
    """With a worker pool and with the default numWorkers 0 (inline) alike."""
    (tmp_path / "slow_reward.py").write_text("import time\n\ndef score(p, c, t, e):\n    time.sleep(60)\n    return 0.0\n")
    spec = spec_with(tmp_path, "slow_reward:score", numWorkers=workers, timeoutSeconds=1.0)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(HARNESS), str(tmp_path / "spec.json"), str(tmp_path / "w")],
                          check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "timed out" in proc.stderr and "spec.reward.timeoutSeconds" in proc.stderr and "sample 0" in proc.stderr


def test_nan_rewards_are_counted_and_a_run_that_cannot_learn_fails(tmp_path):
    """A reward returning NaN for every sample used to skip every update and exit 0."""
    (tmp_path / "nan_reward.py").write_text("def score(p, c, t, e):\n    return float('nan')\n")
    spec = spec_with(tmp_path, "nan_reward:score")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rljob_worker", "--spec", str(tmp_path / "spec.json")],
                          check=False, capture_output=True, text=True, timeout=600,
                          env={**env, "RLJOB_WORKDIR": str(tmp_path / "w"), "RLJOB_METRICS_PORT": "0",
                               "RLJOB_CHECKPOINT_URI": f"file://{tmp_path}/ckpt"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "3 steps in a row could not learn" in proc.stderr and "every reward was NaN/Inf" in proc.stderr
    steps = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [s["reward/nonfinite_count"] for s in steps] == [s["reward/samples"] for s in steps] != []
    assert len(steps) == 3
