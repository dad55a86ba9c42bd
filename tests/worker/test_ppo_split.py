"""PPO with the critic in a process pool of its own through `rljob run` (torchrun, gloo on CPU). Split
placement: the actor pool (2 processes) and the critic pool (2 processes at critic TP2, a layout of its own)
of one 4-process world train the same trajectory as shared placement on 2 processes (same rewards, value
losses, explained variance). Shared placement with the critic's own sizes (critic TP2 beside actor DP2):
a critic process beside each actor process, the pools taking turns; SIGKILLed, it resumes onto that same
trajectory, and never from a step folder holding the actor's part without the critic's and without
COMMIT. A SIGTERMed split run saves both pools' parts of the step."""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_learning import logged_steps
from test_parallel_training import job

STEPS = 4
CRITIC = {"lr": 3.0e-3, "microBatchSizePerGpu": 16}
SPLIT = {"gpusPerNode": 4, "critic": {**CRITIC, "placement": "split", "gpus": 2,  # actor DP2 + critic TP2
                                      "megatron": {"tensorModelParallelSize": 2}}}
SHARED = {"gpusPerNode": 2, "critic": dict(CRITIC)}  # actor DP2 and critic DP2 in the same 2 processes
# Trinity's case: shared, the critic at sizes of its own (TP2 beside actor DP2): 2 actor + 2 critic processes
# on 2 "GPUs", each pool offloading its state between turns (on CPU the offload checks state only).
OFFLOAD = {"paramOffload": True, "gradOffload": True, "optimizerOffload": True}
TURNS = {"gpusPerNode": 2, "megatron": dict(OFFLOAD),
         "critic": {**CRITIC, "megatron": {"tensorModelParallelSize": 2, **OFFLOAD}}}


def ppo_doc(name: str, layout: dict) -> dict:
    doc = job(name, **{"algorithm.advantageEstimator": "gae", "training.totalTrainingSteps": STEPS,
                       "checkpoint.saveFreq": 2, "checkpoint.exportCritic": True})
    doc["spec"].update(json.loads(json.dumps(layout)))
    return doc


def launch(doc: dict, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    work = tmp_path / doc["metadata"]["name"]
    proc = subprocess.Popen([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(work),
                             "--checkpoint-uri", f"file://{tmp_path}/ckpt"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, work


def finish(proc: subprocess.Popen, work: Path) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def by_step(work: Path) -> dict[int, dict]:
    """The last metrics line of each step (a resumed run repeats the steps after its checkpoint)."""
    return {r["step"]: r for r in map(json.loads, (work / "work" / "metrics.jsonl").read_text().splitlines())}


def breakdown(records: dict[int, dict], label: str) -> str:
    rows = list(records.values())[1:] or list(records.values())  # step 1 pays for warm-up

    def median_ms(key: str) -> str:
        values = [r[key] for r in rows if key in r]
        return f"{statistics.median(values) * 1e3:.0f} ms" if values else "-"

    return (f"{label}: step {median_ms('timing/step_s')}, actor update {median_ms('timing/actor_update_s')}, "
            f"critic update {median_ms('timing/critic_update_s')}, critic values {median_ms('timing/critic_values_s')}, "
            f"actor waiting for the critic {median_ms('timing/critic_wait_s')}")


def assert_same_trajectory(ref: dict[int, dict], got: dict[int, dict]) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step, a in ref.items():
        b = got[step]
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6), step
        assert b["critic/value_loss"] == pytest.approx(a["critic/value_loss"], rel=1e-4, abs=1e-6), step
        assert b["critic/explained_variance"] == pytest.approx(a["critic/explained_variance"], abs=1e-4), step
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-3), step


def assert_critic_exported(prefix: Path) -> None:
    """checkpoint.exportCritic: <job prefix>/hf-critic/ holds a one-label token classifier (the critic's layers
    and its value head as `score`) with the tokenizer; test_megatron_critic.py checks that it gives the values."""
    from safetensors import safe_open

    export = prefix / "hf-critic"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and len(config["id2label"]) == 1, config
    with safe_open(export / "model.safetensors", "pt") as f:
        assert tuple(f.get_tensor("score.weight").shape) == (1, config["hidden_size"])
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.norm.weight" in names
    assert (export / "tokenizer_config.json").exists()


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("ppo-shared")
    proc, work = launch(ppo_doc("ppo-shared", SHARED), tmp)
    finish(proc, work)
    assert_critic_exported(tmp / "ckpt" / "default" / "ppo-shared")  # the critic in the actor's processes
    return by_step(work)


def wait_for_step(proc: subprocess.Popen, work: Path, step: int) -> None:
    log, deadline = work / "work" / "metrics.jsonl", time.monotonic() + 300
    while not any(s >= step for s in logged_steps(log)):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.05)


