"""Object storage for checkpoints: one small interface, a local-filesystem store and an S3 store.

This is the only module of the project that imports boto3 (STYLE.md habit 12); everything above it
(``checkpointing.py``, the trainer) talks to the :class:`ObjectStore` protocol and is tested against
either implementation.

Keys are ``/``-separated paths relative to the store's root: for ``s3://bucket/some/prefix`` the
key ``step_000030/meta.json`` is the object ``some/prefix/step_000030/meta.json`` in ``bucket``; for
``file:///data/ckpt`` (or ``/data/ckpt``) it is the file ``/data/ckpt/step_000030/meta.json``.

Guarantees both stores give:

- a reader never sees half an object: S3 objects appear whole when the PUT (or the multipart
  complete) returns; :class:`LocalStore` writes a hidden temporary file and ``os.replace``-s it;
- transient failures are retried: :class:`S3Store` uses botocore's own retries (``standard`` mode)
  for throttling and 5xx answers, and wraps every operation in an outer loop with exponential
  backoff that keeps retrying connection errors, 5xx and throttling for up to ``retry_timeout_s``
  seconds in total (60 s by default), so a storage outage of a few seconds does not lose a save;
- errors that retrying cannot fix (wrong credentials, missing bucket or key) raise
  :class:`StorageError` at once with a message that names the setting to fix. Secrets never
  appear in messages, logs or ``repr``.

Credentials for S3 default to the environment variables ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, which the operator injects from the Secret named by
``spec.s3.credentialsSecretRef``. Call :meth:`ObjectStore.check_access` at start-up so wrong
credentials fail there and not at the first save hours later.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1024 * 1024
_HASH_CHUNK = 4 * MiB
# Hidden temporary files of LocalStore carry this marker; listings skip them.
_TMP_MARKER = ".rljob-tmp-"
# Hidden lock files of LocalStore's conditional writes (never deleted while in use); listings skip them.
_LOCK_MARKER = ".rljob-lock"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class StorageError(RuntimeError):
    """A storage operation failed in a way retrying does not fix (or retries ran out)."""


class ObjectNotFoundError(StorageError):
    """The key does not exist."""


class PreconditionFailed(StorageError):
    """A conditional write or delete found the object other than expected (created, changed or gone)."""


class ConditionalWriteUnsupported(StorageError):
    """The server ignores or refuses conditional requests (If-None-Match / If-Match)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing; ``key`` is relative to the store root."""

    key: str
    size: int


@dataclass(frozen=True)
class FileEntry:
    """One file of an uploaded or downloaded folder; ``rel_path`` uses ``/`` separators."""

    rel_path: str
    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"rel_path": self.rel_path, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: dict) -> FileEntry:
        return cls(rel_path=str(d["rel_path"]), size=int(d["size"]), sha256=str(d["sha256"]))


@dataclass(frozen=True)
class StorageUri:
    """A parsed storage URI: ``scheme`` is ``s3`` or ``file``.

    For ``s3`` ``bucket`` is the bucket and ``path`` the key prefix without leading or trailing
    slashes (may be empty); for ``file`` ``bucket`` is empty and ``path`` an absolute, normalised
    filesystem path.
    """

    scheme: str
    bucket: str
    path: str

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"
        return f"file://{self.path}"


def parse_uri(uri: str) -> StorageUri:
    """Parse ``s3://bucket[/prefix]``, ``file:///abs/path`` or ``/abs/path``; raise ``ValueError``."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"storage URI must be a non-empty string, got {uri!r}")
    uri = uri.strip()
    if uri.startswith("s3://"):
        rest = uri[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ValueError(
                f"storage URI {uri!r}: {bucket!r} is not a valid S3 bucket name "
                "(3-63 characters: lowercase letters, digits, '.', '-')"
            )
        parts = [p for p in prefix.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"storage URI {uri!r}: '.' and '..' are not allowed in the key prefix")
        return StorageUri("s3", bucket, "/".join(parts))
    if uri.startswith("file://"):
        rest = uri[len("file://"):]
        if not rest.startswith("/"):
            host, _, path = rest.partition("/")
            if host not in ("", "localhost"):
                raise ValueError(f"storage URI {uri!r}: file URIs must be local (file:///abs/path)")
            rest = "/" + path
        return StorageUri("file", "", os.path.normpath(rest))
    if "://" in uri:
        raise ValueError(f"storage URI {uri!r}: unsupported scheme (use s3://, file:// or an absolute path)")
    if not uri.startswith("/"):
        raise ValueError(f"storage URI {uri!r}: a local path must be absolute")
    return StorageUri("file", "", os.path.normpath(uri))


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"invalid object key {key!r}")
    return key


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _iter_local_files(local_dir: Path) -> list[tuple[str, Path, int]]:
    """All regular files under ``local_dir`` (hidden ones included) as (rel_path, path, size)."""
    if not local_dir.is_dir():
        raise StorageError(f"local checkpoint folder {local_dir} does not exist or is not a folder")
    out = []
    for dirpath, _dirnames, filenames in os.walk(local_dir):
        for name in filenames:
            if _TMP_MARKER in name or name.endswith(_LOCK_MARKER):
                continue
            p = Path(dirpath) / name
            if not p.is_file():
                continue
            out.append((p.relative_to(local_dir).as_posix(), p, p.stat().st_size))
    # Largest first, so the big shards start early and the thread pool stays balanced.
    out.sort(key=lambda t: (-t[2], t[0]))
    return out


