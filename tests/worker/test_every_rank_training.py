"""Every-rank rollout in real GRPO runs on gloo processes (spec.rollout.ranks: every-rank).

The trainer runs under torchrun (DP2 on 2 processes; TP2 x DP2 on 4) and every rank's hf engine
samples its own share of whole prompt groups. The harness records what each rank's engine was asked
and returned, and the batch the estimator is built from, so the tests check, step by step: the
ranks' prompts are disjoint contiguous shares that together are the batch, in rank order; all n
samples of a prompt come from one rank, unchanged and in place (rows i*n .. i*n+n-1); the ranks
sample with different seeds; and the target-token reward rises as in the one-process run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from rljob_worker.rollout.every_rank import prompt_shares

sys.path.insert(0, str(Path(__file__).parent))
from megatron_helpers import free_port  # a helper module beside this file

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("trainer_harness.py")
N = 8  # samplesPerPrompt in the quickstart


def every_rank_spec(nproc: int, prompts: int, **megatron) -> dict:
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())["spec"]
    spec["gpusPerNode"] = nproc
    spec["rollout"]["ranks"] = "every-rank"
    spec["megatron"].update(megatron)
    spec["training"].update(trainBatchSizePerNode=prompts, ppoMiniBatchSizePerNode=prompts, microBatchSizePerGpu=8)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    spec["metrics"]["enabled"] = False
    return spec


def run_torchrun(spec: dict, workdir: Path, nproc: int) -> list[dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(HARNESS), str(workdir / "spec.json"), str(workdir), "--record-rollouts"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, check=False)
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_shares_and_groups(workdir: Path, nproc: int, prompts: int, steps: int) -> None:
    every_call = [call for rank in range(nproc) for call in jsonl(workdir / f"rollouts_rank{rank}.jsonl")]
    # the bound the engine was built with (vLLM's CUDA graphs) holds every call's rows, validation's too
    assert all(len(c["prompts"]) * c["n"] <= c["max_rows"] for c in every_call), [
        (len(c["prompts"]), c["n"], c["max_rows"]) for c in every_call]
    per_rank = [[r for r in jsonl(workdir / f"rollouts_rank{rank}.jsonl") if r["n"] == N] for rank in range(nproc)]
    batches = jsonl(workdir / "estimator_batches.jsonl")
    assert len(batches) == steps and all(len(calls) == steps for calls in per_rank)
    shares = prompt_shares(prompts, nproc)
    for step, batch in enumerate(batches):
        group_prompts = batch["prompts"][::N]
        assert len(group_prompts) == prompts and len(batch["responses"]) == prompts * N
        calls = [per_rank[rank][step] for rank in range(nproc)]
        # disjoint shares that cover the batch: rank r sampled exactly the prompts at positions shares[r]
        for rank, (call, share) in enumerate(zip(calls, shares)):
            assert call["prompts"] == group_prompts[share], (step, rank)
        # a group is never split: all n samples of prompt i are its owner's n samples, in place and in order
        for rank, (call, share) in enumerate(zip(calls, shares)):
            for j, i in enumerate(range(share.start, share.stop)):
                assert batch["prompts"][i * N:(i + 1) * N] == [group_prompts[i]] * N
                assert batch["responses"][i * N:(i + 1) * N] == call["responses"][j * N:(j + 1) * N], (step, rank, i)
        seeds = [c["seed"] for c in calls]
        assert len(set(seeds)) == nproc, seeds  # each replica its own stream


def check_learns(records: list[dict]) -> None:
    r = np.array([rec["reward/mean"] for rec in records])
    assert len(r) == 30
    assert r[:5].mean() < 0.3, r
    assert r[-5:].mean() > 0.8, r
    assert all(rec["actor/grad_norm"] > 0 for rec in records[:10])


def test_every_rank_rollout_dp2_learns_with_disjoint_whole_group_shares(tmp_path):
    records = run_torchrun(every_rank_spec(2, prompts=4), tmp_path, nproc=2)
    check_shares_and_groups(tmp_path, nproc=2, prompts=4, steps=30)
    check_learns(records)
    # validation ran on both ranks too (greedy, one sample per prompt), each on its share of the 8 prompts
    val = [[r for r in jsonl(tmp_path / f"rollouts_rank{rank}.jsonl") if r["n"] == 1] for rank in range(2)]
    assert [len(v[0]["prompts"]) for v in val] == [4, 4]


@pytest.mark.slow
def test_every_rank_rollout_tp2_dp2_learns_with_uneven_shares(tmp_path):
    """Four processes, TP2 x DP2: four engines (the two TP ranks of a replica sample different prompts);
    6 prompts make uneven shares (2, 2, 1, 1)."""
    records = run_torchrun(every_rank_spec(4, prompts=6, tensorModelParallelSize=2), tmp_path, nproc=4)
    check_shares_and_groups(tmp_path, nproc=4, prompts=6, steps=30)
    check_learns(records)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_every_rank_rollout_on_two_gpus_learns_and_reports_stage_memory(tmp_path):
    """The same DP2 run on two GPUs in bf16: the static-cache engine on each GPU (released after every
    rollout), the same share and group checks, learning, and per-stage peak memory in the step metrics."""
    spec = every_rank_spec(2, prompts=4)
    spec["device"] = "gpu"
    spec["model"]["dtype"] = "bfloat16"
    records = run_torchrun(spec, tmp_path, nproc=2)
    check_shares_and_groups(tmp_path, nproc=2, prompts=4, steps=30)
    check_learns(records)
    for key in ("memory/rollout_peak_gib", "memory/actor_update_peak_gib", "memory/weight_sync_peak_gib"):
        assert all(0 < rec[key] < 80 for rec in records), key


def test_every_rank_agent_loop_runs_each_share_and_its_tools_on_its_own_rank(tmp_path, monkeypatch):
    """Multi-turn rollouts with every-rank hf engines (the default on GPUs): each rank runs the agent loop over
    its share of whole prompt groups (first turns and later turns alike), runs the tool calls of its own
    trajectories once (no rank repeats another's), and the gathered trajectories are the batch in prompt order."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_tool_learning import secret_tool_spec

    prompts, n, steps = 3, 4, 3
    spec = secret_tool_spec()
    spec["gpusPerNode"] = 2
    spec["rollout"].update(ranks="every-rank", samplesPerPrompt=n)
    spec["tools"][0]["function"] = "agent_tools:logged_secret"
    spec["training"].update(trainBatchSizePerNode=prompts, ppoMiniBatchSizePerNode=prompts, microBatchSizePerGpu=6,
                            totalTrainingSteps=steps)
    monkeypatch.setenv("RLJOB_TEST_TOOL_LOG", str(tmp_path / "tool_calls.jsonl"))
    records = run_torchrun(spec, tmp_path / "run", nproc=2)
    batches = jsonl(tmp_path / "run" / "estimator_batches.jsonl")
    calls = [jsonl(tmp_path / "run" / f"rollouts_rank{rank}.jsonl") for rank in range(2)]
    shares = prompt_shares(prompts, 2)
    firsts = [[c for c in rank_calls if c["n"] == n] for rank_calls in calls]
    assert len(batches) == steps and all(len(f) == steps for f in firsts)
    owners = {}
    for step, batch in enumerate(batches):
        groups = batch["prompts"][::n]
        for rank, share in enumerate(shares):
            assert firsts[rank][step]["prompts"] == groups[share]
            for j, i in enumerate(range(share.start, share.stop)):  # each trajectory opens with its first turn
                for k in range(n):
                    first = firsts[rank][step]["responses"][j * n + k]
                    assert batch["responses"][i * n + k][:len(first)] == first
            owners.update({tuple(p): rank for p in groups[share]})
    later = 0
    for rank, rank_calls in enumerate(calls):  # later turns: contexts of the rank's own trajectories only
        for context in (p for c in rank_calls if c["n"] == 1 for p in c["prompts"]):
            assert [owner for prompt, owner in owners.items() if tuple(context[:len(prompt)]) == prompt] == [rank]
            later += 1
    assert later > 0
    log = jsonl(tmp_path / "tool_calls.jsonl")
    assert len(log) == sum(r["tool/calls"] for r in records) > 0  # every call ran once, on one rank
    assert {entry["rank"] for entry in log} == {0, 1}
