"""`rljob validate | crd | explain` as a user runs them: a real subprocess, exit codes, every message,
and never a Python traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml
from api_support import CRD_PATH, DELETE, EXAMPLE_PATHS, ROOT, changed, gpu_job
from rljob_api.models import AlgorithmSpec


def rljob_command() -> list[str]:
    exe = shutil.which("rljob")
    return [exe] if exe else [sys.executable, "-m", "rljob_cli.main"]


def rljob(*args: str, stdin: str | None = None, cwd: Path = ROOT) -> tuple[int, str]:
    """Exit code and stdout+stderr of `rljob ARGS`; fails the test on any traceback."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([*rljob_command(), *map(str, args)], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=60, check=False)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    return proc.returncode, out


def write(tmp_path: Path, name: str, content: str | bytes | object) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(yaml.safe_dump(content, sort_keys=False))
    return path


HEAD = ("apiVersion: rljob.dev/v1alpha1\nkind: RLJob\nmetadata: {name: x}\nspec:\n  model: {path: /m}\n"
        "  data: {trainFiles: [/t.parquet]}\n")


def test_console_script_is_declared():
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("rljob") == "rljob_cli.main:main", "reinstall: pip install -e . --no-deps"


def test_version_is_the_installed_distributions():
    import tomllib
    from importlib.metadata import version

    from rljob_cli.main import DISTRIBUTION

    assert DISTRIBUTION == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    code, out = rljob("--version")
    assert code == 0 and out == f"rljob {version(DISTRIBUTION)}\n", out


# --------------------------------------------------------------------------- validate


def test_validate_examples_one_ok_line_each():
    code, out = rljob("validate", *[p.relative_to(ROOT) for p in EXAMPLE_PATHS])
    assert code == 0 and "NOT RUNNABLE" not in out, out  # every seed recipe runs as written
    lines = [line for line in out.strip().splitlines() if not line.startswith(("  ", "note: "))]
    assert len(lines) == len(EXAMPLE_PATHS), out
    for path, line in zip(EXAMPLE_PATHS, lines):
        assert line.startswith(f"OK {path.relative_to(ROOT)}: "), line
    assert "qwen3-8b-grpo: grpo on s3://models/Qwen/Qwen3-8B, 1x8 gpu, TP2 PP4 CP1" in out
    assert "critic shared, own processes taking turns TP4 PP1" in out  # Trinity's critic block


