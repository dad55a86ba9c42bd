"""Bad input stops `python -m rljob_worker --spec spec.json` at start-up with one clear line.

Each case runs the real worker as a single process (no torchrun) from the quickstart spec with
one setting broken, and expects: exit code 2 within a bound, one error line naming the spec
field, and no traceback. The worker processes start together: each spends most of its ~6 CPU
seconds importing torch and megatron, so they overlap instead of queueing. A worker that
hangs is sent SIGABRT at the bound, and faulthandler puts its threads' stacks in the failure.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from rljob_worker.data.builtin_models import materialize_builtin

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # generous for a loaded 2-core CI box (each case takes ~10 s alone); a hang fails instead


def quickstart_spec() -> dict:
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())["spec"]
    spec["metrics"]["enabled"] = False
    return spec


def parquet_spec(path: Path, **data) -> dict:
    spec = quickstart_spec()
    spec["data"] = {"trainFiles": [str(path)], "maxPromptLength": 16, "maxResponseLength": 16, **data}
    return spec


def verl_rows(key: str = "prompt") -> list[dict]:
    return [{key: f"{i}+1=", "data_source": "t", "reward_model": {"ground_truth": "7"}, "extra_info": {"index": i}}
            for i in range(8)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@dataclass
class Case:
    spec: dict | None  # None: --spec points at `spec_file` as it is
    setting: str  # must appear in the error line
    spec_file: str | None = None
    also: str = ""  # another fragment the line must contain
    env: dict | None = None  # extra environment of this case


def damaged_model(tmp: Path, name: str, damage) -> Path:
    model = tmp / name
    materialize_builtin("tiny-qwen2", model)
    damage(model)
    return model


def with_model(path) -> dict:
    spec = quickstart_spec()
    spec["model"]["path"] = str(path)
    return spec


def build_cases(tmp: Path, s3_server, bucket: str, busy_port: int) -> dict[str, Case]:
    missing = parquet_spec(tmp / "missing.parquet")
    not_parquet = tmp / "train.parquet"
    not_parquet.write_text("prompt,answer\n1+1=,2\n")
    no_key = parquet_spec(write_parquet(tmp / "question.parquet", verl_rows(key="question")))
    bad_model = quickstart_spec()
    bad_model["model"]["path"] = str(tmp / "no-such-model")
    bad_reward = quickstart_spec()
    bad_reward["reward"]["function"] = "no_such_reward_module:score"
    bad_tp = quickstart_spec()
    bad_tp["megatron"]["tensorModelParallelSize"] = 3
    hf_rollout_tp = quickstart_spec()  # the hf engines hold the whole model: they cannot be sharded
    hf_rollout_tp["gpusPerNode"] = 2
    hf_rollout_tp["rollout"].update(engine="hf", tensorModelParallelSize=2)
    vllm_cpu = quickstart_spec()  # (vllm with ranks rank0, refused on GPUs: test_rollout_every_rank)
    vllm_cpu["rollout"].update(engine="vllm")
    secret_tool = yaml.safe_load((REPO / "examples" / "secret-tool.yaml").read_text())["spec"]
    secret_tool["metrics"]["enabled"] = False
    bad_tool = {**secret_tool, "tools": [{**secret_tool["tools"][0], "function": "no_such_tool_module:run"}]}
    plain_tokenizer = materialize_builtin("tiny-qwen2", tmp / "plain-tokenizer")  # no <tool_call> tags
    untagged = {**secret_tool, "model": {**secret_tool["model"], "tokenizerPath": str(plain_tokenizer)}}
    small_critic = {**secret_tool, "algorithm": {**secret_tool["algorithm"], "advantageEstimator": "gae"},
                    "critic": {"model": {"path": "builtin://tiny-qwen2"}}}  # 16 embeddings, the actor's ids reach 19
    (tmp / "garbage.json").write_text("{not json")
    broken_config = damaged_model(tmp, "broken-config", lambda m: (m / "config.json").write_text('{"model_type": '))

    def truncate(m: Path) -> None:
        weights = m / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    truncated = damaged_model(tmp, "truncated", truncate)
    port_spec = quickstart_spec()
    port_spec["metrics"]["enabled"] = True
    missing_s3_model = with_model(f"s3://{bucket}/models/no-such-model")
    missing_s3_model["s3"] = {"endpoint": s3_server.endpoint_url, "credentialsSecretRef": {"name": "s3-credentials"}}
    no_truth_rows = [{"prompt": f"{i}+1=", "data_source": "t", "extra_info": {"index": i}} for i in range(8)]
    no_truth = parquet_spec(write_parquet(tmp / "no-truth.parquet", no_truth_rows))
    unreachable = quickstart_spec()  # busy_port listens but never answers HTTP: the probe times out
    unreachable["reward"] = {"remote": {"url": f"http://127.0.0.1:{busy_port}/score", "retries": 0,
                                        "timeoutSeconds": 2}}
    no_secret = quickstart_spec()
    no_secret["reward"] = {"remote": {"url": "http://127.0.0.1:9/score", "headersSecretRef": {
        "name": "verifier-key", "headers": {"Authorization": "token"}}}}
    return {
        "remote reward unreachable": Case(unreachable, "spec.reward.remote.url", also="does not answer"),
        "remote reward secret env missing": Case(no_secret, "spec.reward.remote.headersSecretRef",
                                                 also="Secret 'verifier-key' key 'token'"),
        "hf engine with rollout TP 2": Case(hf_rollout_tp, "spec.rollout.tensorModelParallelSize",
                                            also="the hf engines keep the whole model"),
        "vllm engine on a CPU": Case(vllm_cpu, "spec.rollout.engine", also="vllm needs GPUs"),
        "ground truth column missing": Case(no_truth, "spec.data.trainFiles[0]",
                                            also="no-truth.parquet: column reward_model is missing"),
        "builtin typo": Case(with_model("builtin://tiny-qwen3"), "spec.model.path", also="builtin://tiny-qwen2"),
        "config.json broken": Case(with_model(broken_config), "spec.model.path", also="config.json is not valid JSON"),
        "weights truncated": Case(with_model(truncated), "spec.model.path", also="model.safetensors is truncated"),
        "metrics port in use": Case(port_spec, f"spec.metrics.port {busy_port}", also="Address already in use",
                                    env={"RLJOB_METRICS_PORT": str(busy_port)}),
        "S3 model prefix missing": Case(missing_s3_model, "spec.model.path", also="no objects under this prefix",
                                        env=s3_server.env()),
        "model path does not exist": Case(bad_model, "spec.model.path", also="no-such-model"),
        "parquet does not exist": Case(missing, "spec.data.trainFiles[0]", also="missing.parquet"),
        "parquet is not parquet": Case(parquet_spec(not_parquet), "spec.data.trainFiles[0]", also="not readable parquet"),
        "prompt key missing": Case(no_key, "spec.data.promptKey", also="'question'"),
        "reward does not import": Case(bad_reward, "spec.reward.function", also="no_such_reward_module"),
        "tool does not import": Case(bad_tool, "spec.tools[0].function", also="no_such_tool_module"),
        "tool-call end tag not one token": Case(untagged, "spec.rollout.agent.toolCallFormat",
                                                also="'</tool_call>' is 0 tokens in this tokenizer"),
        "critic of another vocabulary": Case(small_critic, "spec.critic.model.path builtin://tiny-qwen2",
                                             also="its vocabulary has 16 entries and the actor's token ids reach 19"),
        "spec file missing": Case(None, "--spec", spec_file="no-such-spec.json", also="No such file"),
        "spec file not JSON": Case(None, "--spec", spec_file="garbage.json"),
        "TP 3 on 1 GPU": Case(bad_tp, "spec.megatron.tensorModelParallelSize", also="not divisible"),
    }


@dataclass
class Outcome:
    case: Case
    returncode: int
    stderr: str
    seconds: float


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, s3_server) -> dict[str, Outcome]:
    tmp = tmp_path_factory.mktemp("startup")
    workdir = tmp / "workdir"
    # builtin://tiny-qwen2 resolves to <RLJOB_WORKDIR>/models/tiny-qwen2; build it once for all cases
    materialize_builtin("tiny-qwen2", workdir / "models" / "tiny-qwen2")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_")) and k not in
           {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(RLJOB_WORKDIR=str(workdir), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    running = {}
    bucket = f"startup-{os.getpid()}"
    s3_server.client().create_bucket(Bucket=bucket)
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    cases = build_cases(tmp, s3_server, bucket, busy.getsockname()[1])
    assert sorted(cases) == sorted(CASE_NAMES)
    for name, case in cases.items():
        spec_path = tmp / (case.spec_file or f"{len(running)}.json")
        if case.spec is not None:
            spec_path.write_text(json.dumps(case.spec))
        proc = subprocess.Popen([sys.executable, "-m", "rljob_worker", "--spec", str(spec_path)],
                                env={**env, **(case.env or {})},
                                cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        running[name] = (proc, time.monotonic())
    results = {}
    for name, (proc, start) in running.items():
        try:
            _, stderr = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack into stderr
            try:
                _, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, stderr = proc.communicate()
            stderr += f"\n[killed after {TIMEOUT_S}s]"
        results[name] = Outcome(cases[name], proc.returncode, stderr, time.monotonic() - start)
    busy.close()
    return results


CASE_NAMES = [
    "remote reward unreachable",
    "remote reward secret env missing",
    "hf engine with rollout TP 2",
    "vllm engine on a CPU",
    "ground truth column missing",
    "builtin typo",
    "config.json broken",
    "weights truncated",
    "metrics port in use",
    "S3 model prefix missing",
    "model path does not exist",
    "parquet does not exist",
    "parquet is not parquet",
    "prompt key missing",
    "reward does not import",
    "tool does not import",
    "tool-call end tag not one token",
    "critic of another vocabulary",
    "spec file missing",
    "spec file not JSON",
    "TP 3 on 1 GPU",
]


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ rank\d+ (INFO|WARNING) ")


def non_log_lines(stderr: str) -> list[str]:
    """stderr without the worker's own log lines (which have their timestamped format)."""
    return [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_stops_the_worker_with_one_clear_line(outcomes, name):
    out = outcomes[name]
    case = out.case
    assert out.returncode == 2, f"exit {out.returncode} after {out.seconds:.0f}s; stderr:\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    lines = non_log_lines(out.stderr)  # no traceback, warning dump or progress bar: just the error
    assert len(lines) == 1 and lines[0].startswith("rljob worker: "), out.stderr
    assert case.setting in lines[0] and case.also in lines[0], lines[0]


def test_a_start_up_error_through_torchrun_is_one_line_with_exit_2(tmp_path):
    """`rljob run` -> rljob_worker.runtime.launch (torchrun) -> worker: the worker's own line, exit 2, and none of
    torchrun's ChildFailedError traceback (it used to turn every error into exit 1 and ~30 lines)."""
    job = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    job["spec"]["reward"]["function"] = "no_such_reward_module:score"
    job["spec"]["metrics"]["enabled"] = False
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC", "RLJOB_"))}
    proc = subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(tmp_path / "w"),
                           "--checkpoint-uri", f"file://{tmp_path}/ckpt"], env={**env, "OMP_NUM_THREADS": "1"},
                          check=False, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "ChildFailedError" not in out and "Root Cause" not in out, out
    errors = [line for line in non_log_lines(proc.stderr) if not line.startswith("rljob: ")]
    assert len(errors) == 1 and errors[0].startswith("rljob worker: spec.reward.function"), proc.stderr
    assert "finished with exit code 2" in proc.stdout


