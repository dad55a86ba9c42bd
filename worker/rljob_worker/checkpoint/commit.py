"""The checkpoint commit protocol on object storage: atomic steps, retention, resume.

This layer knows folders and objects, not models: the run's face (``run_checkpoints.RunCheckpoints``)
writes a step folder and hands it here to be committed.

Layout under ``<checkpoint.uri>/<base_prefix>/`` (the trainer uses ``<namespace>/<rljob>``)::

    step_000030/<files of the local checkpoint folder, hidden ones such as .metadata included>
    step_000030/meta.json     step, metrics, spec hash, created time, files [{rel_path, size, sha256}]
    step_000030/COMMIT        written LAST, after every file is uploaded and its size checked
    step_000060/...

Rules every reader and writer here follows:

1. A step folder without ``COMMIT`` does not exist. Readers (:meth:`CheckpointManager.latest_committed`,
   :meth:`~CheckpointManager.list_committed`, :meth:`~CheckpointManager.restore`) skip or refuse it.
2. ``COMMIT`` is written only after all files and ``meta.json`` are uploaded and a listing of the
   step folder shows every file of ``meta.json`` with its size. ``COMMIT`` carries the sha256 of
   ``meta.json``, and ``restore`` checks every downloaded file against the sha256 in ``meta.json``.
3. Retention deletes a step only after a newer one is committed, keeps the ``max_to_keep`` newest
   committed steps, and deletes ``COMMIT`` first, then the rest: a crash mid-delete leaves an
   uncommitted folder (ignored, cleaned later), never a committed but incomplete one. Uncommitted
   folders older than the newest committed step are leftovers of crashed saves and are cleaned too;
   newer ones may be uploads in flight and are left alone.

Committing overlaps training: :meth:`CheckpointManager.commit_folder` returns a :class:`SaveHandle` at once and
uploads in a background thread, one commit at a time. A new ``commit_folder`` or
:meth:`~CheckpointManager.wait_for_commit`
first waits for the previous upload and re-raises its error (errors are never swallowed). The caller
must not change or delete ``local_dir`` until the handle is done (``remove_local=True`` deletes it
after a successful commit).

Multi-rank use:

- Shared local folder (one node, or a shared filesystem): every rank writes its shards into the
  same ``local_dir`` (megatron's distributed checkpoint does this), then after a barrier rank 0 calls
  ``commit_folder(local_dir, step, ...)``. Other ranks do nothing.
- Per-node folders (several nodes): every rank (or one rank per node) calls
  ``upload_rank_files(local_dir, step, rank)`` (after rank 0 has called ``prepare_step(step)`` and a
  barrier), which uploads its files and a small manifest with
  their sizes and checksums (``step_000030/.rljob/rank_00003.json``); after a barrier rank 0 calls
  ``commit(step, metrics, spec_hash, expected_ranks=[...])``, which merges the manifests, checks the
  listing and writes ``meta.json`` and then ``COMMIT``. Two ranks may upload the same file (for
  example a shared ``metadata.json``) only with the same content.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rljob_worker.checkpoint.store import FileEntry, ObjectNotFoundError, ObjectStore, StorageError

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
META = "meta.json"
RANK_DIR = ".rljob"
FORMAT = "rljob-checkpoint/v1"
_RESERVED = {COMMIT, META, RANK_DIR}
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CheckpointError(StorageError):
    """A checkpoint is missing, incomplete or corrupt, or a save could not be committed."""


class CheckpointCorrupt(CheckpointError):
    """A committed step's downloaded files do not match the sizes and sha256 sums of its meta.json."""


class ProgressLost(CheckpointError):
    """The job has saved progress, none of which loads any more; starting from step 0 would hide that."""


