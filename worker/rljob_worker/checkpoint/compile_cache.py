"""Compiled kernels that outlive the pod: the compile caches kept in the job's object storage.

A pod's first rollout compiles: the static engine's decode step (torch.compile + inductor by layer: ~30 s cold
at 0.5B on an H200, minutes as one whole-step graph), vLLM's torch.compile of the model, Triton kernels. The local caches (compile_config) make a
restarted *container* cheap; a new *pod* (a preemption, a resume on another node) starts with them empty.
So after the first step that compiled, rank 0 packs the caches into one tar and puts it under
``<job prefix>/compile-cache/<key>.tar``; before the model is built, every pod unpacks the archive of its key.

The key is a hash of what invalidates the artefacts (:func:`fingerprint`): the model's shape, the dtype,
the torch / Triton / vLLM / CUDA versions, the GPU and its compute capability, the engine and its compile
settings. A stale entry inside a matching archive is harmless (inductor and vLLM key every entry by its own
graph hash and versions), only useless; the key keeps useless archives from being downloaded at all.

Nothing here may cost the run its progress: a missing, unreadable or corrupt archive is logged and the pod
compiles as it would have; a failed upload is logged and retried at the next check.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob_worker.checkpoint.store import ObjectNotFoundError
from rljob_worker.rollout.compile_config import CACHE_ROOT_VARIABLES

log = logging.getLogger(__name__)

FOLDER = "compile-cache"  # under <namespace>/<job>/, beside the step folders
MAX_ARCHIVE_BYTES = 4 * 2**30  # larger caches stay local (a slow download would cost more than a compile)
# config.json keys that do not change a compiled graph
_IGNORED_MODEL_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "name_or_path"}


def cache_roots(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """{name: directory} of the caches to keep, from the variables that are set. Not torch's default
    ``/tmp/torchinductor_<user>``: inductor writes that path into the environment on its first use when nothing
    was set (a process that did not come through the worker's entry point), and it is the whole machine's cache,
    not this job's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    environ = os.environ if environ is None else environ
    roots = {name: Path(environ[var]) for name, var in CACHE_ROOT_VARIABLES.items() if environ.get(var)}
    if "inductor" in roots and roots["inductor"].resolve() == Path(default_cache_dir()).resolve():
        del roots["inductor"]
    return roots


def fingerprint(model_config: Mapping[str, Any], *, dtype: str, engine: Mapping[str, Any],
                device: str) -> dict[str, Any]:
    """What the compiled artefacts depend on, as one JSON-able dict. ``device``: the GPU's name and compute
    capability (or ``cpu-<arch>``); ``engine``: the rollout engine and its compile settings."""
    import platform
    from importlib import metadata

    import torch

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "model": {k: v for k, v in sorted(model_config.items()) if k not in _IGNORED_MODEL_KEYS},
        "dtype": dtype, "engine": dict(engine), "device": device,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": version("triton"),
        "vllm": version("vllm"), "python": platform.python_version(),
    }


