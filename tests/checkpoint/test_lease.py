"""One writer per checkpoint prefix: the LEASE object, on SeaweedFS and a local folder."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from rljob_worker.checkpoint.lease import LEASE, CheckpointLease, LeaseHeld, local_identity

pytestmark = pytest.mark.timeout(60)

BASE = "ns/job"


def lease(store, **kw):
    kw.setdefault("settle_s", 0.05)
    identity = kw.pop("identity", None) or local_identity()
    return CheckpointLease(store, BASE, identity, **kw)


def test_a_second_writer_is_stopped_with_the_holder_named(store):
    first = lease(store, heartbeat_s=0.2)
    first.acquire()
    second = lease(store)
    with pytest.raises(LeaseHeld) as err:
        second.acquire()
    msg = str(err.value)
    assert f"pid {first.identity['pid']} on host {first.identity['host']}" in msg
    assert "in use by another run" in msg and "another job name or spec.checkpoint.uri" in msg
    time.sleep(0.5)  # heartbeats keep it
    with pytest.raises(LeaseHeld):
        lease(store).acquire()
    first.release()
    assert not store.exists(f"{BASE}/{LEASE}")
    second.acquire()  # free again
    second.release()


def test_a_dead_holder_is_taken_over(store):
    # on this host: its process is gone (a SIGKILLed local run)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=False, capture_output=True, text=True)
    ghost = {**local_identity(), "pid": int(dead.stdout), "pid_start": "1"}
    killed = lease(store, identity=ghost)
    killed.acquire()
    killed._stop.set()
    taker = lease(store)
    taker.acquire()
    assert taker.read()["run_id"] == taker.identity["run_id"]
    taker._stop.set()  # dies without releasing: the heartbeat stops
    taker._thread.join()
    taker._thread = killed._thread = None
    # elsewhere: only a stale heartbeat frees it
    other_host = {**local_identity(), "host": "elsewhere"}
    with pytest.raises(LeaseHeld):
        lease(store, identity=other_host, stale_after_s=30).acquire()
    late = lease(store, identity=other_host, stale_after_s=0.2)
    time.sleep(0.3)
    late.acquire()
    late.release()


def test_a_restarted_pod_of_the_same_rljob_takes_over_but_a_recreated_rljob_does_not(store):
    pod = lease(store, identity={**local_identity(job_uid="uid-1"), "host": "job-master-0"})
    pod.acquire()
    pod._stop.set()
    pod._thread = None  # the pod died
    restarted = lease(store, identity={**local_identity(job_uid="uid-1"), "host": "job-master-0"})
    restarted.acquire()
    with pytest.raises(LeaseHeld, match="RLJob uid uid-1"):
        lease(store, identity={**local_identity(job_uid="uid-2"), "host": "job-master-0"}).acquire()
    restarted.release()


def test_a_run_that_lost_the_lease_stops_saving(store):
    first = lease(store, heartbeat_s=0.1, identity={**local_identity(), "host": "a"})
    first.acquire()
    first.check()
    store.put_bytes(f"{BASE}/{LEASE}", b'{"run_id": "someone-else", "heartbeat": %f}' % time.time())
    deadline = time.monotonic() + 5
    while not first.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseHeld, match="took over"):
        first.check()
    first.release()
    assert store.exists(f"{BASE}/{LEASE}"), "released a lease another run holds"


class _SlowPut:
    """A store whose PUTs reach the server `delay_s` late (a slow network path): the request's
    condition, if any, is evaluated when it lands."""

    def __init__(self, store, delay_s: float):
        self._store, self._delay_s = store, delay_s

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name in ("put_bytes", "put_bytes_if"):
            def slow(*args, **kwargs):
                time.sleep(self._delay_s)
                return attr(*args, **kwargs)
            return slow
        return attr


def test_two_writers_racing_with_a_slow_first_put_end_with_one_holder(store):
    """Writer A reads an empty prefix, then its PUT takes 0.8 s; writer B reads the same empty prefix
    0.1 s later and writes at once. Only one of them may hold the lease."""
    import threading

    a = CheckpointLease(_SlowPut(store, 0.8), BASE, {**local_identity(), "host": "a"}, heartbeat_s=0.2)
    b = CheckpointLease(store, BASE, {**local_identity(), "host": "b"}, heartbeat_s=0.2)
    outcome: dict[str, object] = {}

    def take(name, lease_):
        try:
            lease_.acquire()
            outcome[name] = "held"
        except LeaseHeld as e:
            outcome[name] = e

    threads = [threading.Thread(target=take, args=("a", a))]
    threads[0].start()
    time.sleep(0.1)
    threads.append(threading.Thread(target=take, args=("b", b)))
    threads[1].start()
    for t in threads:
        t.join(timeout=10)
    try:
        holders = sorted(k for k, v in outcome.items() if v == "held")
        assert len(outcome) == 2 and len(holders) == 1, f"both or neither hold the lease: {outcome}"
        loser = "b" if holders == ["a"] else "a"
        assert "in use by another run" in str(outcome[loser])
        winner = a if holders == ["a"] else b
        assert winner.read()["run_id"] == winner.identity["run_id"]
        time.sleep(0.5)  # the winner's heartbeats keep it; it never counts as lost
        winner.check()
    finally:
        a.release()
        b.release()
    assert not store.exists(f"{BASE}/{LEASE}")