QUARANTINE = "quarantine"  # <base>/quarantine/step_NNNNNN-<time>/: corrupt steps, kept for inspection
SUPERSEDED = "superseded"  # <base>/superseded/<time>/step_NNNNNN/: an earlier run's steps (resumeMode: disable)
# superseded/<time>/ folders kept (each holds one earlier job's steps); older ones are deleted when a
# new one is set aside. maxToKeep 0 (keep every checkpoint) keeps them all.
SUPERSEDED_KEEP = 2


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def step_dirname(step: int) -> str:
    """``step_000030``: six digits, zero padded (more digits past 999999)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


def spec_hash(spec: Mapping[str, Any]) -> str:
    """A stable sha256 (hex) of a JSON-like dict: key order and whitespace do not matter."""
    blob = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    return str(o)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _check_local_dir(local_dir: Path) -> None:
    """Fail at the call, not in the background thread, on a missing folder or reserved names."""
    if not local_dir.is_dir():
        raise CheckpointError(f"local checkpoint folder {local_dir} does not exist")
    reserved = sorted(p.name for p in local_dir.iterdir() if p.name in _RESERVED)
    if reserved:
        raise CheckpointError(f"{local_dir} contains {reserved}, names the checkpoint layout reserves")


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint step. ``key`` is the step folder relative to ``store``'s root."""

    step: int
    key: str = field(compare=False)
    uri: str
    store: ObjectStore = field(repr=False, compare=False)
    metrics: dict = field(default_factory=dict, compare=False)
    spec_hash: str | None = None
    created: str | None = None
    files: tuple[FileEntry, ...] = ()
    spec_fields: dict = field(default_factory=dict, compare=False)  # the settings a resume must not change
    owner: str | None = field(default=None, compare=False)  # the RLJob uid (or local run id) that saved it

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class SaveHandle:
    """A save in progress. ``wait()`` returns the committed :class:`CheckpointRef` or raises."""

    def __init__(self, step: int, uri: str):
        self.step = step
        self.uri = uri
        self.started = time.monotonic()
        self.seconds: float | None = None  # upload + commit time, once done
        self._done = threading.Event()
        self._ref: CheckpointRef | None = None
        self._error: BaseException | None = None
        self._reported = False  # the manager raised the error once already

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointRef:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint save of step {self.step} still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._ref is not None
        return self._ref

    @property
    def ref(self) -> CheckpointRef | None:
        return self._ref

    def _finish(self, ref: CheckpointRef | None, error: BaseException | None) -> None:
        self._ref, self._error = ref, error
        self.seconds = time.monotonic() - self.started
        self._done.set()


@dataclass
class _StepListing:
    step: int
    objects: dict[str, int] = field(default_factory=dict)  # rel_path inside the step folder -> size

    @property
    def committed(self) -> bool:
        return COMMIT in self.objects


@dataclass(frozen=True)
class RetentionPlan:
    """Which step folders retention deletes: committed ones (COMMIT first) and uncommitted leftovers."""

    delete_committed: tuple[int, ...]
    delete_partial: tuple[int, ...]