def remove_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Delete the ``.rljob-tmp-*`` files a killed process left under ``folder`` (half-written copies that
    listings skip but disks keep). Call it only while no other process writes there."""
    removed = []
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            if _TMP_MARKER in name:
                path = Path(dirpath) / name
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _run_parallel(fn: Callable[..., T], items: Iterable, max_workers: int) -> list[T]:
    items = list(items)
    if not items:
        return []
    if max_workers <= 1 or len(items) == 1:
        return [fn(it) for it in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="rljob-io") as ex:
        futures = [ex.submit(fn, it) for it in items]
        results, first_error = [], None
        for fut in futures:  # wait for all so no thread is left writing after we return
            try:
                results.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results


@runtime_checkable
class ObjectStore(Protocol):
    """What the checkpoint layer needs from object storage. Keys are relative to the store root."""

    uri: str  # the root, e.g. "s3://bucket/prefix" or "file:///data/ckpt"

    def uri_for(self, key: str) -> str:
        """The URI of ``key`` (e.g. for ``status.trainer.lastCheckpoint.uri``)."""

    def sibling(self, uri: str) -> ObjectStore:
        """A store of the same kind and credentials rooted at another URI."""

    def check_access(self, setting: str = "checkpoint.uri", *, write: bool = False) -> None:
        """Verify credentials and bucket with one cheap call (a second one, a probe write, if asked)."""

    def put_file(self, local_path: str | os.PathLike, key: str) -> None: ...

    def get_file(self, key: str, local_path: str | os.PathLike) -> None: ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def get_bytes(self, key: str) -> bytes:
        """Raise :class:`ObjectNotFoundError` when the key does not exist."""

    def get_bytes_tagged(self, key: str) -> tuple[bytes, str]:
        """The object and its entity tag (changes whenever the object is rewritten)."""

    def put_bytes_if(self, key: str, data: bytes, match: str | None) -> str:
        """Compare-and-swap: write only if the key does not exist (``match`` None) or still has the
        tag ``match``; returns the new tag. Raises :class:`PreconditionFailed` otherwise."""

    def delete_if(self, key: str, match: str) -> None:
        """Delete the key only if it still has the tag ``match`` (else :class:`PreconditionFailed`)."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Delete one key; deleting a missing key is not an error."""

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (a string prefix, as S3), sorted by key."""

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object whose key starts with ``prefix`` (which must not be empty)."""

    def copy(self, src_key: str, dst_key: str) -> None:
        """Copy one object inside the store (server-side on S3)."""

    def upload_dir(self, local_dir: str | os.PathLike, prefix: str, max_workers: int = 8) -> list[FileEntry]:
        """Upload every file under ``local_dir`` (hidden files included) to ``prefix/<rel_path>``."""

    def download_dir(
        self,
        prefix: str,
        local_dir: str | os.PathLike,
        max_workers: int = 8,
        rel_paths: Iterable[str] | None = None,
    ) -> list[FileEntry]:
        """Download ``prefix/*`` (or only ``rel_paths``) into ``local_dir``; entries hash what was written."""


