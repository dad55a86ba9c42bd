"""`rljob run` owns what it starts: a SIGKILLed run leaves no process behind, and a new run removes the
half-written files a killed one left. Real processes: rljob run -> rljob_worker.launch (torchrun) ->
the worker and its helpers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs whose environment has name=value: every process of a run carries its RLJOB_WORKDIR."""
    marker = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="counts processes through /proc")
def test_sigkilled_rljob_run_leaves_no_process_and_stale_temp_files_go(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    root, ckpt = tmp_path / "run", tmp_path / "ckpt"
    work = root / "work"
    # what a run killed mid-copy leaves: a partial file in the job prefix (inside a committed step, too)
    # and one in the local checkpoint folder
    stale = [ckpt / "default" / "quickstart" / "step_000004" / ".__0_0.distcp.rljob-tmp-0123abcd",
             work / "checkpoints" / "step_000004" / ".common.pt.rljob-tmp-4567ef01"]
    for p in stale:
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x" * 1000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    proc = subprocess.Popen([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(root),
                             "--checkpoint-uri", f"file://{ckpt}", "--steps", "200"],
                            env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        metrics = work / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no training step within 400 s"
            time.sleep(0.2)
        assert not any(p.exists() for p in stale), "stale .rljob-tmp-* files survived the start"
        before = processes_with_env("RLJOB_WORKDIR", str(work))
        assert len(before) >= 2, before  # torchrun and the worker at least
        proc.send_signal(signal.SIGKILL)  # only `rljob run` itself: no handler, no forwarding
        proc.wait()
        deadline = time.monotonic() + 20
        while processes_with_env("RLJOB_WORKDIR", str(work)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_with_env("RLJOB_WORKDIR", str(work))
        assert not left, f"processes of the killed run still alive: {left} (of {before})"
    finally:
        for pid in processes_with_env("RLJOB_WORKDIR", str(work)):  # a failed run must not leak into later tests
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1
