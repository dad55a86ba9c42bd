"""rollout/cache_residency.py: the static engine's KV cache and CUDA graphs stay between rollouts only where the
measured memory says they fit beside training; on a GPU, a real run decides so after its first step and says so."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rljob_worker.rollout.cache_residency import (
    KEEP_HEADROOM,
    RESIDENCY_ENV,
    keep_cache_resident,
    residency_forced_off,
)
from rljob_worker.startup_errors import StartupError

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


def test_the_cache_stays_only_when_training_and_cache_fit_below_the_headroom():
    total = 100 * GIB
    room = int(total * (1 - KEEP_HEADROOM))
    assert keep_cache_resident(total, room - 10 * GIB, 10 * GIB)  # exactly at the line
    assert not keep_cache_resident(total, room - 10 * GIB, 10 * GIB + 1)
    assert not keep_cache_resident(total, room + 1, 0)  # training alone too big
    assert keep_cache_resident(total, 20 * GIB, 2 * GIB)


def test_the_env_forces_release_and_a_typo_is_named(monkeypatch):
    monkeypatch.delenv(RESIDENCY_ENV, raising=False)
    assert not residency_forced_off()
    monkeypatch.setenv(RESIDENCY_ENV, " Release ")
    assert residency_forced_off()
    monkeypatch.setenv(RESIDENCY_ENV, "keep")
    with pytest.raises(StartupError, match="RLJOB_ROLLOUT_CACHE='keep'.*'auto'.*'release'"):
        residency_forced_off()  # a StartupError: the worker prints it as one line at start-up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the static engine runs only there)")
@pytest.mark.parametrize("mode", ["auto", "release"])
def test_a_gpu_run_keeps_the_static_engines_cache_after_its_first_step_unless_told_not_to(tmp_path, mode):
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["metrics"]["enabled"] = False
    job["spec"]["checkpoint"].update(saveFreq=-1, exportHf=False)
    job["spec"]["training"].update(testFreq=-1, valBeforeTrain=False)
    job["spec"].update(device="gpu")
    job["spec"]["model"]["dtype"] = "bfloat16"
    job["spec"]["rollout"]["engine"] = "hf"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    run = subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(tmp_path / "run"),
                          "--checkpoint-uri", f"file://{tmp_path / 'ckpt'}", "--steps", "4"],
                         env={**env, RESIDENCY_ENV: mode, "RLJOB_HF_STATIC_COMPILE": "0"},
                         check=False, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "HFStaticEngine" in out, out[-3000:]
    kept = [line for line in out.splitlines() if "keeps its KV cache and CUDA graphs" in line]
    if mode == "auto":  # decided at step 2's rollout, from step 1's measured training peak
        assert len(kept) == 1 and "from step 3" in kept[0], out[-3000:]
    else:
        assert not kept, out[-3000:]
    assert "step 4/4" in out, out[-3000:]