def test_validate_into_a_closed_pipe_exits_141_without_a_traceback():
    """`rljob validate examples/*.yaml | head -1`: the reader leaves after one line. The output (every example 30
    times, beyond a pipe's 64 KiB) cannot all fit in the pipe before it closes."""
    files = [str(p.relative_to(ROOT)) for p in EXAMPLE_PATHS] * 30
    proc = subprocess.Popen([*rljob_command(), "validate", *files], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.stdout.readline().startswith(b"OK examples/")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_validate_reports_every_error_with_its_path(tmp_path):
    schema_bad = write(tmp_path, "schema.yaml", changed(gpu_job(), {
        "spec.nnodes": 0, "spec.rollout.engine": "sglang", "spec.megatron.tensorParallelSize": 2,
        "spec.training.lr": "fast"}))
    cross_bad = write(tmp_path, "cross.yaml", changed(gpu_job(), {
        "spec.megatron.tensorModelParallelSize": 3, "spec.rollout.tensorModelParallelSize": 3,
        "spec.checkpoint.resumeMode": "uri", "metadata.name": "ok-name"}))
    good = write(tmp_path, "good.yaml", gpu_job())
    rloo = write(tmp_path, "rloo.yaml", changed(gpu_job(), {"spec.algorithm.advantageEstimator": "rloo"}))
    code, out = rljob("validate", good, rloo, schema_bad, cross_bad)
    assert code == 1, out
    assert f"OK {good}: t: grpo on /models/qwen" in out
    assert f"OK {rloo}: t: grpo (rloo) on /models/qwen" in out  # the estimator it runs, not plain grpo
    assert f"INVALID {schema_bad}" in out and f"INVALID {cross_bad}" in out
    for expected in [
        "  spec.nnodes: Input should be greater than or equal to 1",
        "  spec.rollout.engine: Input should be 'vllm', 'hf' or 'auto' (got 'sglang')",
        "  spec.megatron.tensorParallelSize: unknown field",
        "  spec.training.lr: Input should be a valid number",
        "  spec.megatron.tensorModelParallelSize: nnodes x gpusPerNode = 8 GPUs is not divisible",
        "  spec.rollout.tensorModelParallelSize: rollout TP 3 must divide gpusPerNode=8",
        "  spec.checkpoint.resumeFrom: resumeMode uri needs resumeFrom",
    ]:
        assert expected in out, f"missing {expected!r} in:\n{out}"


BAD_INPUTS = {
    "unclosed-brace": ("apiVersion: rljob.dev/v1alpha1\nkind: RLJob\nspec: {model: {path: /m}\n",
                       ["malformed YAML at line", "column"]),
    "tab-indent": ("spec:\n\tmodel: {}\n", ["malformed YAML at line 2"]),
    "python-tag": ("!!python/object:os.system {}\n", ["malformed YAML"]),
    "empty": ("", ["no YAML documents"]),
    "comment-only": ("# only a comment\n---\n", ["no YAML documents"]),
    "list": ("- a\n- b\n", ["(root): expected a mapping", "got a list"]),
    "scalar": ("just a string\n", ["(root): expected a mapping", "got a string"]),
    "wrong-kind": ("apiVersion: rljob.dev/v1\nkind: PyTorchJob\nmetadata: {name: x}\n",
                   ["kind: must be 'RLJob', got 'PyTorchJob'", "apiVersion: must be 'rljob.dev/v1alpha1'"]),
    "lowercase-kind": (HEAD.replace("apiVersion: rljob.dev/v1alpha1", "apiVersion: v1").replace("RLJob", "rljob"),
                       ["kind: must be 'RLJob', got 'rljob'", "apiVersion: must be 'rljob.dev/v1alpha1', got 'v1'"]),
    "wrong-types": (HEAD + "  gpus_per_node: 8\n  rollout: {samplesPerPrompt: '8'}\n  suspend: yes please\n",
                    ["spec.gpus_per_node: unknown field", "spec.rollout.samplesPerPrompt: Input should be a valid integer",
                     "; write it without quotes (samplesPerPrompt: 8)",
                     "spec.suspend: Input should be a valid boolean"]),
    "non-mapping-section": ("apiVersion: rljob.dev/v1alpha1\nkind: RLJob\nmetadata: {name: x}\nspec:\n  megatron: tp2\n",
                            ["spec.model: required field is missing",
                             "spec.megatron: must be a mapping of fields, got a string"]),
    "unknown-field-hint": (HEAD + "  training: {ppoMicroBatchSizePerGpu: 4}\n",
                           ["spec.training.ppoMicroBatchSizePerGpu: unknown field", "did you mean microBatchSizePerGpu?"]),
    "top-level-typo": (HEAD.replace("metadata:", "metdata:"),
                       ["metdata: unknown field", "`rljob explain rlj`; did you mean metadata?"]),
    "infinite": (HEAD + "  algorithm: {klCoef: .inf}\n", ["spec.algorithm.klCoef: must be a finite number"]),
    "recursive-alias": (HEAD + "  megatron:\n    overrideTransformerConfig: {a: &x [*x]}\n",
                        ["spec.megatron.overrideTransformerConfig.a[0]: refers to itself"]),
    "no-name": (HEAD.replace("metadata: {name: x}\n", ""), ["metadata.name: required; add metadata: {name: my-job}"]),
    "bad-name": (HEAD.replace("name: x", "name: Bad_Name"), ["metadata.name: must be a DNS label"]),
    "not-utf8": (b"\xff\xfe\x00\x81 not utf-8", ["cannot read", "not UTF-8"]),
    # kubectl refuses a key given twice ("mapping key ... already defined"); PyYAML kept the last one
    "duplicate-key": (HEAD + "  training: {lr: 1.0e-6}\n  training: {lr: 2.0e-6}\n",
                      ["malformed YAML at line 8", "duplicate key 'training' (first at line 7)"]),
}


@pytest.fixture(scope="module")
def bad_inputs_run(tmp_path_factory) -> tuple[int, dict[str, str]]:
    """One `rljob validate` over every bad input (and a missing file and a folder): its exit code and,
    per input, the lines it printed about that input."""
    folder = tmp_path_factory.mktemp("bad")
    paths = {name: write(folder, f"{name}.yaml", content) for name, (content, _) in BAD_INPUTS.items()}
    paths["missing"] = folder / "missing.yaml"
    paths["folder"] = folder / "sub"
    paths["folder"].mkdir()
    code, out = rljob("validate", *paths.values())
    sections: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        if not line.startswith("  "):
            current = next((n for n, p in paths.items() if f" {p}" in line), None)
            assert current, f"a line about no input: {line!r}"
        sections[current] = sections.get(current, "") + line + "\n"
    assert set(sections) == set(paths), out
    return code, sections


def test_validate_bad_inputs_exit_1(bad_inputs_run):
    assert bad_inputs_run[0] == 1


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_validate_bad_input_gets_a_clear_message(bad_inputs_run, name):
    section = bad_inputs_run[1][name]
    assert section.startswith(("ERROR ", "INVALID ")), section
    for words in BAD_INPUTS[name][1]:
        assert words in section, f"{words!r} not in:\n{section}"


def test_validate_unreadable_paths(bad_inputs_run):
    sections = bad_inputs_run[1]
    assert "cannot read" in sections["missing"] and "No such file" in sections["missing"]
    assert "cannot read" in sections["folder"] and "directory" in sections["folder"]


def test_validate_multi_document_file(tmp_path):
    docs = [gpu_job(), changed(gpu_job(), {"metadata.name": "second", "spec.rollout.samplesPerPrompt": 1})]
    path = write(tmp_path, "multi.yaml", "---\n".join(yaml.safe_dump(d) for d in docs))
    code, out = rljob("validate", path)
    assert code == 1, out
    assert f"OK {path}#0: t:" in out
    assert f"INVALID {path}#1" in out and "  spec.rollout.samplesPerPrompt: Input should be greater than or equal to 2" in out

    both_ok = write(tmp_path, "ok.yaml", "---\n".join(yaml.safe_dump(changed(gpu_job(), {"metadata.name": n}))
                                                      for n in ("a", "b")) + "---\n")
    code, out = rljob("validate", both_ok)
    assert code == 0, out
    assert [ln for ln in out.strip().splitlines() if not ln.lstrip().startswith("note: ")] == [f"OK {both_ok}#0: " + out.split(f"OK {both_ok}#0: ")[1].splitlines()[0],
                                        f"OK {both_ok}#1: " + out.split(f"OK {both_ok}#1: ")[1].splitlines()[0]]


def test_validate_refuses_greedy_grpo_and_warns_on_greedy_ppo():
    """rollout.temperature 0: identical samples in every group; an error under GRPO's group baseline, a warning
    with a critic (its values still make advantages)."""
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(changed(gpu_job(), {"spec.rollout.temperature": 0})))
    assert code == 1 and "spec.rollout.temperature: 0 samples greedily" in out and "use 1.0" in out, out
    ppo = changed(gpu_job(), {"spec.algorithm.advantageEstimator": "gae", "spec.critic": {}, "spec.rollout.temperature": 0})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(ppo))
    assert code == 0 and "  warning: spec.rollout.temperature: 0 samples greedily" in out and "use 1.0" in out, out