class _StoreBase:
    """Folder transfers and small helpers shared by both stores, built on put_file/get_file."""

    uri: str

    def upload_dir(self, local_dir, prefix: str, max_workers: int = 8) -> list[FileEntry]:
        files = _iter_local_files(Path(local_dir))
        # Each file's sha256 is computed while it uploads (hashlib releases the GIL), so on a
        # machine with spare cores the checksum costs no wall time.
        with ThreadPoolExecutor(max_workers=max(1, min(4, max_workers)), thread_name_prefix="rljob-hash") as hasher:

            def one(item: tuple[str, Path, int]) -> FileEntry:
                rel, path, size = item
                digest = hasher.submit(sha256_file, path)
                self.put_file(path, _join(prefix, rel))
                return FileEntry(rel, size, digest.result())

            entries = _run_parallel(one, files, max_workers)
        return sorted(entries, key=lambda e: e.rel_path)

    def download_dir(self, prefix: str, local_dir, max_workers: int = 8, rel_paths=None) -> list[FileEntry]:
        local_dir = Path(local_dir)
        base = prefix.strip("/")
        if rel_paths is None:
            start = len(base) + 1 if base else 0
            rels = [o.key[start:] for o in self.list_prefix(base + "/" if base else "")]
        else:
            rels = list(rel_paths)
        for rel in rels:
            _check_key(rel)

        def one(rel: str) -> FileEntry:
            dest = local_dir.joinpath(*rel.split("/"))
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.get_file(_join(base, rel), dest)
            return FileEntry(rel, dest.stat().st_size, sha256_file(dest))

        entries = _run_parallel(one, sorted(rels), max_workers)
        return sorted(entries, key=lambda e: e.rel_path)


# --------------------------------------------------------------------------------------------------
# Local filesystem