class CheckpointManager:
    """Saves, lists, restores and prunes checkpoint steps under ``base_prefix`` of ``store``."""

    def __init__(
        self,
        store: ObjectStore,
        base_prefix: str = "",
        max_to_keep: int | None = None,
        *,
        max_workers: int = 8,
        owner: str | None = None,
    ):
        if max_to_keep is not None and max_to_keep < 0:
            raise ValueError(f"max_to_keep must be >= 0 or None (keep all), got {max_to_keep}")
        self.store = store
        self.base_prefix = base_prefix.strip("/")
        self.max_to_keep = max_to_keep or None
        self.max_workers = max_workers
        # Who saves here: the RLJob's uid (its restarted pods share it) or a local run's id. Recorded in
        # each step's meta.json, so resumeMode disable can tell this job's own steps from an earlier job's.
        self.owner = owner or None
        self._pending: SaveHandle | None = None
        self._lock = threading.Lock()  # one save at a time
        self._retention_lock = threading.Lock()
        self.quarantined: list[dict[str, Any]] = []  # {"step", "uri", "reason"} per step quarantined by this process

    def __repr__(self) -> str:
        return f"CheckpointManager({self.base_uri!r}, max_to_keep={self.max_to_keep})"

    # -- keys ---------------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.base_prefix, *parts) if p and p.strip("/"))

    def step_key(self, step: int) -> str:
        return self._key(step_dirname(step))

    @property
    def base_uri(self) -> str:
        return self.store.uri_for(self.base_prefix) if self.base_prefix else self.store.uri

    def step_uri(self, step: int) -> str:
        return self.store.uri_for(self.step_key(step))

    # -- listing ------------------------------------------------------------------------------

    def _scan(self) -> dict[int, _StepListing]:
        base = self._key() + "/" if self._key() else ""
        steps: dict[int, _StepListing] = {}
        for obj in self.store.list_prefix(base):
            rest = obj.key[len(base):]
            folder, _, rel = rest.partition("/")
            m = _STEP_RE.match(folder)
            if not m or not rel:
                continue
            step = int(m.group(1))
            steps.setdefault(step, _StepListing(step)).objects[rel] = obj.size
        return steps

    def _load_ref(self, step: int, objects: Mapping[str, int] | None = None, store: ObjectStore | None = None,
                  key: str | None = None) -> CheckpointRef:
        """Read COMMIT and meta.json of a step and check them against the listing."""
        store = store or self.store
        key = key or self.step_key(step)
        if objects is None:
            prefix = key + "/"
            objects = {o.key[len(prefix):]: o.size for o in store.list_prefix(prefix)}
        where = store.uri_for(key)
        if COMMIT not in objects:
            raise CheckpointError(f"{where} is not a committed checkpoint (no {COMMIT} object)")
        try:
            commit = json.loads(store.get_bytes(f"{key}/{COMMIT}"))
            meta_raw = store.get_bytes(f"{key}/{META}")
        except ObjectNotFoundError as e:
            raise CheckpointError(f"{where}: {COMMIT} or {META} disappeared while reading") from e
        except ValueError as e:
            raise CheckpointError(f"{where}: {COMMIT} is not valid JSON") from e
        if commit.get("meta_sha256") != hashlib.sha256(meta_raw).hexdigest():
            raise CheckpointError(f"{where}: {META} does not match the checksum recorded in {COMMIT}")
        meta = json.loads(meta_raw)
        files = tuple(FileEntry.from_json(f) for f in meta.get("files", []))
        problems = []
        for f in files:
            size = objects.get(f.rel_path)
            if size is None:
                problems.append(f"{f.rel_path} missing")
            elif size != f.size:
                problems.append(f"{f.rel_path} has {size} bytes, {META} says {f.size}")
        if problems:
            raise CheckpointError(f"{where}: committed but incomplete: " + "; ".join(problems[:5]))
        return CheckpointRef(
            step=int(meta["step"]), key=key, uri=where, store=store, metrics=dict(meta.get("metrics") or {}),
            spec_hash=meta.get("spec_hash"), created=meta.get("created"), files=files,
            spec_fields=dict(meta.get("spec_fields") or {}), owner=meta.get("owner"),
        )

    def list_committed(self) -> list[CheckpointRef]:
        """Committed steps, oldest first (COMMIT present; meta.json is not read, so files is empty)."""
        return [
            CheckpointRef(step=s, key=self.step_key(s), uri=self.step_uri(s), store=self.store)
            for s, listing in sorted(self._scan().items()) if listing.committed
        ]

    def latest_committed(self) -> CheckpointRef | None:
        """The newest committed step whose meta.json matches the listing, or None.

        A committed step that fails the check (files deleted behind our back) is skipped with a
        warning and the next older one is tried, so auto-resume does not crash-loop on it.
        """
        steps = self._scan()
        for step in sorted((s for s, l in steps.items() if l.committed), reverse=True):
            try:
                return self._load_ref(step, steps[step].objects)
            except CheckpointError as e:
                log.warning("skipping checkpoint step %d: %s", step, e)
        return None

    def ref_from_uri(self, uri: str) -> CheckpointRef:
        """The committed step at ``uri`` (a ``.../step_000030`` folder) or the newest committed step
        under ``uri`` (a job's checkpoint folder). The URI may point outside this manager's store; it
        is opened with the same credentials."""
        uri = uri.rstrip("/")
        last = uri.rsplit("/", 1)[-1]
        m = _STEP_RE.match(last)
        if m:
            store = self.store.sibling(uri.rsplit("/", 1)[0])
            other = CheckpointManager(store, "", None, max_workers=self.max_workers)
            return other._load_ref(int(m.group(1)), store=store, key=last)
        other = CheckpointManager(self.store.sibling(uri), "", None, max_workers=self.max_workers)
        ref = other.latest_committed()
        if ref is None:
            raise CheckpointError(f"{uri}: no committed checkpoint found (no step_NNNNNN folder with {COMMIT})")
        return ref

    # -- saving -------------------------------------------------------------------------------

    def commit_folder(
        self,
        local_dir: str | Path,
        step: int,
        metrics: Mapping[str, Any] | None = None,
        spec_hash: str | None = None,
        blocking: bool = False,
        *,
        remove_local: bool = False,
        spec_fields: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Upload ``local_dir`` as step ``step`` and commit it, in the background unless ``blocking``.

        Waits for the previous save first and re-raises its error if nobody has seen it yet.
        With ``blocking=True`` the save's own error is raised here.
        """
        local_dir = Path(local_dir)
        self.wait_for_commit()
        _check_local_dir(local_dir)
        handle = SaveHandle(step, self.step_uri(step))
        metrics = dict(metrics or {})

        def run() -> None:
            try:
                ref = self._save_now(local_dir, step, metrics, spec_hash, spec_fields)
                if remove_local:
                    shutil.rmtree(local_dir, ignore_errors=True)
                handle._finish(ref, None)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                log.error("checkpoint save of step %d to %s failed: %s", step, handle.uri, e)
                handle._finish(None, e)

        with self._lock:
            self._pending = handle
        if blocking:
            run()
            self.wait_for_commit()
        else:
            threading.Thread(target=run, name=f"rljob-ckpt-save-{step}", daemon=False).start()
        return handle

    def wait_for_commit(self) -> CheckpointRef | None:
        """Wait for the save in flight; re-raise its error once. Returns its ref (None if none)."""
        with self._lock:
            handle = self._pending
        if handle is None:
            return None
        handle._done.wait()
        if handle._error is not None and not handle._reported:
            handle._reported = True
            raise handle._error
        return handle._ref

    def prepare_step(self, step: int) -> None:
        """Remove an existing folder of this step (a crashed or overwritten save), COMMIT first.

        ``commit_folder`` does this itself; with ``upload_rank_files`` rank 0 calls it before the barrier
        that precedes the uploads, so stale manifests of an earlier attempt are not merged."""
        key = self.step_key(step)
        existing = self.store.list_prefix(key + "/")
        if existing:
            if any(o.key == f"{key}/{COMMIT}" for o in existing):
                log.warning("overwriting committed checkpoint step %d at %s", step, self.step_uri(step))
            self._delete_step(step)

    def _save_now(self, local_dir: Path, step: int, metrics: dict, spec_hash: str | None,
                  spec_fields: Mapping[str, Any] | None = None) -> CheckpointRef:
        t0 = time.monotonic()
        self.prepare_step(step)
        entries = self.store.upload_dir(local_dir, self.step_key(step), self.max_workers)
        if not entries:
            raise CheckpointError(f"{local_dir} holds no files; nothing to checkpoint for step {step}")
        ref = self._commit(step, entries, metrics, spec_hash, spec_fields)
        log.info("checkpoint step %d committed to %s: %d files, %.1f MB in %.1f s", step, ref.uri,
                 len(entries), ref.total_bytes / 1e6, time.monotonic() - t0)
        self._retention_after_commit()
        return ref

    def upload_rank_files(self, local_dir: str | Path, step: int, rank: int) -> list[FileEntry]:
        """Upload this rank's files of step ``step`` and its manifest; rank 0 commits later."""
        local_dir = Path(local_dir)
        _check_local_dir(local_dir)
        entries = self.store.upload_dir(local_dir, self.step_key(step), self.max_workers)
        manifest = {"rank": rank, "files": [e.to_json() for e in entries]}
        self.store.put_bytes(self._manifest_key(step, rank), json.dumps(manifest).encode())
        return entries

    def _manifest_key(self, step: int, rank: int) -> str:
        return f"{self.step_key(step)}/{RANK_DIR}/rank_{rank:05d}.json"

    def commit(
        self,
        step: int,
        metrics: Mapping[str, Any] | None = None,
        spec_hash: str | None = None,
        expected_ranks: Iterable[int] | None = None,
        spec_fields: Mapping[str, Any] | None = None,
    ) -> CheckpointRef:
        """Rank 0, after a barrier: merge the ranks' manifests, verify, write meta.json then COMMIT."""
        key = self.step_key(step)
        prefix = f"{key}/{RANK_DIR}/"
        manifests = [o.key for o in self.store.list_prefix(prefix) if o.key.endswith(".json")]
        ranks_seen = set()
        merged: dict[str, FileEntry] = {}
        for mkey in manifests:
            manifest = json.loads(self.store.get_bytes(mkey))
            ranks_seen.add(int(manifest["rank"]))
            for f in map(FileEntry.from_json, manifest["files"]):
                prev = merged.setdefault(f.rel_path, f)
                if prev != f:
                    raise CheckpointError(
                        f"step {step}: ranks uploaded different contents for {f.rel_path} "
                        f"({prev.sha256[:12]} vs {f.sha256[:12]})"
                    )
        if expected_ranks is not None:
            missing = sorted(set(expected_ranks) - ranks_seen)
            if missing:
                raise CheckpointError(f"step {step}: ranks {missing} have not uploaded their files")
        if not merged:
            raise CheckpointError(f"step {step}: no rank uploaded any file under {self.step_uri(step)}")
        ref = self._commit(step, sorted(merged.values(), key=lambda e: e.rel_path), dict(metrics or {}), spec_hash,
                           spec_fields)
        self._retention_after_commit()
        return ref

    def _commit(self, step: int, entries: list[FileEntry], metrics: dict, spec_hash: str | None,
                spec_fields: Mapping[str, Any] | None = None) -> CheckpointRef:
        """Write meta.json, check the listing against it, then write COMMIT (the only commit point)."""
        key = self.step_key(step)
        meta = {
            "format": FORMAT,
            "step": step,
            "metrics": metrics,
            "spec_hash": spec_hash,
            "spec_fields": dict(spec_fields or {}),
            "owner": self.owner,
            "created": _now(),
            "total_bytes": sum(e.size for e in entries),
            "files": [e.to_json() for e in entries],
        }
        meta_raw = json.dumps(meta, indent=1, default=_json_default).encode()
        self.store.put_bytes(f"{key}/{META}", meta_raw)
        listed = {o.key[len(key) + 1:]: o.size for o in self.store.list_prefix(key + "/")}
        problems = [
            f"{e.rel_path}: " + ("missing" if e.rel_path not in listed else f"{listed[e.rel_path]} bytes, expected {e.size}")
            for e in entries if listed.get(e.rel_path) != e.size
        ]
        if problems:
            raise CheckpointError(
                f"step {step} at {self.step_uri(step)} not committed: the listing does not match the upload: "
                + "; ".join(problems[:5])
            )
        commit = {"step": step, "meta_sha256": hashlib.sha256(meta_raw).hexdigest(), "committed": _now()}
        self.store.put_bytes(f"{key}/{COMMIT}", json.dumps(commit).encode())
        return CheckpointRef(
            step=step, key=key, uri=self.step_uri(step), store=self.store, metrics=metrics,
            spec_hash=spec_hash, created=meta["created"], files=tuple(entries), spec_fields=dict(spec_fields or {}),
            owner=self.owner,
        )

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, ref_or_uri: CheckpointRef | str, local_dir: str | Path) -> CheckpointRef:
        """Download a committed step into ``local_dir`` (which must be empty or missing) and verify
        every file's size and sha256 against meta.json. Raises :class:`CheckpointError` on mismatch."""
        if isinstance(ref_or_uri, str):
            ref = self.ref_from_uri(ref_or_uri)
        else:
            ref = ref_or_uri
        if not ref.files:  # from list_committed(): read and check meta.json now
            ref = self._load_ref(ref.step, store=ref.store, key=ref.key)
        local_dir = Path(local_dir)
        if local_dir.exists() and any(local_dir.iterdir()):
            raise CheckpointError(f"restore target {local_dir} is not empty")
        local_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        got = {e.rel_path: e for e in ref.store.download_dir(
            ref.key, local_dir, self.max_workers, rel_paths=[f.rel_path for f in ref.files]
        )}
        bad = [
            f"{f.rel_path}: sha256 {got[f.rel_path].sha256[:12]}..., {META} says {f.sha256[:12]}..."
            if f.rel_path in got and got[f.rel_path].size == f.size
            else f"{f.rel_path}: size {got[f.rel_path].size if f.rel_path in got else 'missing'}, {META} says {f.size}"
            for f in ref.files
            if got.get(f.rel_path) != f
        ]
        if bad:
            raise CheckpointCorrupt(f"checkpoint {ref.uri} is corrupt: " + "; ".join(bad[:5]))
        log.info("restored checkpoint step %d from %s: %.1f MB in %.1f s", ref.step, ref.uri,
                 ref.total_bytes / 1e6, time.monotonic() - t0)
        return ref

    # -- moving steps out of the resume path ---------------------------------------------------

    def _move_step(self, step: int, dest_key: str) -> str:
        """Copy step ``step``'s objects under ``dest_key`` (a folder no reader treats as a step), then
        delete the original, COMMIT first. A crash part-way leaves the original committed (copy
        unfinished) or uncommitted (delete unfinished): never two committed copies in the resume path."""
        key = self.step_key(step)
        objects = [o.key for o in self.store.list_prefix(key + "/")]
        copies = [(k, f"{dest_key}/{k[len(key) + 1:]}") for k in objects]
        for src, dst in sorted(copies, key=lambda kv: kv[0].endswith("/" + COMMIT)):  # COMMIT copied last
            self.store.copy(src, dst)
        self._delete_step(step)
        return self.store.uri_for(dest_key)

    def quarantine(self, step: int, reason: str = "") -> str:
        """Move a corrupt committed step to ``<base>/quarantine/step_NNNNNN-<time>/``; returns its new URI.

        Recorded in ``self.quarantined`` so the progress report can tell the operator (a Warning event)."""
        uri = self._move_step(step, self._key(QUARANTINE, f"{step_dirname(step)}-{_stamp()}"))
        self.quarantined.append({"step": step, "uri": uri, "reason": reason[:200]})
        return uri

    def _step_owner(self, step: int) -> str | None:
        try:
            return self._load_ref(step).owner
        except CheckpointError:
            return None  # unreadable: not provably this job's

    def set_aside_committed(self) -> tuple[list[int], str | None]:
        """Move every committed step of an earlier job to ``<base>/superseded/<time>/`` (``resumeMode:
        disable`` on a prefix holding an earlier run): the new run then owns the prefix, retention counts
        only its steps and a later auto-resume loads only its steps; the old ones stay for whoever wants
        them. Steps this job saved itself (same ``owner``: a restart of the same RLJob) stay in place.
        Returns the steps moved and the folder they went to."""
        steps = [r.step for r in self.list_committed()
                 if self.owner is None or self._step_owner(r.step) != self.owner]
        if not steps:
            return [], None
        dest = self._key(SUPERSEDED, _stamp())
        for step in steps:
            self._move_step(step, f"{dest}/{step_dirname(step)}")
        self._prune_superseded()
        return steps, self.store.uri_for(dest)

    def _prune_superseded(self) -> None:
        """Keep the newest SUPERSEDED_KEEP folders under superseded/ (all of them with maxToKeep 0)."""
        if self.max_to_keep is None:
            return
        base = self._key(SUPERSEDED) + "/"
        folders = sorted({o.key[len(base):].split("/", 1)[0] for o in self.store.list_prefix(base)})
        for old in folders[:-SUPERSEDED_KEEP]:
            prefix = f"{base}{old}/"
            for commit in [o.key for o in self.store.list_prefix(prefix) if o.key.endswith("/" + COMMIT)]:
                self.store.delete(commit)  # uncommit first, as retention does
            self.store.delete_prefix(prefix)
            log.info("deleted the superseded steps under %s (only the newest %d superseded runs are kept)",
                     self.store.uri_for(prefix.rstrip("/")), SUPERSEDED_KEEP)

    def list_quarantined(self) -> list[dict[str, Any]]:
        """Steps under ``<base>/quarantine/``: ``{"step", "uri", "owner"}``, oldest step first."""
        base = self._key(QUARANTINE) + "/"
        folders = sorted({o.key[len(base):].split("/", 1)[0] for o in self.store.list_prefix(base)})
        out = []
        for folder in folders:
            m = re.match(r"^step_(\d{6,})-", folder)
            if not m:
                continue
            try:
                owner = json.loads(self.store.get_bytes(f"{base}{folder}/{META}")).get("owner")
            except (StorageError, ValueError, AttributeError):
                owner = None
            out.append({"step": int(m.group(1)), "uri": self.store.uri_for(base + folder), "owner": owner})
        return sorted(out, key=lambda q: q["step"])

    # -- retention ----------------------------------------------------------------------------

    def plan_retention(self, steps: Mapping[int, _StepListing] | None = None) -> RetentionPlan:
        steps = self._scan() if steps is None else steps
        committed = sorted(s for s, l in steps.items() if l.committed)
        if not committed:
            return RetentionPlan((), ())
        newest = committed[-1]
        old_committed = committed[:-self.max_to_keep] if self.max_to_keep else []
        partial = sorted(s for s, l in steps.items() if not l.committed and s < newest)
        return RetentionPlan(tuple(old_committed), tuple(partial))

    def _delete_step(self, step: int) -> None:
        key = self.step_key(step)
        self.store.delete(f"{key}/{COMMIT}")  # uncommit first: a crash from here on leaves a partial folder
        self.store.delete_prefix(key + "/")

    def apply_retention(self) -> RetentionPlan:
        """Delete committed steps beyond the newest ``max_to_keep`` and partial folders older than the
        newest committed step. Never deletes the newest committed step. Returns what it deleted."""
        with self._retention_lock:
            plan = self.plan_retention()
            for step in plan.delete_committed + plan.delete_partial:
                self._delete_step(step)
            if plan.delete_committed or plan.delete_partial:
                log.info("checkpoint retention deleted committed steps %s and partial steps %s under %s",
                         list(plan.delete_committed), list(plan.delete_partial), self.base_uri)
            return plan

    def _retention_after_commit(self) -> None:
        try:
            self.apply_retention()
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; the next save retries
            log.warning("checkpoint retention failed (will retry after the next save): %s", e)


