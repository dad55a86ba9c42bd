"""The checkpoint commit protocol (COMMIT last, retention, restore, resume) on SeaweedFS and a local folder."""
from __future__ import annotations

import json
import threading
import time

import pytest
from rljob_api.enums import ResumeMode
from rljob_worker.checkpoint.commit import (
    COMMIT,
    META,
    QUARANTINE,
    SUPERSEDED,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointManager,
    SpecChanged,
    resolve_resume,
    restore_for_resume,
    spec_hash,
    step_dirname,
)

pytestmark = pytest.mark.timeout(60)

BASE = "ns/job"


@pytest.fixture
def manager(store):
    return CheckpointManager(store, BASE, max_to_keep=None, max_workers=4)


def _save(manager, tmp_path, helpers, step, **kw):
    src = helpers.write_checkpoint_dir(tmp_path / f"local_{step}", seed=step)
    return manager.commit_folder(src, step, {"reward_mean": 0.1 * step}, "hash-a", blocking=True, **kw).wait()


def test_spec_hash_is_stable_and_order_independent():
    a = spec_hash({"b": 1, "a": {"y": [1, 2], "x": "s"}})
    assert a == spec_hash({"a": {"x": "s", "y": [1, 2]}, "b": 1})
    assert a != spec_hash({"b": 2, "a": {"y": [1, 2], "x": "s"}})
    assert len(a) == 64 and int(a, 16) >= 0
    assert step_dirname(30) == "step_000030" and step_dirname(1234567) == "step_1234567"


def test_save_restore_round_trip(manager, tmp_path, helpers):
    src = helpers.write_checkpoint_dir(tmp_path / "local", seed=30, big_mb=12)
    handle = manager.commit_folder(src, 30, {"reward_mean": 0.5, "kl": 0.01}, "abc123")
    ref = handle.wait()
    assert handle.done() and handle.seconds is not None
    assert ref.step == 30 and ref.uri == manager.step_uri(30) and ref.uri.endswith("/ns/job/step_000030")
    assert ref.total_bytes == sum(len(b) for b in helpers.read_tree(src).values())

    store = manager.store
    meta = json.loads(store.get_bytes(f"{BASE}/step_000030/{META}"))
    assert meta["step"] == 30 and meta["metrics"] == {"reward_mean": 0.5, "kl": 0.01}
    assert meta["spec_hash"] == "abc123" and meta["created"]
    assert {f["rel_path"] for f in meta["files"]} == set(helpers.read_tree(src))
    assert ".metadata" in {f["rel_path"] for f in meta["files"]}

    latest = manager.latest_committed()
    assert latest == ref and latest.metrics["kl"] == 0.01 and latest.spec_hash == "abc123"
    restored = manager.restore(latest, tmp_path / "restored")
    assert restored.step == 30
    assert helpers.read_tree(tmp_path / "restored") == helpers.read_tree(src)  # no meta.json / COMMIT

    # by URI, and from a list_committed() ref (meta.json not read yet)
    manager.restore(ref.uri, tmp_path / "by_uri")
    manager.restore(manager.list_committed()[0], tmp_path / "by_list")
    assert helpers.read_tree(tmp_path / "by_uri") == helpers.read_tree(tmp_path / "by_list") == helpers.read_tree(src)
    with pytest.raises(CheckpointError, match="not empty"):
        manager.restore(ref, tmp_path / "restored")


def test_commit_is_written_last(manager, tmp_path, helpers):
    store, order = manager.store, []
    real_put_file, real_put_bytes = store.put_file, store.put_bytes
    store.put_file = lambda path, key: (real_put_file(path, key), order.append(key))[0]
    store.put_bytes = lambda key, data: (real_put_bytes(key, data), order.append(key))[0]
    src = helpers.write_checkpoint_dir(tmp_path / "local", seed=1)
    manager.commit_folder(src, 1, {}, None, blocking=True)
    assert order[-1] == f"{BASE}/step_000001/{COMMIT}"
    assert order[-2] == f"{BASE}/step_000001/{META}"
    assert len(order) == len(helpers.read_tree(src)) + 2


