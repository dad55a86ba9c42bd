"""Dockerfile.operator and Dockerfile.worker, parsed (Docker cannot run here).

What can be checked without building: base images pinned by tag, a numeric non-root USER, the
operator image installing only the `operator` extra (no torch), entrypoint modules that exist in
the package, version pins equal to pyproject's, and the worker image's entrypoint equal to the
container command the operator writes into every PyTorchJob.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
OPERATOR = REPO / "Dockerfile.operator"
WORKER = REPO / "Dockerfile.worker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TORCH_LIKE = {"torch", "vllm", "megatron-core", "transformer-engine", "flash-attn", "apex", "deepspeed"}


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int

    def exec_form(self) -> list[str]:
        """A JSON (exec-form) argument list; shell form is split like a shell would."""
        text = self.value.strip()
        if text.startswith("["):
            return json.loads(text)
        return shlex.split(text)


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped (no heredocs, no parser directives)."""
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, value = text.partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), start))
    assert not pending, f"{path.name}: dangling line continuation"
    return out


def instructions(path: Path, keyword: str) -> list[Instruction]:
    return [i for i in parse_dockerfile(path) if i.keyword == keyword]


def last(path: Path, keyword: str) -> Instruction:
    found = instructions(path, keyword)
    assert found, f"{path.name} has no {keyword}"
    return found[-1]


def pip_requirements(path: Path) -> list[str]:
    """Every requirement passed to `pip install` in RUN instructions (options dropped)."""
    reqs: list[str] = []
    for run in instructions(path, "RUN"):
        for command in re.split(r"&&|;|\|\||\bthen\b", run.value):
            words = shlex.split(command)
            if (len(words) >= 2 and words[0] in ("pip", "pip3") and words[1] == "install") or \
                    words[:4] == ["python", "-m", "pip", "install"]:
                args = words[words.index("install") + 1:]
                skip_next = False
                for a in args:
                    if skip_next:
                        skip_next = False
                    elif a in ("-c", "--constraint", "-r", "--requirement"):
                        skip_next = True  # the option's value is a file, not a requirement
                    elif not a.startswith("-"):
                        reqs.append(a)
    return reqs


def requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def pyproject_requirements(extra: str | None = None) -> list[str]:
    if extra is None:
        return list(PYPROJECT["project"]["dependencies"])
    return list(PYPROJECT["project"]["optional-dependencies"][extra])


def module_dir(package: str) -> Path:
    for where in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]:
        candidate = REPO / where / package
        if (candidate / "__init__.py").is_file():
            return candidate
    raise AssertionError(f"package {package} not found under {PYPROJECT['tool']['setuptools']['packages']['find']}")


@pytest.mark.parametrize("path", [OPERATOR, WORKER], ids=lambda p: p.name)
def test_base_image_is_pinned_by_tag(path: Path) -> None:
    froms = instructions(path, "FROM")
    assert froms
    for instruction in froms:
        image = instruction.value.split()[0]
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{path.name}:{instruction.line}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{path.name}:{instruction.line}: {image} is not pinned"


@pytest.mark.parametrize("path", [OPERATOR, WORKER], ids=lambda p: p.name)
def test_runs_as_a_numeric_non_root_user(path: Path) -> None:
    user = last(path, "USER").value.split(":")
    assert user[0].isdigit(), "numeric, so that Kubernetes' runAsNonRoot can verify it"
    assert int(user[0]) != 0 and (len(user) == 1 or int(user[1]) != 0)
    # USER comes after every RUN: nothing later runs as root.
    parsed = parse_dockerfile(path)
    user_at = max(i for i, ins in enumerate(parsed) if ins.keyword == "USER")
    assert not [ins for ins in parsed[user_at:] if ins.keyword == "RUN"]


def test_chart_runs_the_operator_as_the_images_user() -> None:
    values = yaml.safe_load((REPO / "charts" / "rljob-operator" / "values.yaml").read_text())
    uid, gid = (int(x) for x in last(OPERATOR, "USER").value.split(":"))
    assert values["podSecurityContext"]["runAsUser"] == uid
    assert values["podSecurityContext"]["runAsGroup"] == gid


def test_operator_image_installs_only_the_operator_extra() -> None:
    assert pip_requirements(OPERATOR) == [".[operator]"]
    installed = pyproject_requirements() + pyproject_requirements("operator")
    names = {requirement_name(r) for r in installed}
    assert not names & TORCH_LIKE, f"the operator image would pull {names & TORCH_LIKE}"
    assert {"kopf", "kubernetes", "prometheus-client"} <= names


def test_operator_entrypoint_and_default_args() -> None:
    from rljob_operator.__main__ import build_parser

    entrypoint = last(OPERATOR, "ENTRYPOINT").exec_form()
    assert entrypoint[:2] == ["python", "-m"]
    package = entrypoint[2]
    assert (module_dir(package) / "__main__.py").is_file()
    args = build_parser().parse_args(last(OPERATOR, "CMD").exec_form())
    assert args.all_namespaces and args.peering is None and args.liveness


