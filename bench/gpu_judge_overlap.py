"""The reward stage's share of a GPU GRPO step scored by an LLM judge that vLLM serves on the same GPU (issue 33):
scoring overlapped with the log-prob passes (spec.reward.remote.overlap true) against blocking, same call.

    python3 bench/gpu_judge_overlap.py [--judge /tmp/char1.5b] [--steps 6] [--max-tokens 16]

The judge is vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``) on 127.0.0.1 with a
random-init model (default: the 1.5B-shape char model of bench/gpu_1_5b_char_prepare.py; no downloads), at
``--judge-memory`` of the GPU. Its replies are random text, so the scores are not meaningful: a reply without a
number in [0, 1] counts as failed and scores 0 (``onFailure: zero``, no retries), which keeps one request per
sample and the judge's latency realistic for ``--max-tokens`` tokens of output. The trainer is digit-sum GRPO
with 32 prompts x 8 samples (256 judged samples a step), two mini-batches (an old-log-prob pass) and klCoef
0.001 (a reference pass): the work the scoring can hide behind. Reported: the median over steps 2.. of
timing/reward_s / timing/step_s for both runs (goal: scoring adds <= 25% to the step).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_judge(model: str, port: int, memory: float, workdir: Path) -> subprocess.Popen:
    template = workdir / "judge_chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = open(workdir / "judge.log", "w")  # noqa: SIM115 (the server's whole life)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           "judge", "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", str(memory),
           "--max-model-len", "256", "--chat-template", str(template)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")  # the server runs its engine core in a process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the judge server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the judge server was not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def job(url: str, steps: int, overlap: bool, max_tokens: int) -> dict:
    doc = yaml.safe_load((REPO / "bench" / "gpu_digit_sum.yaml").read_text())
    spec = doc["spec"]
    doc["metadata"]["name"] = f"gpu-judge-{'overlap' if overlap else 'blocking'}"
    spec["algorithm"]["klCoef"] = 0.001  # a reference pass
    spec["training"].update(trainBatchSizePerNode=32, ppoMiniBatchSizePerNode=16, totalTrainingSteps=steps)
    spec["reward"] = {"remote": {
        "url": url, "protocol": "openai-chat", "concurrency": 64, "retries": 0, "onFailure": "zero",
        "overlap": overlap, "timeoutSeconds": 60,
        "judge": {"model": "judge", "promptTemplate": "{prompt} {completion} score:", "scoreRule": "last-number",
                  "maxTokens": max_tokens, "temperature": 1.0}}}
    spec["checkpoint"].update(saveFreq=0, uri=f"file:///tmp/rljob-gpu-judge-{'o' if overlap else 'b'}")
    return doc


def run(doc: dict, workdir: Path) -> list[dict]:
    path = workdir / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(workdir / doc["metadata"]["name"]),
                    "--fresh"], check=True)
    metrics = workdir / doc["metadata"]["name"] / "work" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"timing/step_s"' in line]
    return rows[1:] if len(rows) > 1 else rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--judge", default="/tmp/char1.5b")
    ap.add_argument("--judge-memory", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--workdir", default="/tmp/rljob-bench-judge")
    ap.add_argument("--url", help="score with this running OpenAI-compatible server (model name 'judge') "
                    "instead of starting vLLM; with --cpu, a smoke test of this script")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU (a smoke test; nothing recorded)")
    a = ap.parse_args()
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = a.url or f"http://127.0.0.1:{port}"
    server = None if a.url else start_judge(a.judge, port, a.judge_memory, workdir)
    out: dict = {}
    try:
        if server is not None:
            out["judge_start_s"] = wait_ready(url, server, 400, workdir / "judge.log")
        for overlap in (False, True):
            doc = job(url, a.steps, overlap, a.max_tokens)
            if a.cpu:
                doc["spec"].update(device="cpu")
                doc["spec"]["model"]["dtype"] = "float32"
            rows = run(doc, workdir)
            med = {k: statistics.median(r.get(k, 0.0) for r in rows)
                   for k in ("timing/step_s", "timing/reward_s", "timing/reward_remote_s", "timing/old_logprob_s",
                             "timing/ref_logprob_s", "timing/rollout_s")}
            med["reward_share"] = statistics.median(r["timing/reward_s"] / r["timing/step_s"] for r in rows)
            med["remote_failures"] = sum(r.get("reward/remote_failures", 0.0) for r in rows)
            out["overlap" if overlap else "blocking"] = med
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    print(json.dumps(out, indent=1))
    if a.cpu:
        return 0
    import results as R

    b, o = out["blocking"], out["overlap"]
    shape = (f"digit-sum GRPO on tiny-qwen2, 32 prompts x 8 = 256 judged samples a step, 2 mini-batches + reference "
             f"pass; judge: vLLM OpenAI server on the same GPU, {a.judge} (random init), max_tokens {a.max_tokens}, "
             f"concurrency 64; reward share of the step {o['reward_share']:.3f} (overlap) vs {b['reward_share']:.3f} "
             f"(blocking); step {o['timing/step_s']:.2f} s vs {b['timing/step_s']:.2f} s")
    R.record("grpo step reward stage with a vLLM-served LLM judge, overlapped with the log-prob passes", shape,
             "reward_stage_s", o["timing/reward_s"], "s", baseline="same, reward.remote.overlap false",
             baseline_value=b["timing/reward_s"], same_run=True,
             command=f"python3 bench/gpu_judge_overlap.py --judge {a.judge} --steps {a.steps} --max-tokens {a.max_tokens}")
    print(f"RESULT judge overlap: reward share {o['reward_share']:.3f} (overlap) vs {b['reward_share']:.3f} (blocking); "
          f"goal <= 0.25 with overlap: {'met' if o['reward_share'] <= 0.25 else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