def resolve_resume(mode: str, manager: CheckpointManager, explicit_uri: str | None = None) -> CheckpointRef | None:
    """Which checkpoint to start from: ``auto`` (newest committed, or None), ``disable`` (None),
    ``uri`` (the committed step at ``explicit_uri``, or the newest committed one under it; raises
    :class:`CheckpointError` if there is none). A URI passed as ``mode`` is treated as ``uri``."""
    mode_s = str(getattr(mode, "value", mode)).strip()
    if "://" in mode_s or mode_s.startswith("/"):
        mode_s, explicit_uri = "uri", explicit_uri or mode_s
    mode_s = mode_s.lower()
    if mode_s == "disable":
        return None
    if mode_s == "auto":
        ref = manager.latest_committed()
        if ref is None:
            log.info("no committed checkpoint under %s; starting from scratch", manager.base_uri)
        return ref
    if mode_s == "uri":
        if not explicit_uri:
            raise ValueError("checkpoint.resume is 'uri' but checkpoint.resumeFrom is empty")
        # resumeFrom seeds the first start only: once this job has committed a step of its own,
        # a restart continues from that, not from the seed again.
        own = manager.latest_committed()
        if own is not None:
            log.warning("resuming from this job's own step %d, not from resumeFrom %s (the seed of its first "
                        "start only)", own.step, explicit_uri)
            return own
        return manager.ref_from_uri(explicit_uri)
    raise ValueError(f"checkpoint.resume must be auto, disable or uri, got {mode!r}")


