"""A killed or preempted worker resumes from its last committed checkpoint and continues
exactly where it stopped (same batches, same samples, same rewards), on real S3."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_learning import HARNESS, logged_steps, quickstart_spec, read_metrics

EXIT_PREEMPTED = 143


def short_spec(steps: int = 16, save_freq: int = 6) -> dict:
    spec = quickstart_spec()
    spec["training"].update(totalTrainingSteps=steps, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=save_freq, maxToKeep=2, exportHf=False)
    return spec


def start(spec: dict, workdir: Path, checkpoint_uri: str, env: dict | None = None) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    return subprocess.Popen(
        [sys.executable, str(HARNESS), str(workdir / "spec.json"), str(workdir), "--checkpoint-uri", checkpoint_uri],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for_step(workdir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    log = workdir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if any(s >= step for s in logged_steps(log)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early ({proc.returncode}): {proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def rewards_by_step(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["reward/mean"] for r in read_metrics(workdir)}


def committed_steps(s3, bucket: str, prefix: str) -> list[int]:
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]
    return sorted(int(k.split("/")[-2].split("_")[1]) for k in keys if k.endswith("/COMMIT"))


def run_straight_and_crashed(spec: dict, root: Path, uri_prefix: str, kill_after: int, env: dict | None = None,
                             after_kill=lambda: None) -> tuple[Path, Path, str]:
    """The job run straight through under <uri_prefix>/straight, then again under <uri_prefix>/crashed, SIGKILLed
    (no chance to save) once step ``kill_after`` is logged, ``after_kill()`` called, and restarted to the end.
    Returns both work folders and the restarted run's output; both runs must exit 0."""
    straight, crashed = root / "straight", root / "crashed"
    code, out = finish(start(spec, straight, f"{uri_prefix}/straight", env))
    assert code == 0, out[-3000:]
    proc = start(spec, crashed, f"{uri_prefix}/crashed", env)
    wait_for_step(crashed, kill_after, proc)
    proc.kill()
    proc.wait()
    after_kill()
    code, out = finish(start(spec, crashed, f"{uri_prefix}/crashed", env))
    assert code == 0, out[-3000:]
    return straight, crashed, out


def assert_same_rewards(straight: Path, crashed: Path, steps: int) -> None:
    a, b = rewards_by_step(straight), rewards_by_step(crashed)
    assert sorted(b) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert b[step] == pytest.approx(a[step], abs=1e-6), f"step {step}: {a[step]} straight vs {b[step]} resumed"


@pytest.mark.services
def test_killed_worker_resumes_exactly(tmp_path, s3_server, s3_bucket):
    def only_step_6_committed():
        assert committed_steps(s3_server.client(), s3_bucket, "crashed/") == [6]

    straight, crashed, out = run_straight_and_crashed(  # killed past the step-6 checkpoint
        short_spec(), tmp_path, f"s3://{s3_bucket}", 8, s3_server.env(), after_kill=only_step_6_committed)
    assert "resumed from step 6" in out
    assert_same_rewards(straight, crashed, 16)
    assert committed_steps(s3_server.client(), s3_bucket, "crashed/") == [12, 16]  # maxToKeep 2


def test_killed_lora_worker_resumes_exactly(tmp_path):
    """spec.lora with a reference (klCoef > 0: the base with adapters off): SIGKILL after the step-4 save;
    the resumed run's rewards and its final PEFT adapter equal the uninterrupted run's bit for bit."""
    from safetensors.torch import load_file

    spec = short_spec(steps=10, save_freq=4)
    spec["lora"] = {"rank": 8, "alpha": 16}
    spec["algorithm"]["klCoef"] = 0.001
    spec["training"]["lr"] = 2e-2
    spec["checkpoint"]["exportHf"] = True
    straight, crashed, out = run_straight_and_crashed(spec, tmp_path, f"file://{tmp_path}", 6)  # past step 4's save
    assert "resumed from step 4" in out
    assert_same_rewards(straight, crashed, 10)
    want = load_file(next((tmp_path / "straight").rglob("hf/adapter_model.safetensors")))
    got = load_file(next((tmp_path / "crashed").rglob("hf/adapter_model.safetensors")))
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_sigterm_saves_and_resumes(tmp_path):
    spec = short_spec(steps=12, save_freq=100)  # no periodic save before the end
    uri = f"file://{tmp_path}/ckpt"
    work = tmp_path / "run"
    proc = start(spec, work, uri)
    wait_for_step(work, 3, proc)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == EXIT_PREEMPTED, out[-3000:]
    stopped_at = max(rewards_by_step(work))
    assert stopped_at < 12
    commit = tmp_path / "ckpt" / "test" / "test" / f"step_{stopped_at:06d}" / "COMMIT"
    assert commit.exists(), f"no committed checkpoint at step {stopped_at}: {out[-2000:]}"

    code, out = finish(start(spec, work, uri))
    assert code == 0, out[-3000:]
    assert f"resumed from step {stopped_at}" in out
    assert sorted(rewards_by_step(work)) == list(range(1, 13))


def test_wrong_s3_credentials_fail_at_startup(tmp_path, s3_server, s3_bucket):
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "wrong-secret"}
    started = time.monotonic()
    code, out = finish(start(short_spec(), tmp_path / "w", f"s3://{s3_bucket}/x", env), timeout=180)
    assert code != 0
    assert "checkpoint.uri" in out and "Traceback" not in out.split("checkpoint.uri")[0][-200:]
    assert not (tmp_path / "w" / "metrics.jsonl").exists(), "trained before noticing the credentials were wrong"
    assert time.monotonic() - started < 170


@pytest.mark.slow
def test_a_restarted_disable_job_continues_its_own_steps_and_stops_when_none_loads(tmp_path):
    """resumeMode disable, the same RLJob (uid) restarted after a SIGKILL: it continues from its own step 6
    (it used to move them to superseded/ and train from step 1). Then every committed step is bit-flipped:
    the restart quarantines them and stops with exit 2, naming them (it used to train from step 1, exit 0)."""
    spec = short_spec(steps=10, save_freq=3)
    spec["checkpoint"].update(resumeMode="disable", maxToKeep=2)
    uri, work, env = f"file://{tmp_path}/ckpt", tmp_path / "run", {"RLJOB_UID": "uid-1"}
    proc = start(spec, work, uri, env)
    wait_for_step(work, 8, proc)  # past the step-6 checkpoint
    proc.kill()
    proc.wait()
    code, out = finish(start(spec, work, uri, env))  # the pod restarts: same uid
    assert code == 0, out[-3000:]
    assert "resumed from step 6" in out and "this job's own" in out, out[-3000:]
    job = tmp_path / "ckpt" / "test" / "test"
    assert not (job / "superseded").exists()
    steps = sorted(p.name for p in job.glob("step_*") if (p / "COMMIT").exists())
    assert steps == ["step_000009", "step_000010"], steps
    for step in steps:  # one bit of one shard of every committed step
        shard = max((p for p in (job / step).rglob("*") if p.is_file() and p.name not in ("COMMIT", "meta.json")),
                    key=lambda p: p.stat().st_size)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    code, out = finish(start(spec, work, uri, env))
    # the harness has no configuration-error handler: the pod's entry point prints this one line, exit 2
    # (tests/worker/test_startup_errors.py)
    assert code != 0 and "ProgressLost" in out, out[-3000:]
    line = next(ln for ln in out.splitlines() if "none of it loads" in ln)
    assert "quarantine/step_000009-" in line and "quarantine/step_000010-" in line and "--fresh" in line, line
    assert not (job / "step_000001").exists(), "it trained from scratch"
