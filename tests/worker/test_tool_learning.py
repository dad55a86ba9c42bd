"""The tool task learns on a CPU: a real multi-turn GRPO run of examples/secret-tool.yaml (tiny model, function
tool, agent loop, loss masks, the whole trainer). The secret is drawn independently of the prompt, so the
reward can only rise through the tool: it starts near chance and the share of trajectories that call the
tool rises with it."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_learning import REPO, run_trainer


def secret_tool_spec() -> dict:
    spec = yaml.safe_load((REPO / "examples" / "secret-tool.yaml").read_text())["spec"]
    spec["training"].update(testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    spec["metrics"] = {"enabled": False}
    return spec


@pytest.mark.slow
def test_secret_tool_task_learns_to_call_the_tool(tmp_path):
    records = run_trainer(secret_tool_spec(), tmp_path, timeout=1800)  # ~2 min on 2 idle cores
    reward = np.array([r["reward/mean"] for r in records])
    calls = np.array([r["tool/trajectories_with_call"] for r in records])
    assert reward[:3].mean() < 0.2, reward  # near chance: the tool is needed and not yet used well
    assert reward[-5:].mean() >= 0.9, reward
    assert calls[-5:].mean() > calls[:3].mean() + 0.2, calls
    assert all(r["tool/errors"] == 0 for r in records)  # the secret tool never fails