@pytest.mark.parametrize(("resources", "line"), [
    ({"requets": {"cpu": "64"}}, "spec.podTemplate.resources.requets: unknown field; did you mean requests?"),
    ({"cpu": "64"}, ("spec.podTemplate.resources.cpu: cpu is a resource name, not a section of resources: put it "
                     "under requests (and limits)")),
    ({"requests": {"memory": "800GB"}}, ("spec.podTemplate.resources.requests.memory: '800GB' is not a Kubernetes "
                                         "quantity")),
    ({"limits": {"nvidia.com/gpu": 4}}, ("spec.podTemplate.resources.limits.nvidia.com/gpu: the operator sets "
                                         "nvidia.com/gpu from spec.gpusPerNode (8); set gpusPerNode: 4 instead of a "
                                         "GPU limit")),
    ({"requests": {"cpu": 64}, "limits": {"cpu": 32}}, ("spec.podTemplate.resources.requests.cpu: 64 is more than "
                                                         "limits.cpu 32")),
], ids=["section-typo", "quantity-under-resources", "bad-quantity", "gpu-count", "request-above-limit"])
def test_validate_refuses_bad_pod_resources_in_one_line(tmp_path, resources, line):
    """What the API server or the kubelet would refuse far from the user, or the operator would silently
    override, is one line of `rljob validate` (exit 1); render refuses it too."""
    path = write(tmp_path, "job.yaml", changed(gpu_job(), {"spec.podTemplate.resources": resources}))
    code, out = rljob("validate", path)
    assert code == 1 and f"INVALID {path}" in out, out
    errors = [ln for ln in out.splitlines() if ln.startswith("  spec.")]
    assert len(errors) == 1 and errors[0].startswith(f"  {line}"), out
    code, out = rljob("render", path)
    assert code == 1 and "kind: PyTorchJob" not in out, out


def test_render_refuses_a_manifest_without_a_name(tmp_path):
    """The model's default name (rljob) is for objects the operator reads, which always have one; a manifest
    without one would render children named rljob-*."""
    code, out = rljob("render", write(tmp_path, "job.yaml", changed(gpu_job(), {"metadata": DELETE})))
    assert code == 1 and "metadata.name: required; add metadata: {name: my-job}" in out, out
    assert "kind: PyTorchJob" not in out, out


