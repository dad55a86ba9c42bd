"""ObjectStore implementations against a real SeaweedFS S3 server and the local filesystem."""
from __future__ import annotations

import hashlib
import threading
import time

import pytest
from rljob_worker.checkpoint.store import (
    FileEntry,
    LocalStore,
    ObjectNotFoundError,
    ObjectStore,
    S3Store,
    StorageError,
    StorageUri,
    open_store,
    parse_uri,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("s3://my-bucket", StorageUri("s3", "my-bucket", "")),
        ("s3://my-bucket/", StorageUri("s3", "my-bucket", "")),
        ("s3://my-bucket/a/b/", StorageUri("s3", "my-bucket", "a/b")),
        ("s3://my.bucket-1//a//b", StorageUri("s3", "my.bucket-1", "a/b")),
        ("file:///data/ckpt/", StorageUri("file", "", "/data/ckpt")),
        ("file://localhost/data/ckpt", StorageUri("file", "", "/data/ckpt")),
        ("/data/ckpt/../x", StorageUri("file", "", "/data/x")),
    ],
)
def test_parse_uri(uri, expected):
    assert parse_uri(uri) == expected
    assert parse_uri(str(expected)) == expected  # str() round-trips


@pytest.mark.parametrize(
    "uri, fragment",
    [
        ("", "non-empty"),
        ("relative/path", "absolute"),
        ("gs://bucket/x", "unsupported scheme"),
        ("s3://Bad_Bucket/x", "bucket name"),
        ("s3://ab/x", "bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("file://otherhost/x", "local"),
    ],
)
def test_parse_uri_rejects(uri, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_uri(uri)


def test_stores_satisfy_the_protocol(tmp_path, s3_server, s3_bucket, helpers):
    assert isinstance(LocalStore(tmp_path), ObjectStore)
    assert isinstance(helpers.make_s3_store(s3_server, s3_bucket), ObjectStore)


def test_folder_round_trip_with_hidden_and_multipart_files(store, tmp_path, helpers, request):
    src = helpers.write_checkpoint_dir(tmp_path / "src", seed=1, big_mb=12)
    entries = store.upload_dir(src, "run/step_000001", max_workers=4)
    expected = helpers.read_tree(src)
    assert [e.rel_path for e in entries] == sorted(expected)
    assert ".metadata" in expected and "rng/.hidden/state.bin" in expected
    for e in entries:
        assert e == FileEntry(e.rel_path, len(expected[e.rel_path]), hashlib.sha256(expected[e.rel_path]).hexdigest())
    listed = {o.key: o.size for o in store.list_prefix("run/step_000001/")}
    assert listed == {f"run/step_000001/{k}": len(v) for k, v in expected.items()}

    got = store.download_dir("run/step_000001", tmp_path / "dst", max_workers=4)
    assert helpers.read_tree(tmp_path / "dst") == expected
    assert got == entries

    if isinstance(store, S3Store):  # the 12 MB file went up as a multipart upload (ETag "<md5>-<parts>")
        s3_server = request.getfixturevalue("s3_server")
        head = s3_server.client().head_object(Bucket=store.bucket, Key=f"{store.prefix}/run/step_000001/__big.distcp")
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # 12 MB in 5 MB parts


def test_objects_keys_and_prefixes(store):
    store.put_bytes("a/b/one", b"1")
    store.put_bytes("a/b/two", b"22")
    store.put_bytes("a/bc/three", b"333")
    store.put_bytes("z", b"")
    assert store.get_bytes("a/b/two") == b"22"
    assert store.exists("a/b/one") and not store.exists("a/b/none") and not store.exists("a/b")
    # S3 semantics: string prefixes, sorted keys relative to the store root.
    assert [o.key for o in store.list_prefix("a/b")] == ["a/b/one", "a/b/two", "a/bc/three"]
    assert [(o.key, o.size) for o in store.list_prefix("a/b/")] == [("a/b/one", 1), ("a/b/two", 2)]
    assert [o.key for o in store.list_prefix("")] == ["a/b/one", "a/b/two", "a/bc/three", "z"]
    assert store.list_prefix("nothing/") == []
    store.delete_prefix("a/b/")
    assert [o.key for o in store.list_prefix("")] == ["a/bc/three", "z"]
    store.delete("z")
    store.delete("z")  # deleting a missing key is fine
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("z")
    with pytest.raises(ObjectNotFoundError):
        store.get_file("z", "/tmp/never-written")
    with pytest.raises(ValueError):
        store.delete_prefix("")
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"x")
    assert store.uri_for("a/bc/three").endswith("/a/bc/three")


def test_local_store_never_shows_partial_files(tmp_path):
    store = LocalStore(tmp_path / "root")
    big = tmp_path / "big"
    big.write_bytes(b"x" * (8 * 1024 * 1024))
    seen_sizes, stop = set(), threading.Event()

    def reader():
        while not stop.is_set():
            for o in store.list_prefix("f"):
                seen_sizes.add(o.size)

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(5):
        store.put_file(big, "f")
        store.delete("f")
    stop.set()
    t.join()
    assert seen_sizes <= {8 * 1024 * 1024}
    assert not list((tmp_path / "root").iterdir())  # no temporary files left behind


def test_open_store_defaults_credentials_from_env(monkeypatch, s3_server, s3_bucket, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    store = open_store(f"s3://{s3_bucket}/ns/job", endpoint_url=s3_server.endpoint_url)
    assert isinstance(store, S3Store) and store.uri == f"s3://{s3_bucket}/ns/job"
    store.check_access(write=True)
    store.put_bytes("k", b"v")
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="ns/job/k")["Body"].read() == b"v"
    assert s3_server.secret_key not in repr(store)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store(str(tmp_path)), LocalStore)