def test_failed_upload_leaves_no_commit_and_surfaces_on_wait(manager, tmp_path, helpers):
    first = _save(manager, tmp_path, helpers, 10)
    store, uploaded = manager.store, []
    real_put_file = store.put_file

    lock = threading.Lock()

    def failing_put_file(path, key):
        with lock:
            uploaded.append(key)
            fail = len(uploaded) > 3
        if fail:
            raise OSError("disk went away")
        real_put_file(path, key)

    store.put_file = failing_put_file
    src = helpers.write_checkpoint_dir(tmp_path / "local_20", seed=20)
    handle = manager.commit_folder(src, 20, {}, None)  # background: returns before the failure
    with pytest.raises(OSError, match="disk went away"):
        manager.wait_for_commit()
    assert handle.done()
    with pytest.raises(OSError):
        handle.wait()  # the handle keeps its error
    manager.wait_for_commit()  # reported once by the manager: it does not block the next save
    listed = [o.key for o in store.list_prefix(f"{BASE}/step_000020/")]
    assert len(listed) >= 3 and not any(k.endswith((COMMIT, META)) for k in listed)
    assert manager.latest_committed() == first
    assert [r.step for r in manager.list_committed()] == [10]

    # an unobserved failure is raised by the next save instead of being lost
    handle = manager.commit_folder(src, 21, {}, None)
    handle._done.wait()
    with pytest.raises(OSError, match="disk went away"):
        manager.commit_folder(src, 22, {}, None)
    store.put_file = real_put_file
    assert manager.commit_folder(src, 23, {}, None, blocking=True).wait().step == 23
    # retention (none configured) still cleans the leftovers of the failed saves 20 and 21
    assert [r.step for r in manager.list_committed()] == [10, 23]
    assert manager.store.list_prefix(f"{BASE}/step_000020/") == []
    assert manager.store.list_prefix(f"{BASE}/step_000021/") == []


def test_blocking_save_raises_its_own_error(manager, tmp_path, helpers):
    manager.store.put_file = lambda path, key: (_ for _ in ()).throw(OSError("no space"))
    src = helpers.write_checkpoint_dir(tmp_path / "local", seed=3)
    with pytest.raises(OSError, match="no space"):
        manager.commit_folder(src, 3, {}, None, blocking=True)
    assert manager.latest_committed() is None


def test_half_written_step_is_never_returned(manager, tmp_path, helpers):
    ref5 = _save(manager, tmp_path, helpers, 5)
    store = manager.store
    # step 6: every file and even meta.json uploaded, but no COMMIT (crash just before it)
    src = helpers.write_checkpoint_dir(tmp_path / "half", seed=6)
    entries = store.upload_dir(src, f"{BASE}/step_000006", 4)
    store.put_bytes(f"{BASE}/step_000006/{META}", json.dumps({"step": 6, "files": [e.to_json() for e in entries]}).encode())
    assert manager.latest_committed() == ref5
    assert [r.step for r in manager.list_committed()] == [5]
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        manager.restore(manager.step_uri(6), tmp_path / "out")
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        resolve_resume("uri", CheckpointManager(store, "ns/new-job"), manager.step_uri(6))
    assert resolve_resume("auto", manager) == ref5


def test_committed_but_damaged_steps_are_skipped_or_refused(manager, tmp_path, helpers):
    ref1 = _save(manager, tmp_path, helpers, 1)
    ref2 = _save(manager, tmp_path, helpers, 2)
    store = manager.store
    # same size, different bytes: only the checksum can tell -> restore raises
    key = f"{BASE}/step_000002/__0_0.distcp"
    data = bytearray(store.get_bytes(key))
    data[100] ^= 0xFF
    store.put_bytes(key, bytes(data))
    assert manager.latest_committed() == ref2  # listing sizes still match
    with pytest.raises(CheckpointError, match=r"corrupt: __0_0.distcp: sha256"):
        manager.restore(ref2, tmp_path / "out")
    # a file missing from a committed step: latest_committed falls back to the older step
    store.delete(key)
    assert manager.latest_committed() == ref1
    with pytest.raises(CheckpointError, match="committed but incomplete: __0_0.distcp missing"):
        manager.restore(ref2.uri, tmp_path / "out2")
    # meta.json edited after commit: COMMIT's checksum catches it
    store.put_bytes(f"{BASE}/step_000001/{META}", b"{}")
    assert manager.latest_committed() is None