def test_render_names_a_bad_operator_setting_in_one_line(tmp_path):
    path = write(tmp_path, "job.yaml", gpu_job())
    proc = subprocess.run([*rljob_command(), "render", str(path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RLJOB_MASTER_PORT": "abc"}, check=False)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.startswith("rljob render: RLJOB_MASTER_PORT='abc' is not an integer"), proc.stderr
    assert "unset it" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


SECRET = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-credentials"}, "stringData": {"k": "v"}}


def test_validate_and_render_skip_other_resources_alike(tmp_path):
    """A Secret beside the RLJob is skipped by both with the same line; a file of two RLJobs is one too many for
    render, and a file with none is an error for both."""
    path = write(tmp_path, "with-secret.yaml", "---\n".join(yaml.safe_dump(d) for d in (gpu_job(), SECRET)))
    code, out = rljob("validate", path)
    assert code == 0 and f"skipped {path}#1: Secret (not an RLJob)" in out and f"OK {path}#0: t:" in out, out
    code, out = rljob("render", path)
    assert code == 0 and f"skipped {path}#1: Secret (not an RLJob)" in out and "kind: PyTorchJob" in out, out
    assert "kind: Secret" not in out, out
    two = write(tmp_path, "two.yaml", "---\n".join(yaml.safe_dump(changed(gpu_job(), {"metadata.name": n}))
                                                   for n in ("a", "b")))
    code, out = rljob("render", two)
    assert code == 1 and "found 2; render (and run) one RLJob per file" in out, out
    only_secret = write(tmp_path, "secret.yaml", SECRET)
    for command in ("validate", "render"):
        code, out = rljob(command, only_secret)
        assert code == 1 and f"skipped {only_secret}: Secret (not an RLJob)" in out, out
        assert f"{only_secret}: no RLJob document" in out, out


def test_validate_refuses_gspo_with_token_mean():
    """importanceLevel sequence under the default token-mean: the error names the field and the fix."""
    gspo = changed(gpu_job(), {"spec.algorithm.importanceLevel": "sequence"})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(gspo))
    assert code == 1, out
    assert "spec.algorithm.lossAggregation:" in out and "set lossAggregation: seq-mean-token-mean" in out, out
    fixed = changed(gspo, {"spec.algorithm.lossAggregation": "seq-mean-token-mean"})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(fixed))
    assert code == 0, out


def test_validate_names_the_fused_module_for_an_hf_lora_target_and_warns_on_a_full_fine_tuning_lr():
    hf_names = changed(gpu_job(), {"spec.lora": {"rank": 16, "targetModules": ["q_proj", "v_proj"]}})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(hf_names))
    assert code == 1, out
    assert "spec.lora.targetModules:" in out and "'q_proj' is fused into megatron-core's 'linear_qkv'" in out, out
    twice = changed(gpu_job(), {"spec.lora": {"targetModules": ["linear_qkv", "linear_qkv"]}})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(twice))
    assert code == 1 and "lists a module twice" in out, out
    low = changed(gpu_job(), {"spec.lora": {"rank": 16}, "spec.training.lr": 1e-6})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(low))
    assert code == 0, out  # valid: a warning, not an error
    assert "  warning: spec.training.lr: 1e-06 is in the full fine-tuning range" in out, out
    assert "rljob explain spec.lora" in out
    fine = changed(low, {"spec.training.lr": 2e-5})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(fine))
    assert code == 0 and "warning" not in out, out
    full = changed(gpu_job(), {"spec.training.lr": 1e-6})  # no LoRA: 1e-6 is a fine full fine-tuning rate
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(full))
    assert code == 0 and "warning" not in out, out


def test_validate_says_what_an_off_policy_rollout_mode_does_to_the_loss():
    """rollout.mode one-step / async: the summary names the pool, and notes say how old a sample may be and that
    truncated importance sampling is on (unset) or off (set false)."""
    pool = {"spec.rollout.placement": "separate", "spec.rollout.gpus": 4}
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(changed(gpu_job(), {**pool, "spec.rollout.mode": "async",
                                                                               "spec.rollout.maxStaleness": 3})))
    assert code == 0, out
    assert ", rollout pool 4/node async <= 3 versions" in out, out
    assert "  note: spec.rollout.mode async: the rollout pool generates up to 3 batch(es) ahead" in out, out
    assert "tokenTruncation is on (unset: on for off-policy modes)" in out and "min(pi_train / pi_rollout, 2)" in out
    off = changed(gpu_job(), {**pool, "spec.rollout.mode": "one-step",
                              "spec.algorithm.rolloutCorrection": {"tokenTruncation": False}})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(off))
    assert code == 0 and "up to 1 batch(es) ahead" in out and "tokenTruncation is off" in out, out
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(changed(gpu_job(), pool)))  # sync: nothing to note
    assert code == 0 and ", rollout pool 4/node sync" in out and "  note: spec.rollout.mode" not in out, out
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(changed(gpu_job(), {"spec.rollout.mode": "async"})))
    assert code == 1 and "spec.rollout.mode:" in out and "set rollout.placement: separate" in out, out


def test_validate_stdin():
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(gpu_job()))
    assert code == 0 and out.startswith("OK -: t:"), out


def test_validate_needs_a_file():
    code, out = rljob("validate")
    assert code == 2 and "usage: rljob validate" in out, out


def _local_job(tmp_path: Path, **spec: object) -> dict:
    """The quickstart's shape (builtin model, CPU) with its checkpoints under tmp_path, changed by `spec`."""
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["spec"]["checkpoint"]["uri"] = f"file://{tmp_path}/ckpt"
    for path, value in spec.items():
        section, _, field = path.partition(".")
        job["spec"].setdefault(section, {})[field] = value
    return job


def test_validate_refuses_an_unknown_builtin_model_everywhere(tmp_path):
    code, out = rljob("validate", write(tmp_path, "j.yaml", _local_job(tmp_path, **{"model.path": "builtin://tiny-qwen3"})))
    assert code == 1, out
    assert "INVALID" in out and "spec.model.path: builtin://tiny-qwen3 is not a built-in model" in out, out
    assert "builtin://tiny-qwen2, builtin://tiny-qwen2-hd64" in out, out