def test_wrong_credentials_fail_at_start_up_with_a_helpful_message(s3_server, s3_bucket, helpers):
    store = S3Store(
        s3_bucket, "ns/job", endpoint_url=s3_server.endpoint_url, region=s3_server.region,
        access_key=s3_server.access_key, secret_key="not-the-secret",
        credentials_source="env AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from Secret s3-creds",
    )
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        store.check_access()
    assert time.monotonic() - t0 < 10  # not retried like an outage
    msg = str(err.value)
    assert f"checkpoint.uri s3://{s3_bucket}/ns/job" in msg
    assert "access denied" in msg and "s3.credentialsSecretRef" in msg and "Secret s3-creds" in msg
    assert "not-the-secret" not in msg

    unknown_key = S3Store(s3_bucket, "", endpoint_url=s3_server.endpoint_url, access_key="nobody",
                          secret_key="x", region=s3_server.region)
    with pytest.raises(StorageError, match="access denied.*credentialsSecretRef"):
        unknown_key.check_access(setting="model.uri")


def test_missing_bucket_and_unreachable_endpoint_are_named(s3_server, helpers):
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-x' does not exist"):
        helpers.make_s3_store(s3_server, "no-such-bucket-x").check_access()
    dead = S3Store("some-bucket", "p", endpoint_url="http://127.0.0.1:9", access_key="a", secret_key="b",
                   region="us-east-1", retry_timeout_s=1.0, max_attempts=1, connect_timeout_s=1)
    with pytest.raises(StorageError, match="cannot reach http://127.0.0.1:9.*s3.endpoint"):
        dead.check_access()


def test_local_check_access(tmp_path):
    LocalStore(tmp_path / "new" / "dir").check_access(write=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="checkpoint.uri file://.*cannot create"):
        LocalStore(tmp_path / "file" / "sub").check_access()


def test_upload_survives_an_s3_outage(s3_server, s3_bucket, helpers, tmp_path, caplog):
    """The server goes away for ~8 s right after the first file is up; the folder upload still completes."""
    src = helpers.write_checkpoint_dir(tmp_path / "src", seed=2, big_mb=12)
    store = helpers.make_s3_store(s3_server, s3_bucket, retry_timeout_s=60.0)
    real_put, outage, calls = store.put_file, {}, []

    def put_then_outage(local_path, key):
        real_put(local_path, key)
        calls.append(key)
        if len(calls) == 1:
            outage["thread"] = s3_server.outage(8.0)
            time.sleep(0.5)  # the server is down before the next file starts

    store.put_file = put_then_outage
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="rljob_worker.checkpoint.store"):
        entries = store.upload_dir(src, "step_000001", max_workers=1)
    elapsed = time.monotonic() - t0
    outage["thread"].join()
    assert outage["thread"].error is None
    assert elapsed >= 8.0  # it really waited the outage out
    assert any("retrying" in r.getMessage() for r in caplog.records)
    assert len(entries) == len(helpers.read_tree(src))
    store.download_dir("step_000001", tmp_path / "dst")
    assert helpers.read_tree(tmp_path / "dst") == helpers.read_tree(src)