def test_split_placement_trains_the_shared_trajectory(tmp_path, shared_run):
    proc, work = launch(ppo_doc("ppo-split", SPLIT), tmp_path)
    assert "4 process(es)" in finish(proc, work)
    split = by_step(work)
    print()
    print(breakdown(shared_run, "shared (2 processes, taking turns)"))
    print(breakdown(split, "split (actor 2 + critic 2 processes at TP2)"))
    assert_same_trajectory(shared_run, split)
    for key in ("critic/value_clip_fraction", "critic/vpred_mean", "critic/grad_norm", "critic/update_s",
                "timing/critic_values_s", "timing/critic_update_s", "timing/critic_wait_s"):
        assert key in split[STEPS], key
    step = tmp_path / "ckpt" / "default" / "ppo-split" / f"step_{STEPS:06d}"
    assert (step / "COMMIT").exists() and any((step / "critic").iterdir())  # one COMMIT covers both pools
    assert_critic_exported(step.parent)  # written by the critic pool, uploaded by the actor leader


def test_killed_shared_run_with_its_own_critic_sizes_takes_turns_and_resumes_onto_the_same_trajectory(
        tmp_path, shared_run):
    """Shared placement, critic TP2 beside actor DP2: `rljob run` starts 4 processes on the 2 "GPUs". SIGKILL
    after step 3 (step 2 committed); a step-3 folder holding the actor's part only and no COMMIT (a save cut
    short before the critic pool wrote its part); `rljob run` again resumes from step 2, never from the
    half-written step 3, and every step's reward and value loss match the single-process shared run's. The
    pools take turns: the actor pool waits out every critic command (its wait covers the critic's values
    and update, where split placement overlaps them with the actor's work)."""
    doc = ppo_doc("ppo-turns", TURNS)
    proc, work = launch(doc, tmp_path)
    wait_for_step(proc, work, 3)
    proc.kill()  # SIGKILL: `rljob run`'s guard then SIGKILLs every process of the run
    proc.communicate()
    prefix = tmp_path / "ckpt" / "default" / "ppo-turns"
    assert (prefix / "step_000002" / "COMMIT").exists() and any((prefix / "step_000002" / "critic").iterdir())
    half = prefix / "step_000003"
    shutil.copytree(prefix / "step_000002", half, ignore=shutil.ignore_patterns("critic", "COMMIT"))
    state = json.loads((half / "trainer_state.json").read_text())
    (half / "trainer_state.json").write_text(json.dumps({**state, "step": 3}))

    proc, work = launch(doc, tmp_path)
    out = finish(proc, work)
    assert "resumed from step 2" in out and "1 pod(s) x 4 process(es)" in out, out[-3000:]
    resumed = by_step(work)
    assert_same_trajectory(shared_run, resumed)
    assert_critic_exported(prefix)
    print()
    print(breakdown(resumed, "shared, critic at its own TP2 (actor 2 + critic 2 processes, taking turns)"))
    for step in range(3, STEPS + 1):  # the resumed steps: the actor pool's wait contains the critic's work
        r = resumed[step]
        # the wait counts from each command's hand-over, so each of the critic's two turns lies inside it
        assert r["timing/critic_wait_s"] > r["timing/critic_values_s"] + r["critic/update_s"], r


def test_sigterm_saves_both_pools_parts_of_the_step(tmp_path):
    """SIGTERM to the run (kubelet's preemption): every rank gets it; the critic ranks note it and keep
    serving, the actor side finishes the step, has the critic pool write its part, commits the step and
    exits 143 (retryable). Resuming from such a step is the SIGKILL test's second half."""
    layout = {"gpusPerNode": 2, "critic": {**CRITIC, "placement": "split", "gpus": 1}}  # actor 1 + critic 1
    doc = ppo_doc("ppo-split-term", layout)
    doc["spec"]["checkpoint"]["saveFreq"] = 10  # only the preemption save
    proc, work = launch(doc, tmp_path)
    wait_for_step(proc, work, 1)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:]
    assert "critic pool: signal 15 noted" in out and "Traceback" not in out, out[-3000:]
    commits = sorted((tmp_path / "ckpt" / "default" / "ppo-split-term").glob("step_*/COMMIT"))
    assert len(commits) == 1 and any((commits[0].parent / "critic").iterdir()), out[-3000:]
    assert 1 <= int(commits[0].parent.name.split("_")[1]) < STEPS