def test_validate_local_checks_what_rljob_run_would_find_missing_on_this_machine(tmp_path):
    """A missing local data file and an unusable checkpoint folder fail `rljob run` 13-33 s in; `validate
    --local` says so at once, naming the field, and says what it could not check (s3:// objects)."""
    (tmp_path / "afile").write_text("not a folder")
    job = _local_job(tmp_path, **{"data.trainFiles": [str(tmp_path / "missing.parquet")],
                                  "data.valFiles": ["s3://bucket/val.parquet"],
                                  "checkpoint.uri": f"file://{tmp_path}/afile/ckpt"})
    job["spec"]["data"].pop("synthetic")
    path = write(tmp_path, "j.yaml", job)
    code, out = rljob("validate", "--local", path)
    assert code == 1, out
    assert f"spec.data.trainFiles[0]: {tmp_path}/missing.parquet does not exist on this machine" in out, out
    assert (f"spec.checkpoint.uri: file://{tmp_path}/afile/ckpt cannot be created: {tmp_path}/afile is a file, "
            "not a folder") in out, out
    assert "not checked: spec.data.valFiles[0] s3://bucket/val.parquet (s3:// objects are read at run time)" in out
    # the same spec for a cluster: paths are the pods', so plain validate says it did not check them
    code, out = rljob("validate", path)
    assert code == 0, out
    assert "note: local paths not checked (they are the pods'; `rljob validate --local` checks them for `rljob run`)" in out
    # a good local spec passes --local
    code, out = rljob("validate", "--local", write(tmp_path, "ok.yaml", _local_job(tmp_path)))
    assert code == 0 and out.startswith("OK "), out


def test_run_refuses_a_missing_local_data_file_before_starting(tmp_path):
    job = _local_job(tmp_path, **{"data.trainFiles": [str(tmp_path / "missing.parquet")]})
    job["spec"]["data"].pop("synthetic")
    code, out = rljob("run", write(tmp_path, "j.yaml", job), "--workdir", tmp_path / "work")
    assert code == 2, out
    assert f"rljob: spec.data.trainFiles[0]: {tmp_path}/missing.parquet does not exist on this machine" in out, out
    assert not (tmp_path / "work").exists(), "the check runs before the run starts (it makes the workdir)"


def test_run_refuses_a_metrics_port_whose_last_pod_would_pass_65535(tmp_path):
    """`rljob run` gives pod i the metrics port + i: pod 1 of 65535 died of an OverflowError traceback, and pod 0
    waited for it in distributed init. Now refused before anything starts (and by validate --local)."""
    job = _local_job(tmp_path, **{"metrics.port": 65535, "training.microBatchSizePerGpu": 8})
    job["spec"]["nnodes"] = 2
    path = write(tmp_path, "j.yaml", job)
    code, out = rljob("run", path, "--workdir", tmp_path / "work")
    assert code == 2, out
    assert ("rljob: spec.metrics.port: 65535: `rljob run` serves pod i's metrics on port + i, and pod 1 would get "
            "65536, past 65535; lower it to at most 65534") in out, out
    assert not (tmp_path / "work").exists()
    code, out = rljob("validate", "--local", path)
    assert code == 1 and "NOT RUNNABLE here: spec.metrics.port: 65535" in out, out
    job["spec"]["metrics"]["port"] = 65534
    code, out = rljob("validate", "--local", write(tmp_path, "ok.yaml", job))
    assert code == 0, out