class LocalStore(_StoreBase):
    """A folder on a (possibly shared) filesystem, for ``file://`` URIs and absolute paths."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(os.path.abspath(root))
        self.uri = f"file://{self.root.as_posix()}"

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*_check_key(key).split("/"))

    def uri_for(self, key: str) -> str:
        return f"file://{self._path(key).as_posix()}"

    def sibling(self, uri: str) -> ObjectStore:
        u = parse_uri(uri)
        if u.scheme != "file":
            raise StorageError(f"{uri}: cannot open an S3 URI from a local store; use open_store()")
        return LocalStore(u.path)

    def check_access(self, setting: str = "checkpoint.uri", *, write: bool = False) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"{setting} {self.uri}: cannot create the folder: {e}; check the volume mount") from e
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise StorageError(f"{setting} {self.uri}: the folder is not writable by this process; check the volume mount")
        if write:
            probe = f".rljob-access-check-{uuid.uuid4().hex}"
            self.put_bytes(probe, b"ok")
            self.delete(probe)

    def _atomic_write(self, dest: Path, writer: Callable[[Path], None]) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}{_TMP_MARKER}{uuid.uuid4().hex}")
        try:
            writer(tmp)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put_file(self, local_path, key: str) -> None:
        self._atomic_write(self._path(key), lambda tmp: shutil.copyfile(local_path, tmp))

    def get_file(self, key: str, local_path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFoundError(f"{self.uri_for(key)} does not exist")
        dest = Path(local_path)
        self._atomic_write(dest, lambda tmp: shutil.copyfile(src, tmp))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(self._path(key), lambda tmp: tmp.write_bytes(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise ObjectNotFoundError(f"{self.uri_for(key)} does not exist") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    # Compare-and-swap on a file system: the tag is the content's sha256. A create is a hard link of
    # a complete temporary file (link(2) fails when the name exists: an exclusive create that never
    # shows half a file); compare-then-replace holds an flock(2) on a lock file beside the key, so
    # two processes (or two threads with their own descriptors) never both see the old tag.

    def get_bytes_tagged(self, key: str) -> tuple[bytes, str]:
        data = self.get_bytes(key)
        return data, hashlib.sha256(data).hexdigest()

    def _locked(self, key: str):
        import contextlib
        import fcntl

        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)

        @contextlib.contextmanager
        def lock():
            fd = os.open(path.with_name(f".{path.name}{_LOCK_MARKER}"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield path
            finally:
                os.close(fd)  # releases the lock

        return lock()

    def put_bytes_if(self, key: str, data: bytes, match: str | None) -> str:
        with self._locked(key) as dest:
            if match is None:
                tmp = dest.with_name(f".{dest.name}{_TMP_MARKER}{uuid.uuid4().hex}")
                try:
                    tmp.write_bytes(data)
                    os.link(tmp, dest)
                except FileExistsError as e:
                    raise PreconditionFailed(f"{self.uri_for(key)} exists already") from e
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                try:
                    current = hashlib.sha256(dest.read_bytes()).hexdigest()
                except FileNotFoundError as e:
                    raise PreconditionFailed(f"{self.uri_for(key)} is gone") from e
                if current != match:
                    raise PreconditionFailed(f"{self.uri_for(key)} was rewritten by someone else")
                self.put_bytes(key, data)
        return hashlib.sha256(data).hexdigest()

    def delete_if(self, key: str, match: str) -> None:
        with self._locked(key) as dest:
            try:
                current = hashlib.sha256(dest.read_bytes()).hexdigest()
            except FileNotFoundError:
                return
            if current != match:
                raise PreconditionFailed(f"{self.uri_for(key)} was rewritten by someone else")
            dest.unlink()

    def copy(self, src_key: str, dst_key: str) -> None:
        src = self._path(src_key)
        if not src.is_file():
            raise ObjectNotFoundError(f"{self.uri_for(src_key)} does not exist")
        self._atomic_write(self._path(dst_key), lambda tmp: shutil.copyfile(src, tmp))

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        # S3 semantics: a string prefix. Walk the deepest folder the prefix names completely.
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*folder.split("/")) if folder else self.root
        if not start.is_dir():
            return []
        out = []
        for dirpath, _dirs, names in os.walk(start):
            for name in names:
                if _TMP_MARKER in name or name.endswith(_LOCK_MARKER):
                    continue
                p = Path(dirpath) / name
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        out.append(ObjectInfo(key, p.stat().st_size))
                    except FileNotFoundError:  # deleted while listing
                        pass
        return sorted(out, key=lambda o: o.key)

    def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise ValueError("delete_prefix needs a non-empty prefix")
        dirs = set()
        for o in self.list_prefix(prefix):
            p = self._path(o.key)
            p.unlink(missing_ok=True)
            dirs.add(p.parent)
        # Remove folders left empty (but for lock files), deepest first, never the root.
        for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
            while d != self.root and self.root in d.parents:
                for lock in d.glob(f"*{_LOCK_MARKER}") if d.is_dir() else ():
                    if not lock.with_name(lock.name[1:-len(_LOCK_MARKER)]).exists():
                        lock.unlink(missing_ok=True)
                try:
                    d.rmdir()
                except OSError:
                    break
                d = d.parent


# --------------------------------------------------------------------------------------------------
# S3 (and S3-compatible servers: MinIO, SeaweedFS, Ceph RGW, GCS interop)

_RETRYABLE_CODES = {
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "SlowDown", "TooManyRequestsException", "RequestLimitExceeded", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "PriorRequestNotComplete",
    "500", "502", "503", "504",
}
_AUTH_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
    "TokenRefreshRequired", "AuthorizationHeaderMalformed", "AllAccessDisabled", "403",
    "InvalidSecurity", "UnauthorizedAccess",
}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and what it wraps (cause, context, s3transfer's last_exception)."""
    seen, out, todo = set(), [], [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "last_exception", None)]
    return out