def test_retention_keeps_exactly_n_newest(store, tmp_path, helpers):
    manager = CheckpointManager(store, BASE, max_to_keep=2, max_workers=4)
    for step in (10, 20, 30, 40):
        _save(manager, tmp_path, helpers, step)
        committed = [r.step for r in manager.list_committed()]
        assert committed == [10, 20, 30, 40][max(0, [10, 20, 30, 40].index(step) - 1): [10, 20, 30, 40].index(step) + 1]
    assert [r.step for r in manager.list_committed()] == [30, 40]
    assert store.list_prefix(f"{BASE}/step_000010/") == [] and store.list_prefix(f"{BASE}/step_000020/") == []
    for r in manager.list_committed():
        manager.restore(r, tmp_path / f"restore_{r.step}")
        assert helpers.read_tree(tmp_path / f"restore_{r.step}") == helpers.read_tree(tmp_path / f"local_{r.step}")

    # partial folders: older than the newest committed one are cleaned, newer ones (in flight) are kept
    store.put_bytes(f"{BASE}/step_000035/__0_0.distcp", b"partial")
    store.put_bytes(f"{BASE}/step_000050/__0_0.distcp", b"in flight")
    plan = manager.apply_retention()
    assert plan.delete_committed == () and plan.delete_partial == (35,)
    assert store.exists(f"{BASE}/step_000050/__0_0.distcp")
    assert [r.step for r in manager.list_committed()] == [30, 40]


def test_retention_never_deletes_the_only_or_newest_commit(store, tmp_path, helpers):
    manager = CheckpointManager(store, BASE, max_to_keep=1, max_workers=4)
    _save(manager, tmp_path, helpers, 1)
    manager.apply_retention()
    assert [r.step for r in manager.list_committed()] == [1]
    # a failed newer save does not count: the older committed step stays
    manager.store.put_bytes(f"{BASE}/step_000002/__0_0.distcp", b"partial")
    assert manager.apply_retention().delete_committed == ()
    assert manager.latest_committed().step == 1
    keep_all = CheckpointManager(store, BASE, max_to_keep=0)
    assert keep_all.max_to_keep is None
    with pytest.raises(ValueError):
        CheckpointManager(store, BASE, max_to_keep=-1)


def test_crash_between_commit_and_delete_keeps_every_committed_step(store, tmp_path, helpers):
    manager = CheckpointManager(store, BASE, max_to_keep=1, max_workers=4)
    _save(manager, tmp_path, helpers, 1)
    # step 2 committed by the internal steps of save(), then a "crash" before retention ran
    src = helpers.write_checkpoint_dir(tmp_path / "local_2", seed=2)
    entries = store.upload_dir(src, manager.step_key(2), 4)
    manager._commit(2, entries, {}, None)
    assert [r.step for r in manager.list_committed()] == [1, 2]
    for step in (1, 2):
        manager.restore(manager.step_uri(step), tmp_path / f"r{step}")

    # retention starts deleting step 1 and "crashes" right after removing its COMMIT
    assert manager.plan_retention().delete_committed == (1,)
    store.delete(f"{BASE}/step_000001/{COMMIT}")
    assert [r.step for r in manager.list_committed()] == [2]  # step 1 is now merely partial, never half-committed
    assert manager.latest_committed().step == 2
    assert len(store.list_prefix(f"{BASE}/step_000001/")) > 0
    plan = manager.apply_retention()  # the next run cleans it up
    assert plan.delete_partial == (1,) and store.list_prefix(f"{BASE}/step_000001/") == []
    assert [r.step for r in manager.list_committed()] == [2]


def test_background_save_overlaps_training(manager, tmp_path, helpers):
    store = manager.store
    real_put_file = store.put_file

    def slow_put_file(path, key):
        time.sleep(0.2)
        real_put_file(path, key)

    store.put_file = slow_put_file
    src = helpers.write_checkpoint_dir(tmp_path / "local", seed=7)
    t0 = time.monotonic()
    handle = manager.commit_folder(src, 7, {"r": 1.0}, "h")
    returned_after = time.monotonic() - t0
    assert returned_after < 0.15 and not handle.done()
    # the "training step" runs on the main thread while the upload proceeds
    work, steps_done = 0, 0
    while not handle.done():
        work += sum(i * i for i in range(20_000))
        steps_done += 1
    assert steps_done > 5
    assert manager.wait_for_commit().step == 7
    assert threading.active_count() >= 1 and manager.latest_committed().step == 7
    # a second save waits for the first one before starting
    h1 = manager.commit_folder(src, 8, {}, None)
    h2 = manager.commit_folder(src, 9, {}, None)
    assert h1.done() and h2.wait().step == 9


