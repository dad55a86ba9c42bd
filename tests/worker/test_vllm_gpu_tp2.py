"""The real vLLM at rollout tensor-parallel 2 over a torchrun world of two GPUs (marked gpu + vllm; skipped with a
reason where vLLM or a second GPU is missing). The world is made as the trainer makes it; the engine alone must
start, sample identical tokens on both ranks, sleep, take a weight sync and sample with the new weights.

    python -m pytest tests/worker/test_vllm_gpu_tp2.py -v -s -p no:cacheprovider   # 2 GPUs, vLLM 0.26 installed
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]


def _torchrun_probe(tmp_path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(REPO / "bench" / "vllm_tp2_probe.py"), "--stall-s", "170",
                           "--workdir", str(tmp_path / "models"), *options],
                          check=False, capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_engine_over_a_torchrun_world_samples_alike_and_syncs(tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM 0.26 (bench/vllm_carry.sh on the GPU machine)")
    done = _torchrun_probe(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    for rank in (0, 1):
        assert f"vllm tp2 probe rank {rank}: PASS" in out, out[-6000:]
    assert out.count("both ranks sampled the same tokens: True") == 2
    assert out.count("10/10 greedy rows changed, 10/10 equal the HF engine") == 2
