"""Fixtures of the checkpoint tests. The S3 server (`s3_server`, `s3_bucket`) is the shared one
from tests/conftest.py: a real SeaweedFS."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

MiB = 1024 * 1024


def make_s3_store(s3_server, bucket: str, prefix: str = "ckpt/root", **kw):
    from rljob_worker.checkpoint.store import S3Store

    opts = {"part_size": 5 * MiB, "multipart_threshold": 8 * MiB, "max_concurrency": 4, "retry_timeout_s": 30.0}
    opts.update(kw)
    return S3Store(
        bucket, prefix, endpoint_url=s3_server.endpoint_url, region=s3_server.region,
        access_key=s3_server.access_key, secret_key=s3_server.secret_key, **opts,
    )


@pytest.fixture(scope="module")
def module_bucket(s3_server):
    """One bucket per test module (a fresh SeaweedFS bucket costs a volume and some time);
    tests use unique prefixes inside it."""
    import uuid

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    yield name
    with contextlib.suppress(Exception):  # best-effort cleanup on a throwaway server
        make_s3_store(s3_server, name, prefix="", retry_timeout_s=5).delete_prefix("t-")
        s3_server.client().delete_bucket(Bucket=name)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """An empty ObjectStore: a LocalStore under tmp_path, or an S3Store on the real SeaweedFS
    (a unique prefix in a bucket of the module)."""
    import uuid

    if request.param == "local":
        from rljob_worker.checkpoint.store import LocalStore

        return LocalStore(tmp_path / "store")
    s3_server = request.getfixturevalue("s3_server")
    return make_s3_store(s3_server, request.getfixturevalue("module_bucket"), prefix=f"t-{uuid.uuid4().hex[:8]}/ckpt")


def write_checkpoint_dir(path: Path, seed: int = 0, big_mb: int = 0) -> Path:
    """A folder shaped like a megatron distributed checkpoint: hidden .metadata, shards, nested files."""
    import random as _random

    rnd = _random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / ".metadata").write_bytes(b"meta-%d" % seed + rnd.randbytes(100))
    (path / "common.pt").write_bytes(rnd.randbytes(3000))
    (path / "__0_0.distcp").write_bytes(rnd.randbytes(50_000))
    (path / "__1_0.distcp").write_bytes(rnd.randbytes(40_000))
    (path / "rng" / ".hidden").mkdir(parents=True, exist_ok=True)
    (path / "rng" / ".hidden" / "state.bin").write_bytes(rnd.randbytes(17))
    (path / "empty.txt").write_bytes(b"")
    if big_mb:
        (path / "__big.distcp").write_bytes(rnd.randbytes(big_mb * MiB))
    return path


def read_tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def helpers():
    """Helper functions for the test modules (importlib import mode: tests cannot import conftest)."""

    class H:
        make_s3_store = staticmethod(make_s3_store)
        write_checkpoint_dir = staticmethod(write_checkpoint_dir)
        read_tree = staticmethod(read_tree)

    return H