def _error_code(exc: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of the first ClientError in the chain, or ("", 0)."""
    from botocore.exceptions import ClientError

    for e in _chain(exc):
        if isinstance(e, ClientError):
            err = e.response.get("Error", {}) or {}
            status = int((e.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", 0) or 0)
            return str(err.get("Code", "")), status
    return "", 0


def _is_retryable(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError,
    )
    from botocore.exceptions import (
        HTTPClientError,
        IncompleteReadError,
        ResponseStreamingError,
    )

    code, status = _error_code(exc)
    if code or status:
        return code in _RETRYABLE_CODES or status >= 500 or status == 429
    transient = (BotoConnectionError, HTTPClientError, IncompleteReadError, ResponseStreamingError,
                 ConnectionError, TimeoutError)
    for e in _chain(exc):
        if isinstance(e, transient):
            return True
        if type(e).__name__ == "RetriesExceededError":  # boto3/s3transfer download retries ran out
            return True
    return False


class S3Store(_StoreBase):
    """An S3 bucket and key prefix, through boto3.

    Path-style addressing (``endpoint/bucket/key``) is used whenever ``endpoint_url`` is set, as
    S3-compatible servers expect. Large files go up and down as parallel multipart transfers
    (``part_size`` parts, ``max_concurrency`` parts in flight per file); ``upload_dir`` and
    ``download_dir`` add a thread pool over files. A multipart upload cut off by an outage is
    retried whole; its parts are aborted when the server answers, so give the bucket a lifecycle
    rule (AbortIncompleteMultipartUpload) for the rare parts an outage leaves behind.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        *,
        credentials_source: str = "the default AWS credential chain",
        part_size: int = 16 * MiB,
        multipart_threshold: int = 16 * MiB,
        max_concurrency: int = 8,
        max_attempts: int = 3,
        retry_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
    ):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not _BUCKET_RE.match(bucket):
            raise ValueError(f"{bucket!r} is not a valid S3 bucket name")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or None
        self.region = region or None
        self.credentials_source = credentials_source
        self.retry_timeout_s = float(retry_timeout_s)
        self.uri = str(StorageUri("s3", bucket, self.prefix))
        self._access_key_hint = (access_key[:4] + "...") if access_key else None
        # Everything but bucket and prefix, for sibling(): same endpoint, credentials and tuning.
        self._settings = {
            "endpoint_url": endpoint_url, "region": region, "access_key": access_key,
            "secret_key": secret_key, "credentials_source": credentials_source, "part_size": part_size,
            "multipart_threshold": multipart_threshold, "max_concurrency": max_concurrency,
            "max_attempts": max_attempts, "retry_timeout_s": retry_timeout_s,
            "connect_timeout_s": connect_timeout_s, "read_timeout_s": read_timeout_s,
        }
        config = Config(
            region_name=self.region,
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # Enough pooled connections for 8 files in flight x parts in flight per file.
            max_pool_connections=max(64, 8 * max_concurrency),
            # Checksums only where the API requires them: S3-compatible servers vary in support.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=self.region
        )
        # One client, shared by all threads (boto3 clients are thread-safe; sessions are not).
        self._client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        self._client.meta.events.register("before-send.s3", self._strip_expect_header)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=part_size,  # s3transfer grows it when a file would exceed 10,000 parts
            max_concurrency=max_concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )

    def __repr__(self) -> str:  # no secrets
        return f"S3Store({self.uri!r}, endpoint_url={self.endpoint_url!r})"

    def _strip_expect_header(self, request, **_kwargs) -> None:
        """Drop ``Expect: 100-continue`` for S3-compatible endpoints and for empty bodies.

        botocore's partial 100-continue support can leave a pooled connection out of step after a
        zero-length PUT, so the next response on it is misparsed and the request stalls until the
        read timeout (boto/botocore#3755, boto/boto3#3757); we saw exactly that against SeaweedFS.
        The header is not signed, so removing it is safe; AWS S3 itself keeps it for real bodies.
        """
        if "Expect" not in request.headers:
            return
        if self.endpoint_url or request.headers.get("Content-Length") in ("0", b"0") or not request.body:
            del request.headers["Expect"]

    # -- helpers -------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return _join(self.prefix, _check_key(key))

    def uri_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def sibling(self, uri: str) -> ObjectStore:
        u = parse_uri(uri)
        if u.scheme != "s3":
            return LocalStore(u.path)
        return S3Store(u.bucket, u.path, **self._settings)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` and retry transient failures with exponential backoff for retry_timeout_s."""
        deadline = time.monotonic() + self.retry_timeout_s
        delay, attempt = 0.25, 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:
                if not _is_retryable(e):
                    raise self._translate(e, what) from e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(
                        f"{what}: still failing after {attempt} attempts over {self.retry_timeout_s:.0f} s: "
                        f"{type(e).__name__}: {e}"
                    ) from e
                sleep = min(delay * (0.5 + random.random()), 2.0, left)
                log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(e).__name__, e, sleep)
                time.sleep(sleep)
                delay *= 2

    def _translate(self, exc: BaseException, what: str) -> StorageError:
        code, _status = _error_code(exc)
        if code in _NOT_FOUND_CODES:
            return ObjectNotFoundError(f"{what}: not found")
        if code == "NoSuchBucket":
            return StorageError(f"{what}: bucket {self.bucket!r} does not exist at {self._endpoint_name()}")
        if code in _AUTH_CODES:
            return StorageError(f"{what}: access denied ({code}) with {self._creds_name()}")
        return StorageError(f"{what}: {type(exc).__name__}: {exc}")

    def _endpoint_name(self) -> str:
        return self.endpoint_url or "AWS S3"

    def _creds_name(self) -> str:
        if self._access_key_hint:
            return f"access key {self._access_key_hint} from {self.credentials_source}"
        return f"credentials from {self.credentials_source}"

    # -- the interface -------------------------------------------------------------------------

    def check_access(self, setting: str = "checkpoint.uri", *, write: bool = False) -> None:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        where = f"{setting} {self.uri}"
        try:
            self._retry(
                f"listing {self.uri}",
                lambda: self._client.list_objects_v2(
                    Bucket=self.bucket, Prefix=self.prefix + "/" if self.prefix else "", MaxKeys=1
                ),
            )
            if write:
                probe = f".rljob-access-check-{uuid.uuid4().hex}"
                self.put_bytes(probe, b"ok")
                self.delete(probe)
        except StorageError as e:
            if any(isinstance(c, (NoCredentialsError, PartialCredentialsError)) for c in _chain(e)):
                raise StorageError(
                    f"{where}: no S3 credentials found ({self.credentials_source}); set "
                    "s3.credentialsSecretRef to a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                ) from e
            code, status = _error_code(e)
            if code in _AUTH_CODES or status == 403:
                raise StorageError(
                    f"{where}: access denied ({code or status}) with the {self._creds_name()}; check "
                    "s3.credentialsSecretRef (keys AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and that "
                    f"these credentials may {'write' if write else 'list'} bucket {self.bucket!r}"
                ) from e
            if code == "NoSuchBucket" or status == 404:
                raise StorageError(
                    f"{where}: bucket {self.bucket!r} does not exist at {self._endpoint_name()}; "
                    "create it or fix checkpoint.uri / s3.endpoint"
                ) from e
            if _is_retryable(e):
                raise StorageError(
                    f"{where}: cannot reach {self._endpoint_name()} (retried for {self.retry_timeout_s:.0f} s); "
                    f"check s3.endpoint and the network: {e}"
                ) from e
            raise StorageError(f"{where}: {e}") from e

    def put_file(self, local_path, key: str) -> None:
        k = self._key(key)
        self._retry(
            f"uploading {local_path} to {self.uri_for(key)}",
            lambda: self._client.upload_file(str(local_path), self.bucket, k, Config=self._transfer),
        )

    def get_file(self, key: str, local_path) -> None:
        k = self._key(key)
        # s3transfer writes a temporary file next to local_path and renames it when complete.
        self._retry(
            f"downloading {self.uri_for(key)}",
            lambda: self._client.download_file(self.bucket, k, str(local_path), Config=self._transfer),
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        k = self._key(key)
        self._retry(
            f"writing {self.uri_for(key)}",
            lambda: self._client.put_object(Bucket=self.bucket, Key=k, Body=data),
        )

    def get_bytes(self, key: str) -> bytes:
        k = self._key(key)
        return self._retry(
            f"reading {self.uri_for(key)}",
            lambda: self._client.get_object(Bucket=self.bucket, Key=k)["Body"].read(),
        )

    # Conditional requests: If-None-Match: * creates only a missing key, If-Match: <etag> replaces or
    # deletes only the version read (AWS S3 since 2024, SeaweedFS 4.x, MinIO). A server that answers
    # 501 has none; one that ignores the headers is caught by the lease's read-back.

    def _conditional(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return self._retry(what, fn)
        except StorageError as e:
            code, status = _error_code(e)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise PreconditionFailed(f"{what}: the object changed meanwhile ({code or status})") from e
            if code == "NotImplemented" or status == 501:
                raise ConditionalWriteUnsupported(f"{what}: {self._endpoint_name()} has no conditional writes") from e
            raise

    def get_bytes_tagged(self, key: str) -> tuple[bytes, str]:
        k = self._key(key)

        def get() -> tuple[bytes, str]:
            resp = self._client.get_object(Bucket=self.bucket, Key=k)
            return resp["Body"].read(), resp["ETag"]

        return self._retry(f"reading {self.uri_for(key)}", get)

    def put_bytes_if(self, key: str, data: bytes, match: str | None) -> str:
        k = self._key(key)
        cond = {"IfNoneMatch": "*"} if match is None else {"IfMatch": match}
        # A retried PUT whose lost first attempt landed fails its own condition: the caller re-reads
        # and finds its own content.
        resp = self._conditional(f"writing {self.uri_for(key)} ({'create' if match is None else 'if unchanged'})",
                                 lambda: self._client.put_object(Bucket=self.bucket, Key=k, Body=data, **cond))
        return resp["ETag"]

    def delete_if(self, key: str, match: str) -> None:
        k = self._key(key)
        try:
            self._conditional(f"deleting {self.uri_for(key)} if unchanged",
                              lambda: self._client.delete_object(Bucket=self.bucket, Key=k, IfMatch=match))
        except ObjectNotFoundError:
            return

    def exists(self, key: str) -> bool:
        try:
            self._retry(
                f"checking {self.uri_for(key)}",
                lambda: self._client.head_object(Bucket=self.bucket, Key=self._key(key)),
            )
            return True
        except ObjectNotFoundError:
            return False

    def copy(self, src_key: str, dst_key: str) -> None:
        src, dst = self._key(src_key), self._key(dst_key)
        # Managed copy: server-side, multipart for objects past the threshold (single copies stop at 5 GB).
        self._retry(
            f"copying {self.uri_for(src_key)} to {self.uri_for(dst_key)}",
            lambda: self._client.copy({"Bucket": self.bucket, "Key": src}, self.bucket, dst, Config=self._transfer),
        )

    def delete(self, key: str) -> None:
        k = self._key(key)
        self._retry(
            f"deleting {self.uri_for(key)}",
            lambda: self._client.delete_object(Bucket=self.bucket, Key=k),
        )

    def list_prefix(self, prefix: str) -> list[ObjectInfo]:
        root = self.prefix + "/" if self.prefix else ""
        full, strip = root + prefix, len(root)

        def listing() -> list[ObjectInfo]:
            out = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []) or []:
                    out.append(ObjectInfo(obj["Key"][strip:], int(obj["Size"])))
            return out

        return sorted(self._retry(f"listing {self.uri}/{prefix}", listing), key=lambda o: o.key)

    def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise ValueError("delete_prefix needs a non-empty prefix")
        keys = [o.key for o in self.list_prefix(prefix)]
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]

            def delete_batch(batch=batch):
                resp = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                errors = resp.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise StorageError(
                        f"deleting {len(errors)} objects under {self.uri}/{prefix} failed, e.g. "
                        f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                    )

            self._retry(f"deleting objects under {self.uri}/{prefix}", delete_batch)


def open_store(
    uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    credentials_source: str | None = None,
    **s3_options,
) -> ObjectStore:
    """Open the store for ``s3://bucket/prefix``, ``file:///abs/path`` or ``/abs/path``.

    S3 credentials default to ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` from the environment
    (injected by the operator from ``s3.credentialsSecretRef``), then boto3's default chain (IRSA,
    instance profiles). ``endpoint_url`` and ``region`` default to ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` and ``AWS_REGION`` / ``AWS_DEFAULT_REGION``. ``s3_options`` go to
    :class:`S3Store` (part size, concurrency, retry timeout).
    """
    u = parse_uri(uri)
    if u.scheme == "file":
        return LocalStore(u.path)
    if access_key is None and secret_key is None:
        access_key = os.environ.get("AWS_ACCESS_KEY_ID") or None
        secret_key = os.environ.get("AWS_SECRET_ACCESS_KEY") or None
        if credentials_source is None:
            credentials_source = (
                "environment variables AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
                if access_key else "the default AWS credential chain (no AWS_ACCESS_KEY_ID in the environment)"
            )
    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return S3Store(
        u.bucket, u.path, endpoint_url=endpoint_url, region=region, access_key=access_key,
        secret_key=secret_key, credentials_source=credentials_source or "explicit settings", **s3_options,
    )