def test_save_rejects_reserved_names(manager, tmp_path, helpers):
    src = helpers.write_checkpoint_dir(tmp_path / "local", seed=1)
    (src / "COMMIT").write_text("x")
    with pytest.raises(CheckpointError, match="reserves"):
        manager.commit_folder(src, 1, {}, None)
    with pytest.raises(CheckpointError, match="reserves"):
        manager.upload_rank_files(src, 1, 0)
    with pytest.raises(CheckpointError, match="does not exist"):  # at the call, not in the thread
        manager.commit_folder(tmp_path / "missing", 1, {}, None)
    assert manager.store.list_prefix("") == []


def test_saving_a_step_again_replaces_it(manager, tmp_path, helpers):
    _save(manager, tmp_path, helpers, 4)
    src = tmp_path / "other"
    src.mkdir()
    (src / "only.bin").write_bytes(b"new")
    manager.commit_folder(src, 4, {}, None, blocking=True)
    manager.restore(manager.latest_committed(), tmp_path / "out")
    assert helpers.read_tree(tmp_path / "out") == {"only.bin": b"new"}


def test_multi_rank_upload_and_commit(manager, tmp_path):
    store = manager.store
    manager.prepare_step(50)
    for rank in (0, 1):
        d = tmp_path / f"rank{rank}"
        (d / "sub").mkdir(parents=True)
        (d / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
        (d / "sub" / "shared.json").write_text('{"same": true}')  # identical on both ranks
        if rank == 0:
            (d / ".metadata").write_bytes(b"md")
        manager.upload_rank_files(d, 50, rank)
    with pytest.raises(CheckpointError, match=r"ranks \[2\] have not uploaded"):
        manager.commit(50, {"r": 1}, "h", expected_ranks=range(3))
    assert manager.latest_committed() is None
    ref = manager.commit(50, {"r": 1}, "h", expected_ranks=range(2))
    assert sorted(f.rel_path for f in ref.files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "sub/shared.json"]
    out = manager.restore(manager.latest_committed(), tmp_path / "out")
    assert out.step == 50 and (tmp_path / "out" / "__1_0.distcp").read_bytes() == b"\x01" * 1000
    assert not (tmp_path / "out" / ".rljob").exists()

    # two ranks disagreeing about the same file cannot be committed
    manager.prepare_step(60)
    for rank in (0, 1):
        d = tmp_path / f"conflict{rank}"
        d.mkdir()
        (d / "common.pt").write_bytes(b"rank%d" % rank)
        manager.upload_rank_files(d, 60, rank)
    with pytest.raises(CheckpointError, match="different contents for common.pt"):
        manager.commit(60)
    assert not store.exists(f"{BASE}/step_000060/{COMMIT}")


def test_resolve_resume(store, tmp_path, helpers):
    manager = CheckpointManager(store, BASE, max_to_keep=None)
    assert resolve_resume("auto", manager) is None
    ref1 = _save(manager, tmp_path, helpers, 1)
    ref2 = _save(manager, tmp_path, helpers, 2)
    assert resolve_resume("auto", manager) == ref2
    assert resolve_resume(ResumeMode.AUTO, manager) == ref2
    assert resolve_resume("disable", manager) is None
    new_job = CheckpointManager(store, "ns/new-job")  # resumeFrom seeds a job without steps of its own
    assert resolve_resume(ResumeMode.URI, new_job, ref1.uri) == ref1
    assert resolve_resume("uri", new_job, ref1.uri + "/") == ref1
    assert resolve_resume("uri", new_job, manager.base_uri) == ref2  # a job folder: its newest step
    assert resolve_resume(ref1.uri, new_job) == ref1  # a URI given as the mode
    # another job's checkpoints, same credentials
    other = CheckpointManager(store, "ns/other-job")
    _save(other, tmp_path / "o", helpers, 7)
    got = resolve_resume("uri", new_job, other.step_uri(7))
    assert got.step == 7
    manager.restore(got, tmp_path / "restored_other")
    assert helpers.read_tree(tmp_path / "restored_other") == helpers.read_tree(tmp_path / "o" / "local_7")
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        resolve_resume("uri", new_job, store.uri_for("ns/empty-job"))
    with pytest.raises(ValueError, match="resumeFrom"):
        resolve_resume("uri", manager)
    with pytest.raises(ValueError, match="auto, disable or uri"):
        resolve_resume("sometimes", manager)


def test_remove_local_after_commit(manager, tmp_path, helpers):
    src = helpers.write_checkpoint_dir(tmp_path / "local", seed=9)
    manager.commit_folder(src, 9, {}, None, remove_local=True).wait()
    assert not src.exists()
    assert manager.latest_committed().step == 9


def test_s3_commit_object_is_newest(s3_server, s3_bucket, tmp_path, helpers):
    """On S3, the server's own timestamps agree: COMMIT is not older than any other object."""
    store = helpers.make_s3_store(s3_server, s3_bucket)
    manager = CheckpointManager(store, BASE)
    _save(manager, tmp_path, helpers, 3)
    objs = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix=f"ckpt/root/{BASE}/step_000003/")["Contents"]
    commit_time = next(o["LastModified"] for o in objs if o["Key"].endswith("/COMMIT"))
    assert len(objs) > 3 and all(o["LastModified"] <= commit_time for o in objs)