def archive_key(parts: Mapping[str, Any]) -> str:
    """The archive's name: a readable engine/device prefix and a hash of every part."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
    engine = str(parts.get("engine", {}).get("engine", "engine"))
    device = "".join(c if c.isalnum() else "-" for c in str(parts.get("device", "device"))).strip("-").lower()
    return f"{engine}-{device[:40]}-{digest}"


def device_name(device) -> str:
    import platform

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} sm{props.major}{props.minor}"
    return f"cpu-{platform.machine()}"


def snapshot(roots: Mapping[str, Path]) -> dict[str, int]:
    """{name/relative path: size} of every file under the roots (what an archive would hold)."""
    files: dict[str, int] = {}
    for name, root in roots.items():
        if not root.is_dir():
            continue
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".staging-")]  # an unpack in progress
            for n in names:
                # half-written files (inductor: *.tmp, Triton: *.tmp.pid_*) and this module's own markers
                if n.endswith(".lock") or ".tmp" in n or n.startswith(".restored-"):
                    continue
                path = Path(dirpath) / n
                try:
                    if path.is_file() and not path.is_symlink():
                        files[f"{name}/{path.relative_to(root).as_posix()}"] = path.stat().st_size
                except OSError:  # removed while we walk (another process's temp file)
                    continue
    return files


def pack(roots: Mapping[str, Path], files: Mapping[str, int], out: Path) -> int:
    """Write ``files`` (names from :func:`snapshot`) into the tar ``out``; returns its size in bytes."""
    with tarfile.open(out, "w") as tar:
        for rel in sorted(files):
            name, _, sub = rel.partition("/")
            path = roots[name] / sub
            try:
                tar.add(path, arcname=rel, recursive=False)
            except OSError:  # gone since the snapshot: the archive simply lacks it
                continue
    return out.stat().st_size


def unpack(archive: Path, roots: Mapping[str, Path]) -> tuple[int, list[str]]:
    """Extract into the roots; returns the files added and the archive's file names. Everything is extracted
    into a staging folder first and moved into place only when the whole archive read cleanly, so a truncated
    download never leaves a half-written cache entry. Members of caches not configured here are skipped; tarfile's ``data`` filter
    refuses absolute paths, ``..`` and links out. Files already present win: they are this pod's own."""
    staging = {name: Path(tempfile.mkdtemp(prefix=".staging-", dir=_made(root))) for name, root in roots.items()}
    members: list[str] = []
    try:
        with tarfile.open(archive, "r") as tar:
            for member in tar.getmembers():
                name, _, sub = member.name.partition("/")
                if name not in roots or not sub or not member.isfile():
                    continue
                members.append(member.name)
                member.name = sub
                tar.extract(member, staging[name], filter="data")
        written = 0
        for name, stage in staging.items():
            for path in sorted(p for p in stage.rglob("*") if p.is_file()):
                dest = roots[name] / path.relative_to(stage)
                if dest.exists():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest)  # same filesystem: atomic per file
                written += 1
        return written, members
    finally:
        for stage in staging.values():
            shutil.rmtree(stage, ignore_errors=True)


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class CompileCacheSync:
    """Restore at start-up (every process, once per node and key), save when the caches grew (rank 0).

    ``store`` is the job's checkpoint store; ``prefix`` the job's folder in it (``<namespace>/<job>``)."""

    store: Any
    prefix: str
    key: str
    roots: dict[str, Path]
    uploads: bool = False  # rank 0 of the job
    stored: set[str] = field(default_factory=set)  # the files storage's archive holds (never uploaded again)
    _thread: threading.Thread | None = None

    @property
    def object_key(self) -> str:
        return f"{self.prefix}/{FOLDER}/{self.key}.tar"

    def restore(self) -> str:
        """Unpack this key's archive into the local caches unless another process of the pod did; returns
        the start-up line's words. Never raises for a missing or bad archive."""
        if not self.roots:
            return "off (no cache directory set)"
        first = next(iter(self.roots.values()))
        first.mkdir(parents=True, exist_ok=True)
        marker = first / f".restored-{self.key}"  # {"words", "files": what storage holds} for the pod's ranks
        with open(first / ".restore.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the pod's other ranks wait for the first one's download
            try:
                if marker.exists():
                    done = json.loads(marker.read_text())
                    words, stored = "restored by another process of this pod", done["files"]
                else:
                    words, stored = self._download()
                    marker.write_text(json.dumps({"words": words, "files": stored}))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        # what storage already holds: local files beyond it (this pod's, or an earlier container's) get uploaded
        self.stored = set(stored)
        return words

    def _download(self) -> tuple[str, list[str]]:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="rljob-compile-cache-") as tmp:
            local = Path(tmp) / "cache.tar"
            try:
                self.store.get_file(self.object_key, local)
            except Exception as exc:  # noqa: BLE001 - an unreachable store costs a compile, not the run
                if isinstance(exc, (ObjectNotFoundError, FileNotFoundError)):
                    return (f"none yet for this model, engine and GPU ({self.key}); the first rollouts compile "
                            "(~30 s at 0.5B on an H200), then the cache is saved for the next pod"), []
                log.warning("compile cache: could not download %s (%s); compiling as a new pod would",
                            self.store.uri_for(self.object_key), exc)
                return f"not restored ({type(exc).__name__}); the first rollouts compile", []
            size = local.stat().st_size
            try:
                n, members = unpack(local, self.roots)
            except (tarfile.TarError, OSError, EOFError) as exc:
                log.warning("compile cache: %s is not a readable archive (%s); ignored, compiling instead",
                            self.store.uri_for(self.object_key), exc)
                return f"not restored (unreadable archive: {exc}); the first rollouts compile", []
        return (f"restored {n} files ({size / 2**20:.1f} MiB) from {self.store.uri_for(self.object_key)} "
                f"in {time.monotonic() - start:.1f}s"), members

    def save_if_grown(self, background: bool = True) -> bool:
        """Rank 0: when the caches hold files the restored archive did not, pack and upload all of them
        (in a thread: the training goes on). Returns whether an upload started."""
        if not self.uploads or not self.roots or (self._thread is not None and self._thread.is_alive()):
            return False
        files = snapshot(self.roots)
        if not set(files) - self.stored:
            return False
        if not background:
            self._upload(files)
            return True
        self._thread = threading.Thread(target=self._upload, args=(files,), name="compile-cache-upload", daemon=True)
        self._thread.start()
        return True

    def _upload(self, files: dict[str, int]) -> None:
        start = time.monotonic()
        try:
            with tempfile.TemporaryDirectory(prefix="rljob-compile-cache-") as tmp:
                local = Path(tmp) / "cache.tar"
                size = pack(self.roots, files, local)
                if size > MAX_ARCHIVE_BYTES:
                    log.warning("compile cache: %.1f GiB is above the %.0f GiB kept in storage; a new pod "
                                "compiles again", size / 2**30, MAX_ARCHIVE_BYTES / 2**30)
                    self.stored = set(files)  # not again for the same content
                    return
                self.store.put_file(local, self.object_key)  # one object: readers see all of it or none
            self.stored = set(files)
            log.info("compile cache: saved %d files (%.1f MiB) to %s in %.1fs", len(files), size / 2**20,
                     self.store.uri_for(self.object_key), time.monotonic() - start)
        except Exception as exc:  # noqa: BLE001 - the run goes on; the next check tries again
            log.warning("compile cache: upload to %s failed (%s); retried at the next check",
                        self.store.uri_for(self.object_key), exc)

    def wait(self, timeout: float | None = 120.0) -> None:
        """Let an upload in flight finish (bounded: exiting is never held up for long)."""
        if self._thread is not None:
            self._thread.join(timeout)


def model_config_of(model_dir: Path | None) -> dict[str, Any]:
    """The model folder's config.json (an empty dict when there is none to read)."""
    if model_dir is None:
        return {}
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
