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
from test_learning import HARNESS, quickstart_spec, rewards, run_trainer  # noqa: E402


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
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "timed out" in proc.stderr and "spec.reward.timeoutSeconds" in proc.stderr and "sample 0" in proc.stderr
