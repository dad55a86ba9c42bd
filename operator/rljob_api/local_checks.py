"""What `rljob run` would find missing on this machine, checked offline before anything starts.

A spec can be valid and still fail 13-33 s into a local run: a data file that is not there, a model
folder without config.json, a checkpoint folder this user cannot create. These checks need the local
file system only (no cluster, no network); s3:// objects are read at run time and are listed as not
checked. On a cluster the paths are the pods' (volumes), so only `rljob validate --local` and
`rljob run` apply them. Pure but for reading the file system.
"""
from __future__ import annotations

import os
from pathlib import Path

from rljob_api.models import RLJobSpec


def _local(uri: str) -> Path | None:
    """The local path of a file:// URI or an absolute path; None for s3:// and builtin://."""
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if uri.startswith("/"):
        return Path(uri)
    return None


def _writable_problem(where: str, uri: str) -> str | None:
    """Why a folder at `uri` cannot be created or written by this user (None: it can)."""
    path = _local(uri)
    if path is None:
        return None
    probe = path
    while not probe.exists():  # the nearest existing ancestor decides whether the rest can be created
        probe = probe.parent
    if not probe.is_dir():
        return f"{where}: {uri} cannot be created: {probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{where}: {uri}: {probe} is not writable by this user; choose a folder you can write"
    return None


def local_problems(spec: RLJobSpec, checkpoint_uri: str | None = None) -> tuple[list[str], list[str]]:
    """(problems, not checked): one line each, naming the spec field. ``checkpoint_uri`` overrides
    spec.checkpoint.uri (as `rljob run --checkpoint-uri`)."""
    problems: list[str] = []
    unchecked: list[str] = []

    def remote(where: str, uri: str) -> None:
        if uri.startswith("s3://"):
            unchecked.append(f"{where} {uri} (s3:// objects are read at run time)")

    def model(where: str, uri: str | None, need: str = "config.json") -> None:
        if not uri:
            return
        remote(where, uri)
        path = _local(uri)
        if path is None:
            return
        if not path.is_dir():
            problems.append(f"{where}: {uri} is not a folder on this machine (a Hugging Face checkpoint folder)")
        elif need and not (path / need).is_file():
            problems.append(f"{where}: {uri} has no {need} (a Hugging Face checkpoint folder has config.json, "
                            "tokenizer files and *.safetensors)")

    def data(where: str, uri: str) -> None:
        remote(where, uri)
        path = _local(uri)
        if path is not None and not path.exists():
            problems.append(f"{where}: {uri} does not exist on this machine")

    model("spec.model.path", spec.model.path)
    model("spec.model.tokenizerPath", spec.model.tokenizer_path, need="")
    if spec.critic is not None:
        model("spec.critic.model.path", spec.critic.model.path)
    for i, uri in enumerate(spec.data.train_files):
        data(f"spec.data.trainFiles[{i}]", uri)
    for i, uri in enumerate(spec.data.val_files):
        data(f"spec.data.valFiles[{i}]", uri)
    ckpt_where = "--checkpoint-uri" if checkpoint_uri else "spec.checkpoint.uri"
    ckpt = checkpoint_uri or spec.checkpoint.uri
    remote(ckpt_where, ckpt)
    problem = _writable_problem(ckpt_where, ckpt)
    if problem:
        problems.append(problem)
    if spec.checkpoint.resume_from:
        data("spec.checkpoint.resumeFrom", spec.checkpoint.resume_from)
    if spec.metrics.tensorboard_dir:
        problem = _writable_problem("spec.metrics.tensorboardDir", spec.metrics.tensorboard_dir)
        if problem:
            problems.append(problem)
    last_port = spec.metrics.port + spec.nnodes - 1  # `rljob run` serves pod i's metrics on port + i
    if spec.metrics.enabled and last_port > 65535:
        problems.append(f"spec.metrics.port: {spec.metrics.port}: `rljob run` serves pod i's metrics on port + i, and "
                        f"pod {spec.nnodes - 1} would get {last_port}, past 65535; lower it to at most "
                        f"{65536 - spec.nnodes}")
    if ":" in spec.reward.function:
        unchecked.append(f"spec.reward.function {spec.reward.function} (imported by the worker at start-up)")
    return problems, unchecked