class SpecChanged(CheckpointError):
    """The spec differs from the checkpoint's in a setting a resume must not change."""


def changed_spec_fields(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, current value)`` for every field recorded in both that differs.
    Fields recorded on one side only (a checkpoint from an older version) are not compared."""
    return [(k, saved[k], current[k]) for k in sorted(saved) if k in current and saved[k] != current[k]]


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "value", mode)).strip().lower()


def is_own_step(manager: CheckpointManager, ref: CheckpointRef) -> bool:
    """Whether ``ref`` is a step under the job's own prefix (not a resumeFrom seed from elsewhere)."""
    base = manager._key()
    return ref.store is manager.store and (not base or ref.key.startswith(base + "/"))


def restore_for_resume(manager: CheckpointManager, mode: Any, resume_from: str | None, local_dir: str | Path,
                       spec_fields: Mapping[str, Any] | None = None) -> CheckpointRef | None:
    """Rank 0 at start-up: choose the checkpoint to start from and download it into ``local_dir``.

    - ``disable``: the job's committed steps (an earlier run's) are moved to ``superseded/`` so this
      run owns the prefix; returns None.
    - ``auto`` / ``uri``: as :func:`resolve_resume` (``resumeFrom`` only until the job has a step of
      its own). A step of the job's own whose ``spec_fields`` differ from ``spec_fields`` raises
      :class:`SpecChanged` naming the fields and the ways out. A step of its own whose files fail
      their checksums is moved to ``quarantine/`` and the previous committed step is tried.
    """
    local_dir = Path(local_dir)
    if _mode_name(mode) == "disable":
        moved, where = manager.set_aside_committed()
        if moved:
            log.warning("resumeMode is disable: moved the committed steps %s of an earlier run under %s to %s "
                        "(kept, not deleted); this run starts from scratch and owns the prefix", moved,
                        manager.base_uri, where)
        if manager.owner is None:
            return None
        if not manager.list_committed():
            _refuse_lost_progress(manager, own_only=True)
            return None
        log.warning("resumeMode is disable, but the committed steps under %s are this job's own (a restart of "
                    "the same RLJob or run, %s): continuing from them", manager.base_uri, manager.owner)
        mode, resume_from = "auto", None
    while True:
        if _mode_name(mode) != "auto" and manager.latest_committed() is None:
            _refuse_lost_progress(manager)  # a seed never silently replaces the job's own progress
        ref = resolve_resume(mode, manager, resume_from)
        if ref is None:
            _refuse_lost_progress(manager)
            return None
        own = is_own_step(manager, ref)
        if own and spec_fields is not None:
            changes = changed_spec_fields(ref.spec_fields, spec_fields)
            if changes:
                what = "; ".join(f"spec.{k} was {old!r}, now {new!r}" for k, old, new in changes)
                raise SpecChanged(
                    f"{what}: the committed checkpoint step {ref.step} at {ref.uri} belongs to the run before the "
                    "change and cannot continue with it. Revert the change to continue that run, or start over with "
                    "spec.checkpoint.resumeMode: disable (moves the old steps aside), a new job name, or "
                    "`rljob run --fresh` (deletes them)")
        try:
            return manager.restore(ref, local_dir)
        except CheckpointCorrupt as e:
            if not own:
                raise
            where = manager.quarantine(ref.step, str(e))
            log.warning("%s; moved step %d to %s for inspection and falling back to the previous committed step",
                        e, ref.step, where)
            shutil.rmtree(local_dir, ignore_errors=True)


