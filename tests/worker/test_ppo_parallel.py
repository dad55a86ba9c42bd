"""PPO (a shared critic) through the launcher's PyTorchJob-shaped path on CPU: TP2 (actor and critic)
and DP2 in one pod train the same trajectory as one process: same rewards, value losses and explained
variance (advantages are whitened over each mini-batch across the data-parallel ranks)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel_training import job, run_job

CRITIC = {"lr": 3.0e-3, "microBatchSizePerGpu": 16}


def ppo_job(name: str, **changes) -> dict:
    doc = job(name, **{"algorithm.advantageEstimator": "gae", **changes})
    doc["spec"]["critic"] = {**CRITIC, **doc["spec"].get("critic", {})}
    return doc


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return run_job(ppo_job("ppo-single"), tmp_path_factory.mktemp("ppo-single"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    {"gpusPerNode": 2, "megatron.tensorModelParallelSize": 2, "critic.megatron.tensorModelParallelSize": 2},
    {"gpusPerNode": 2},  # DP2: each rank half of every mini-batch
], ids=["tp2", "dp2"])
def test_ppo_parallel_layout_trains_the_same_trajectory(tmp_path, single_process, layout):
    records = run_job(ppo_job("ppo-parallel", **layout), tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    for ref, got in zip(single_process, records):
        assert got["reward/mean"] == pytest.approx(ref["reward/mean"], abs=1e-6), (ref["step"], ref, got)
        assert got["critic/value_loss"] == pytest.approx(ref["critic/value_loss"], rel=1e-4, abs=1e-6)
        assert got["critic/explained_variance"] == pytest.approx(ref["critic/explained_variance"], abs=1e-4)
        assert got["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-3)