# --------------------------------------------------------------------------- resuming the right run


def _step_files(store, prefix):
    return sorted(o.key for o in store.list_prefix(prefix))


def test_resume_from_seeds_only_the_first_start(store, tmp_path, helpers, caplog):
    """resumeMode uri: the seed on the first start; after that the job's own newest committed step, said at
    WARNING (the worker log, which `rljob run` prints)."""
    seed_job = CheckpointManager(store, "ns/seed-job")
    seed = _save(seed_job, tmp_path / "seed", helpers, 50)
    manager = CheckpointManager(store, BASE, max_to_keep=2)
    first = restore_for_resume(manager, ResumeMode.URI, seed.uri, tmp_path / "r1")
    assert first.step == 50 and first.uri == seed.uri
    _save(manager, tmp_path, helpers, 55)  # the job trains on and commits step 55, then its pod restarts
    with caplog.at_level("WARNING"):
        again = restore_for_resume(manager, ResumeMode.URI, seed.uri, tmp_path / "r2")
    assert again.step == 55 and again.uri == manager.step_uri(55)
    [warning] = [r for r in caplog.records if "not from resumeFrom" in r.getMessage()]
    assert warning.levelname == "WARNING" and seed.uri in warning.getMessage()
    assert helpers.read_tree(tmp_path / "r2") == helpers.read_tree(tmp_path / "local_55")


def test_disable_moves_an_earlier_run_aside_and_keeps_every_new_step(store, tmp_path, helpers):
    """An older, longer run (steps 100, 200) under the prefix: a resumeMode: disable run must keep its own
    checkpoints (retention used to delete each right after it committed) and auto-resume must load them."""
    manager = CheckpointManager(store, BASE, max_to_keep=2)
    old = {s: _save(manager, tmp_path / "old", helpers, s) for s in (100, 200)}
    assert restore_for_resume(manager, ResumeMode.DISABLE, None, tmp_path / "r") is None
    for step in (1, 2, 3):
        _save(manager, tmp_path, helpers, step)
    assert [r.step for r in manager.list_committed()] == [2, 3]
    assert resolve_resume(ResumeMode.AUTO, manager).step == 3
    # nothing of the old run is lost: both steps, every file, under superseded/<time>/
    aside = _step_files(store, f"{BASE}/{SUPERSEDED}/")
    for step, ref in old.items():
        moved = [k for k in aside if f"/{step_dirname(step)}/" in k]
        assert sorted(k.rsplit(f"{step_dirname(step)}/", 1)[1] for k in moved) == sorted(
            [f.rel_path for f in ref.files] + [META, COMMIT])