def _refuse_lost_progress(manager: CheckpointManager, own_only: bool = False) -> None:
    """Raise :class:`ProgressLost` when the job saved steps none of which loads (all quarantined as corrupt,
    or committed but incomplete): a silent start from step 0 would throw that progress away.
    ``own_only``: count only quarantined steps this job (``manager.owner``) saved."""
    committed = [r.step for r in manager.list_committed()]
    quarantined = [q for q in manager.list_quarantined() if not own_only or q["owner"] == manager.owner]
    if not committed and not quarantined:
        return
    parts = []
    if committed:
        parts.append(f"committed steps {committed} are incomplete (their files do not match meta.json)")
    if quarantined:
        parts.append("steps failed their checksums and were moved to " + ", ".join(
            f"{q['uri']}" for q in quarantined[-5:]) + (f" (and {len(quarantined) - 5} more)" if len(quarantined) > 5 else ""))
    raise ProgressLost(
        f"this job saved progress under {manager.base_uri}/ but none of it loads: " + "; ".join(parts) + ". "
        "Starting from step 0 would throw it away, so the run stops. To start over on purpose, move "
        f"{manager.base_uri}/{QUARANTINE}/ elsewhere (the corrupt steps stay for inspection)"
        + (f" and delete the incomplete steps {committed}" if committed else "")
        + ", give the job a new name, or run `rljob run --fresh` (deletes the job's checkpoints)")


__all__ = [
    "COMMIT",
    "META",
    "QUARANTINE",
    "SUPERSEDED",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointRef",
    "ProgressLost",
    "RetentionPlan",
    "SaveHandle",
    "SpecChanged",
    "changed_spec_fields",
    "resolve_resume",
    "restore_for_resume",
    "spec_hash",
    "step_dirname",
]