def test_the_api_knows_every_builtin_model_the_worker_builds():
    """rljob_api validates builtin:// names without the worker's dependencies; the two lists must agree."""
    from rljob_api.models import BUILTIN_MODEL_NAMES
    from rljob_worker.data.builtin_models import BUILTIN_MODELS

    assert sorted(BUILTIN_MODEL_NAMES) == sorted(BUILTIN_MODELS)


def test_a_job_whose_saved_progress_no_longer_loads_is_a_configuration_error():
    """exit 2 with one line (the pod's entry point), like every other start-up refusal."""
    from rljob_worker.checkpoint.commit import ProgressLost
    from rljob_worker.startup_errors import is_configuration_error

    assert is_configuration_error(ProgressLost("none of it loads"))


def test_the_error_line_is_one_write_so_ranks_do_not_interleave(monkeypatch):
    """Under `python -u` print wrote the text and its newline in two writes: two ranks refusing the same setting
    printed 'rljob worker: A...rljob worker: A...' on one line. The line and its newline now go out in one write."""
    import rljob_worker.__main__ as worker_main

    writes: list[str] = []

    class Unbuffered:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Unbuffered())
    worker_main._say("spec.megatron.sequenceParallel must be true")
    assert writes == ["rljob worker: spec.megatron.sequenceParallel must be true\n"]