def test_bit_flipped_newest_step_is_quarantined_and_the_previous_one_loads(store, tmp_path, helpers, caplog):
    manager = CheckpointManager(store, BASE, max_to_keep=None)
    _save(manager, tmp_path, helpers, 1)
    _save(manager, tmp_path, helpers, 2)
    key = f"{BASE}/step_000002/__0_0.distcp"
    data = bytearray(store.get_bytes(key))
    data[100] ^= 0x01  # one bit: same size, only the checksum can tell
    store.put_bytes(key, bytes(data))
    with caplog.at_level("WARNING"):
        ref = restore_for_resume(manager, ResumeMode.AUTO, None, tmp_path / "restored")
    assert ref.step == 1
    assert helpers.read_tree(tmp_path / "restored") == helpers.read_tree(tmp_path / "local_1")
    assert [r.step for r in manager.list_committed()] == [1]  # the next restart does not trip over it again
    kept = _step_files(store, f"{BASE}/{QUARANTINE}/")
    assert any(k.endswith("/__0_0.distcp") and "/step_000002-" in k for k in kept), kept
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "corrupt" in said and f"{QUARANTINE}/step_000002-" in said and "previous committed step" in said
    # the progress report carries the record, which the operator turns into a CheckpointQuarantined event
    from rljob_operator.progress import decode_progress, encode_progress
    trainer = decode_progress(encode_progress(1, quarantined=manager.quarantined, time="2026-11-26T10:00:00Z"))
    [record] = trainer["quarantinedCheckpoints"]
    assert record["step"] == 2 and f"/{QUARANTINE}/step_000002-" in record["uri"]
    assert "corrupt" in record["reason"]
    # a seed from another job is never moved: its corruption is an error
    other = CheckpointManager(store, "ns/other")
    seed = _save(other, tmp_path / "o", helpers, 7)
    okey = f"{seed.key}/__1_0.distcp"
    raw = bytearray(store.get_bytes(okey))
    raw[5] ^= 0x01
    store.put_bytes(okey, bytes(raw))
    with pytest.raises(CheckpointCorrupt):
        restore_for_resume(CheckpointManager(store, "ns/fresh"), ResumeMode.URI, seed.uri, tmp_path / "r3")
    assert store.exists(f"{seed.key}/{COMMIT}")


def test_a_changed_spec_refuses_to_resume_and_names_the_field(store, tmp_path, helpers):
    manager = CheckpointManager(store, BASE, max_to_keep=None)
    fields = {"model.path": "s3://models/a", "algorithm.klCoef": 0.001, "data.trainFiles": ["/d/train.parquet"]}
    src = helpers.write_checkpoint_dir(tmp_path / "local", seed=3)
    manager.commit_folder(src, 3, {}, "hash-a", blocking=True, spec_fields=fields)
    with pytest.raises(SpecChanged) as err:
        restore_for_resume(manager, ResumeMode.AUTO, None, tmp_path / "r1", {**fields, "model.path": "s3://models/b"})
    msg = str(err.value)
    assert "spec.model.path was 's3://models/a', now 's3://models/b'" in msg
    assert "resumeMode: disable" in msg and "new job name" in msg and "--fresh" in msg
    assert "klCoef" not in msg and not (tmp_path / "r1").exists()
    # the same fields (lr, steps and the like are not recorded) resume
    assert restore_for_resume(manager, ResumeMode.AUTO, None, tmp_path / "r2", dict(fields)).step == 3
    # a checkpoint written before fields were recorded is not refused
    old = helpers.write_checkpoint_dir(tmp_path / "old", seed=4)
    manager.commit_folder(old, 4, {}, "hash-a", blocking=True)
    assert restore_for_resume(manager, ResumeMode.AUTO, None, tmp_path / "r3", {"model.path": "x"}).step == 4


def _flip_a_bit(store, ref):
    key = f"{ref.key}/__0_0.distcp"
    data = bytearray(store.get_bytes(key))
    data[100] ^= 0x01  # same size: only the checksum can tell
    store.put_bytes(key, bytes(data))


