"""The launcher's PyTorchJob-shaped path on CPU: TP2 and PP2 in one pod and DP2 across two pods train
the same trajectory as one process (same samples, same rewards) and commit checkpoints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from megatron_helpers import free_port  # a helper module beside this file

REPO = Path(__file__).resolve().parents[2]


def job(name: str, **changes) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["training"].update(totalTrainingSteps=12, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=6, exportHf=False)
    spec["metrics"]["port"] = free_port()  # one the kernel has free now (a hashed port collided with a live one in CI)
    for path, value in changes.items():
        section, _, field = path.rpartition(".")
        target = spec
        for part in filter(None, section.split(".")):
            target = target.setdefault(part, {})
        target[field] = value
    return doc


def run_job(doc: dict, tmp_path: Path) -> list[dict]:
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    work = tmp_path / doc["metadata"]["name"]
    proc = subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(work),
                           "--checkpoint-uri", f"file://{tmp_path}/ckpt"], check=False, capture_output=True,
                          text=True, timeout=900)
    logs = "".join(p.read_text() for p in work.glob("pod-*.log"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs[-3000:]}"
    commits = sorted((tmp_path / "ckpt" / "default" / doc["metadata"]["name"]).glob("step_*/COMMIT"))
    assert [c.parent.name for c in commits] == ["step_000006", "step_000012"]
    records = [json.loads(line) for line in (work / "work" / "metrics.jsonl").read_text().splitlines()]
    return records


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return run_job(job("single"), tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("layout", [
    {"gpusPerNode": 2, "megatron.tensorModelParallelSize": 2},  # TP2 in one pod (two gloo processes)
    {"nnodes": 2, "training.trainBatchSizePerNode": 2, "training.ppoMiniBatchSizePerNode": 2},  # DP2 over two pods
    {"gpusPerNode": 2, "megatron.pipelineModelParallelSize": 2},  # PP2 in one pod: one layer per stage
    # DP2 with token-budget micro-batches (two or more per rank) and token-balanced rows per rank
    {"nnodes": 2, "training.trainBatchSizePerNode": 2, "training.ppoMiniBatchSizePerNode": 2,
     "training.maxTokensPerMicroBatch": 64},
], ids=["tp2", "two-pods-dp2", "pp2", "two-pods-dp2-token-budget"])
def test_parallel_layout_trains_the_same_trajectory(tmp_path, single_process, layout):
    records = run_job(job("parallel", **layout), tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    for ref, got in zip(single_process, records):
        assert got["reward/mean"] == pytest.approx(ref["reward/mean"], abs=1e-6), (ref["step"], ref, got)
        assert got["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-3)