def test_operator_ports_match_the_operator_and_chart_defaults() -> None:
    from rljob_operator.settings import OperatorSettings

    exposed = {int(p.split("/")[0]) for e in instructions(OPERATOR, "EXPOSE") for p in e.value.split()}
    values = yaml.safe_load((REPO / "charts" / "rljob-operator" / "values.yaml").read_text())
    assert exposed == {OperatorSettings().operator_metrics_port, values["operator"]["healthPort"]}
    assert values["metrics"]["port"] == OperatorSettings().operator_metrics_port
    cmd = " ".join(last(OPERATOR, "CMD").exec_form())
    assert f":{values['operator']['healthPort']}/healthz" in cmd


def test_worker_entrypoint_is_the_command_the_operator_writes_into_pytorchjobs() -> None:
    from rljob_api.validation import parse_rljob
    from rljob_operator import builders
    from rljob_operator.settings import OperatorSettings

    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["namespace"] = "default"
    settings = OperatorSettings()
    ptj = builders.build_pytorchjob(parse_rljob(doc), settings)
    (container,) = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    image_command = last(WORKER, "ENTRYPOINT").exec_form() + last(WORKER, "CMD").exec_form()
    assert container["command"] == image_command
    assert image_command[:4] == ["python", "-m", "rljob_worker.runtime.launch", "-m"]
    assert (module_dir("rljob_worker") / "runtime" / "launch.py").is_file()
    assert (module_dir(image_command[4]) / "__main__.py").is_file()
    assert image_command[4] == settings.worker_module
    values = yaml.safe_load((REPO / "charts" / "rljob-operator" / "values.yaml").read_text())
    assert values["worker"]["module"] == settings.worker_module


def test_worker_exposes_the_default_metrics_port() -> None:
    from rljob_api.models import MetricsSpec

    exposed = {int(p.split("/")[0]) for e in instructions(WORKER, "EXPOSE") for p in e.value.split()}
    assert MetricsSpec().port in exposed


def test_worker_pins_equal_pyproject() -> None:
    reqs = pip_requirements(WORKER)
    assert ".[worker,tracking]" in reqs, "the worker image installs the worker extra and the trackers (MLflow, W&B)"
    ours = {requirement_name(r): r.replace(" ", "") for r in pyproject_requirements("worker")}
    pinned = {requirement_name(r): r.replace(" ", "") for r in reqs if not r.startswith(".")}
    assert pinned["megatron-core"] == ours["megatron-core"], "megatron-core pin differs from pyproject's"
    assert "==" in ours["megatron-core"]
    for name, req in pinned.items():
        if name in ours:
            assert req == ours[name], f"{name}: Dockerfile {req} != pyproject {ours[name]}"
    # vLLM comes pinned with its torch in the base image (vllm/vllm-openai:vX.Y.Z).
    base = instructions(WORKER, "FROM")[0].value.split()[0]
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", base)
    assert match, f"the worker image is based on a pinned vLLM image, got {base}"
    gpu = {requirement_name(r): r for r in pyproject_requirements("gpu")}
    assert gpu.get("vllm", "").replace(" ", "") == f"vllm=={match.group(1)}", "pyproject's gpu extra pins the same vLLM"


@pytest.mark.parametrize("path", [OPERATOR, WORKER], ids=lambda p: p.name)
def test_copied_sources_exist(path: Path) -> None:
    for copy in instructions(path, "COPY"):
        words: list[Any] = [w for w in copy.exec_form() if not w.startswith("--")]
        for source in words[:-1]:
            assert (REPO / source).exists(), f"{path.name}:{copy.line}: COPY {source} does not exist"


def test_worker_image_makes_bytecode_for_what_it_installs(tmp_path: Path) -> None:
    """The image sets PYTHONDONTWRITEBYTECODE and its pods run as a user who cannot write site-packages, so bytecode
    not made at build is never made: every process of every pod compiles each module it imports from source
    (bench/NOTES.md, session 18). The build's compile step comes after the last install and, run by a Python of
    its own with the image's PYTHONDONTWRITEBYTECODE set, writes bytecode for a module in its site-packages."""
    env_values = " ".join(i.value for i in instructions(WORKER, "ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env_values
    runs = instructions(WORKER, "RUN")
    installs = [n for n, r in enumerate(runs) if "pip install" in r.value]
    compiles = [n for n, r in enumerate(runs) if "compileall" in r.value]
    assert compiles and installs and compiles[-1] > installs[-1], "compile bytecode after the last pip install"
    python, flag, code = shlex.split(runs[compiles[-1]].value)
    assert (python, flag) == ("python", "-c")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    (site / "installed_module.py").write_text("VALUE = 1\n")
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, env=env, timeout=120)
    assert list((site / "__pycache__").glob("installed_module.*.pyc"))