def test_validate_local_names_a_folder_this_user_cannot_write(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user (root) writes anywhere: a read-only folder cannot be made here")
        code, out = rljob("validate", "--local", write(tmp_path, "j.yaml", _local_job(
            tmp_path, **{"checkpoint.uri": f"file://{locked}/ckpt"})))
    finally:
        locked.chmod(0o700)
    assert code == 1 and f"{locked} is not writable by this user" in out, out


@pytest.mark.parametrize(("megatron", "field", "words"), [
    ({"tensorModelParallelSize": 8}, "tensorModelParallelSize",
     "builtin://tiny-qwen2 has 4 attention heads and 2 KV heads, which TP 8 does not divide: use a TP that divides 2"),
    ({"tensorModelParallelSize": 4}, "tensorModelParallelSize", "which TP 4 does not divide: use a TP that divides 2"),
    ({"pipelineModelParallelSize": 4}, "pipelineModelParallelSize",
     "builtin://tiny-qwen2 has 2 layers, which PP 4 does not divide: use a PP that divides 2"),
], ids=["tp8", "tp4", "pp4"])
def test_validate_refuses_the_quickstart_split_finer_than_its_builtin_model(tmp_path, megatron, field, words):
    """The worker refused these at start-up; validate now says so offline, in one line naming the field."""
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["spec"].update(gpusPerNode=8, megatron=megatron)
    code, out = rljob("validate", write(tmp_path, "q.yaml", job))
    errors = [line for line in out.splitlines() if line.startswith("  ")]
    assert code == 1 and len(errors) == 1 and errors[0].startswith(f"  spec.megatron.{field}: "), out
    assert words in errors[0], out


# --------------------------------------------------------------------------- crd and explain


def test_crd_prints_the_committed_crd():
    code, out = rljob("crd")
    assert code == 0
    assert out == CRD_PATH.read_text(), "run `rljob crd > crds/rljob.dev_rljobs.yaml`"


def test_explain_algorithm_lists_fields_with_descriptions():
    code, out = rljob("explain", "spec.algorithm")
    assert code == 0, out
    assert out.startswith("FIELD: spec.algorithm <object>")
    assert "RL algorithm and loss." in out
    for name, field in AlgorithmSpec.model_fields.items():
        alias = field.alias or name
        assert f"\n  {alias} <" in out, f"{alias} not listed"
        assert field.description.split(" (verl:")[0] in out, f"description of {alias} not shown"
    assert "klEstimator <string (k1 | k2 | k3 | low_var_kl)>" in out


def in_process(capsys, *args: str) -> tuple[int, str]:
    """`rljob ARGS` in this process (cheaper than a subprocess, for variants of a command tested above)."""
    from rljob_cli.main import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_explain_leaf_and_default_and_rlj_prefix(capsys):
    code, out = in_process(capsys, "explain", "rlj.spec.rollout.samplesPerPrompt")
    assert code == 0 and "FIELD: rlj.spec.rollout.samplesPerPrompt <integer>" in out and "group size" in out, out
    code, out = in_process(capsys, "explain")
    assert code == 0 and "FIELD: spec <object>" in out and "What to train and how." in out, out
    code, out = in_process(capsys, "explain", "status.conditions")
    assert code == 0 and "FIELD: status.conditions <[]object>" in out and "lastTransitionTime" in out, out


def test_explain_follows_the_hint_for_an_unknown_key_in_a_map_entry(tmp_path, capsys):
    """The hint of an unknown key under reward.bySource.<source> names `rljob explain` of that entry, which lists
    the entry's fields (the values of a map of objects, whatever the key)."""
    job = changed(yaml.safe_load(HEAD), {"spec.reward.bySource": {"gsm8k": {"fucntion": "gsm8k"}}})
    code, out = rljob("validate", write(tmp_path, "j.yaml", job))
    assert code == 1 and "`rljob explain spec.reward.bySource.gsm8k`; did you mean function?" in out, out
    code, out = in_process(capsys, "explain", "spec.reward.bySource.gsm8k")
    assert code == 0 and "\n  function <string>" in out and "\n  remote <object>" in out, out
    code, out = in_process(capsys, "explain", "spec.reward.bySource.gsm8k.remote.url")
    assert code == 0 and "FIELD: spec.reward.bySource.gsm8k.remote.url <string>" in out, out
    code, out = in_process(capsys, "explain", "spec.reward.bySource")
    assert code == 0 and "<map[string]object>" in out and "\n  function <string>" in out, out


@pytest.mark.parametrize("prefix", ["rlj", "rljob", "rljobs", "RLJob"])
def test_explain_takes_the_resource_names_kubectl_takes(capsys, prefix):
    code, out = in_process(capsys, "explain", f"{prefix}.spec.nnodes")
    assert code == 0 and f"FIELD: {prefix}.spec.nnodes <integer>" in out, out


def test_explain_metadata_name_states_the_rule_validate_enforces(capsys):
    from rljob_api.validation import NAME_MAX_LENGTH, name_errors

    code, out = in_process(capsys, "explain", "metadata.name")
    assert code == 0, out
    assert f"at most {NAME_MAX_LENGTH} characters" in out and "starting with a letter" in out, out
    assert "ending with a letter or digit" in out and "63 characters" in out, out
    for bad in ("7b-grpo", "grpo-", "Grpo", "g" * (NAME_MAX_LENGTH + 1)):  # what the text says is what is enforced
        assert name_errors(bad), bad
    code, out = in_process(capsys, "explain", "metadata")
    assert code == 0 and "DESCRIPTION:\n  Standard Kubernetes object metadata" in out and "\n  name <string>" in out, out


def test_explain_markdown_with_a_field_path_is_refused_in_one_line():
    """--markdown is the whole reference (docs/reference.md); a FIELD.PATH beside it was silently ignored."""
    code, out = rljob("explain", "spec.algorithm", "--markdown")
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "takes no FIELD.PATH" in out and "`rljob explain spec.algorithm`" in out, out


def test_explain_unknown_field_is_helpful(capsys):
    code, out = rljob("explain", "spec.nope")
    assert code == 1, out
    assert "'nope' does not exist in spec" in out
    assert "algorithm" in out and "megatron" in out  # lists what does exist
    code, out = in_process(capsys, "explain", "spec.megatron.tp")
    assert code == 1 and "does not exist in spec.megatron" in out and "tensorModelParallelSize" in out, out


def test_render_wires_tracker_credentials_from_secrets_never_values(tmp_path):
    job = yaml.safe_load(HEAD)
    job["spec"]["tracking"] = {
        "mlflow": {"trackingUri": "http://mlflow.ml.svc:5000", "tokenSecretRef": {"name": "mlflow", "key": "token"}},
        "wandb": {"project": "rl", "apiKeySecretRef": {"name": "wandb", "key": "api-key"}}}
    code, out = rljob("render", write(tmp_path, "job.yaml", job))
    assert code == 0, out
    docs = [d for d in yaml.safe_load_all(out) if d]
    ptj = next(d for d in docs if d["kind"] == "PyTorchJob")
    env = {e["name"]: e for e in ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_TOKEN"] == {"name": "MLFLOW_TRACKING_TOKEN",
                                            "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}}}
    assert env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}
    job["spec"]["tracking"]["mlflow"]["trackingUri"] = "mlflow.ml.svc:5000"
    code, out = rljob("validate", write(tmp_path, "bad.yaml", job))
    assert code == 1 and "spec.tracking.mlflow.trackingUri" in out, out


# --------------------------------------------------------------------------- run --fresh

QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def test_fresh_refuses_a_workdir_the_run_did_not_create(tmp_path):
    """`--workdir .` with the user's own files there: --fresh deletes nothing and says why."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "job.yaml").write_text(QUICKSTART.read_text())
    ckpt = tmp_path / "ckpt"
    kept = ckpt / "default" / "quickstart" / "step_000001" / "COMMIT"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    code, out = rljob("run", "job.yaml", "--workdir", ".", "--fresh", "--checkpoint-uri", f"file://{ckpt}",
                      cwd=project)
    assert code == 2, out
    assert "refusing to delete anything in" in out and str(project) in out, out
    assert (project / "job.yaml").exists()
    assert kept.exists(), "the checkpoints went although the workdir check refused"


def test_fresh_deletes_only_what_the_run_wrote(tmp_path):
    """The manifest lists what runs wrote; a file the user put into work/ later (notes.txt) stays."""
    from rljob_cli.main import load_rljob
    from rljob_worker.runtime.launcher import (
        claim_workdir,
        clear_previous_run,
        files_under,
        record_written,
        write_spec,
    )

    job = load_rljob(str(QUICKSTART))
    root = tmp_path / "project"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("mine")
    (root / "job.yaml").write_text("mine")
    before = claim_workdir(job, root, nnodes=2)  # as an earlier `rljob run --workdir project` did
    write_spec(job, root)
    (root / "work" / "checkpoints").mkdir(parents=True)
    (root / "work" / "checkpoints" / "x.pt").write_text("ckpt")
    (root / "work" / "metrics.jsonl").write_text("{}")
    (root / "pod-1.log").write_text("log")
    record_written(job, root, {"spec.json", "pod-1.log"} | (files_under(root / "work", root) - before))
    (root / "work" / "notes.txt").write_text("the user's, written after the run")
    ckpt = tmp_path / "ckpt"
    for name in ("quickstart", "other"):
        (ckpt / "default" / name / "step_000001").mkdir(parents=True)
        (ckpt / "default" / name / "step_000001" / "COMMIT").write_text("{}")
    clear_previous_run(job, root, f"file://{ckpt}")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "job.yaml", "notes", "notes/todo.txt", "work", "work/notes.txt"]
    assert not [p for p in (ckpt / "default" / "quickstart").rglob("*") if p.is_file()]
    assert (ckpt / "default" / "other" / "step_000001" / "COMMIT").exists()


def test_fresh_refuses_while_a_live_run_holds_the_lease(tmp_path):
    """--fresh used to delete a running job's checkpoints and its LEASE before any lease check. This test's
    process holds the lease (a live holder on this host): --fresh deletes nothing and names the holder."""
    from rljob_cli.main import load_rljob
    from rljob_worker.checkpoint.lease import CheckpointLease
    from rljob_worker.checkpoint.store import open_store
    from rljob_worker.runtime.launcher import FreshRefused, claim_workdir, clear_previous_run, record_written

    job = load_rljob(str(QUICKSTART))
    root, ckpt = tmp_path / "run", tmp_path / "ckpt"
    claim_workdir(job, root)
    (root / "spec.json").write_text("{}")
    record_written(job, root, {"spec.json"})
    step = ckpt / "default" / "quickstart" / "step_000001" / "COMMIT"
    step.parent.mkdir(parents=True)
    step.write_text("{}")
    lease = CheckpointLease(open_store(f"file://{ckpt}"), "default/quickstart", settle_s=0.0)
    lease.acquire()
    try:
        with pytest.raises(FreshRefused, match=f"in use by another run: pid {os.getpid()}"):
            clear_previous_run(job, root, f"file://{ckpt}")
        assert step.exists() and (ckpt / "default" / "quickstart" / "LEASE").exists() and (root / "spec.json").exists()
    finally:
        lease.release()
    clear_previous_run(job, root, f"file://{ckpt}")  # released: --fresh goes ahead
    assert not step.exists() and not (root / "spec.json").exists()


def test_a_run_never_writes_over_a_file_it_did_not_create(tmp_path):
    """`--workdir .` in a project that has its own spec.json: the run refuses (exit 2) naming the file, and
    the file is untouched; a folder the run claimed earlier is reused."""
    from rljob_cli.main import load_rljob
    from rljob_worker.runtime.launcher import WorkdirRefused, claim_workdir, record_written

    project = tmp_path / "project"
    project.mkdir()
    (project / "job.yaml").write_text(QUICKSTART.read_text())
    (project / "spec.json").write_text('{"mine": true}')
    code, out = rljob("run", "job.yaml", "--workdir", ".", "--checkpoint-uri", f"file://{tmp_path / 'ckpt'}",
                      cwd=project)
    assert code == 2 and f"{project / 'spec.json'} exists and was not written by `rljob run`" in out, out
    assert (project / "spec.json").read_text() == '{"mine": true}'
    assert sorted(p.name for p in project.iterdir()) == ["job.yaml", "spec.json"]
    job = load_rljob(str(QUICKSTART))
    claim_workdir(job, tmp_path / "run")
    record_written(job, tmp_path / "run", {"spec.json"})
    (tmp_path / "run" / "spec.json").write_text("{}")
    claim_workdir(job, tmp_path / "run")  # its own files: no refusal
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "work").mkdir()
    with pytest.raises(WorkdirRefused, match="work exists"):
        claim_workdir(job, tmp_path / "other")


# --------------------------------------------------------------------------- YAML as kubectl reads it


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    """`lr: 1e-6` is a number for kubectl (YAML 1.2); rljob reads it the same way, and a quoted one stays text."""
    from rljob_cli.main import load_rljob

    path = write(tmp_path, "job.yaml", HEAD + "  training: {lr: 1e-6, weightDecay: 2E-2}\n  algorithm: {klCoef: 1e-3}\n")
    code, out = rljob("validate", path)
    assert code == 0 and out.startswith("OK "), out
    spec = load_rljob(str(path)).spec
    assert (spec.training.lr, spec.training.weight_decay, spec.algorithm.kl_coef) == (1e-6, 2e-2, 1e-3)
    quoted = write(tmp_path, "quoted.yaml", HEAD + "  training: {lr: '1e-6'}\n")
    code, out = rljob("validate", quoted)
    assert code == 1 and "spec.training.lr" in out, out


def test_integers_stay_integers():
    from rljob_cli.yaml_load import load_all

    assert load_all("a: 8\nb: 1_000\nc: 0x10\nd: 1.5\ne: -3e2\nf: '1e2'\ng: 1e2x\n") == [
        {"a": 8, "b": 1000, "c": 16, "d": 1.5, "e": -300.0, "f": "1e2", "g": "1e2x"}]


@pytest.mark.parametrize("steps, words", [("0", "0 is not >= 1"), ("-1", "-1 is not >= 1"), ("ten", "'ten' is not a whole number")])
def test_run_refuses_steps_below_one(tmp_path, steps, words):
    code, out = rljob("run", QUICKSTART, "--workdir", tmp_path / "w", "--steps", steps)
    assert code == 2 and "--steps" in out and words in out, out
    assert not (tmp_path / "w").exists()


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    """`<<: *anchor` merges a mapping (kubectl accepts it); a key set beside the merge overrides the
    merged one. A key written twice by hand is still refused."""
    from rljob_cli.yaml_load import load_all

    assert load_all("base: &b {x: 1, y: 2}\nm: {<<: *b, y: 3}\nn:\n  <<: [*b, {z: 4}]\n") == [
        {"base": {"x": 1, "y": 2}, "m": {"x": 1, "y": 3}, "n": {"x": 1, "y": 2, "z": 4}}]
    with pytest.raises(yaml.YAMLError, match="duplicate key 'y'"):
        load_all("base: &b {x: 1}\nm: {<<: *b, y: 3, y: 4}\n")
    merged = (HEAD.replace("model: {path: /m}", "model: &policy {path: /m}")
              + "  algorithm: {advantageEstimator: gae}\n  critic: {model: {<<: *policy}}\n")
    code, out = rljob("validate", write(tmp_path, "merge.yaml", merged))
    assert code == 0 and out.startswith("OK "), out


def test_validate_says_how_a_gpu_actor_update_cuts_its_micro_batches():
    """maxTokensPerMicroBatch unset on a GPU: a note gives the token budget the worker will use
    (microBatchSizePerGpu 4 x (1024 + 2048) tokens); set, 0, on a CPU or with pipeline stages: no note."""
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(gpu_job()))
    assert code == 0 and ("  note: spec.training.maxTokensPerMicroBatch unset on a GPU without pipeline stages: "
                          "actor-update micro-batches hold up to 12288 tokens") in out, out
    for change in ({"spec.training.maxTokensPerMicroBatch": 0}, {"spec.training.maxTokensPerMicroBatch": 20000},
                   {"spec.device": "cpu"}, {"spec.megatron.pipelineModelParallelSize": 2}):
        code, out = rljob("validate", "-", stdin=yaml.safe_dump(changed(gpu_job(), change)))
        assert code == 0 and "maxTokensPerMicroBatch unset" not in out, (change, out)


def test_validate_notes_routing_replay_and_refuses_it_on_a_dense_builtin():
    on = {"spec.algorithm.routingReplay": True}
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(changed(gpu_job(), on)))
    assert code == 0 and "  note: spec.algorithm.routingReplay: the rollout engine records each token's experts" in out
    dense = changed(gpu_job(), {**on, "spec.model.path": "builtin://tiny-qwen2"})
    code, out = rljob("validate", "-", stdin=yaml.safe_dump(dense))
    assert code == 1 and "spec.algorithm.routingReplay:" in out and "builtin://tiny-qwen3-moe" in out, out