def test_a_restart_of_the_same_job_with_resume_mode_disable_continues_its_own_steps(store, tmp_path, helpers):
    """resumeMode disable means "not from an earlier job's checkpoints": the same RLJob (uid) or local run
    (run id) restarting after a kill continues from its own newest step; another job's steps go aside."""
    earlier = CheckpointManager(store, BASE, max_to_keep=None, owner="uid-old")
    _save(earlier, tmp_path / "old", helpers, 100)
    job = CheckpointManager(store, BASE, max_to_keep=None, owner="uid-1")
    assert restore_for_resume(job, ResumeMode.DISABLE, None, tmp_path / "r1") is None  # first start
    assert job.list_committed() == []
    for step in (5, 10):
        _save(job, tmp_path, helpers, step)
    # SIGKILL at step 13; the pod restarts: same uid
    restarted = CheckpointManager(store, BASE, max_to_keep=None, owner="uid-1")
    ref = restore_for_resume(restarted, ResumeMode.DISABLE, None, tmp_path / "r2")
    assert ref is not None and ref.step == 10
    assert helpers.read_tree(tmp_path / "r2") == helpers.read_tree(tmp_path / "local_10")
    assert [r.step for r in restarted.list_committed()] == [5, 10]
    # a new RLJob of the same name (a new uid) does start over, setting the old job's steps aside
    recreated = CheckpointManager(store, BASE, max_to_keep=None, owner="uid-2")
    assert restore_for_resume(recreated, ResumeMode.DISABLE, None, tmp_path / "r3") is None
    assert recreated.list_committed() == []


@pytest.mark.parametrize("steps", [(1,), (1, 2)], ids=["only-one-kept", "all"])
def test_a_job_whose_every_step_is_corrupt_stops_instead_of_starting_over(store, tmp_path, helpers, steps):
    manager = CheckpointManager(store, BASE, max_to_keep=None, owner="uid-1")
    for step in steps:
        _flip_a_bit(store, _save(manager, tmp_path, helpers, step))
    for mode, seed in ((ResumeMode.AUTO, None), (ResumeMode.URI, "s3://seeds/seed-job"), (ResumeMode.DISABLE, None)):
        again = CheckpointManager(store, BASE, max_to_keep=None, owner="uid-1")
        with pytest.raises(CheckpointError) as err:  # the restart after the quarantine stops too
            restore_for_resume(again, mode, seed, tmp_path / "r")
        msg = str(err.value)
        for step in steps:
            assert f"{QUARANTINE}/step_{step:06d}-" in msg, msg
        assert "none of it loads" in msg and f"move {again.base_uri}/{QUARANTINE}/ elsewhere" in msg
        assert "--fresh" in msg
    assert manager.list_committed() == [] and [q["step"] for q in manager.list_quarantined()] == list(steps)
    # starting over on purpose: the quarantine moved aside, the job starts from scratch
    store.delete_prefix(f"{BASE}/{QUARANTINE}/")
    assert restore_for_resume(CheckpointManager(store, BASE, owner="uid-1"), ResumeMode.AUTO, None,
                              tmp_path / "r4") is None


def test_superseded_runs_are_pruned_to_the_newest(store, tmp_path, helpers, monkeypatch):
    """Each resumeMode: disable start of a new job moves the earlier job's steps under superseded/<time>/;
    only the newest SUPERSEDED_KEEP of those folders stay (maxToKeep 0 keeps all)."""
    from rljob_worker.checkpoint import commit

    stamps = iter(f"20260101T00000{i}Z" for i in range(10))
    monkeypatch.setattr(commit, "_stamp", lambda: next(stamps))
    for i in range(4):
        job = CheckpointManager(store, BASE, max_to_keep=3, owner=f"uid-{i}")
        restore_for_resume(job, ResumeMode.DISABLE, None, tmp_path / f"r{i}")
        _save(job, tmp_path / f"j{i}", helpers, 10 + i)
    folders = sorted({k.split("/")[3] for k in _step_files(store, f"{BASE}/{SUPERSEDED}/")})
    assert len(folders) == commit.SUPERSEDED_KEEP == 2
    assert folders == ["20260101T000001Z", "20260101T000002Z"]  # the runs of uid-1 and uid-2
    keep_all = CheckpointManager(store, BASE, max_to_keep=0, owner="uid-9")
    restore_for_resume(keep_all, ResumeMode.DISABLE, None, tmp_path / "r9")
    assert len({k.split("/")[3] for k in _step_files(store, f"{BASE}/{SUPERSEDED}/")}) == 3
