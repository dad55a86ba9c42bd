"""One writer per checkpoint prefix: a lease object ``<job prefix>/LEASE`` with the holder and a heartbeat.

Two runs on one prefix (the same job started twice, a re-applied RLJob while the old pods still
run, two `rljob run`s) would overwrite and prune each other's steps. Rank 0 takes the lease at
start-up, before it resumes, and renews it every ``heartbeat_s`` from a thread; it deletes it at
a normal exit. Another run may take it over only when

- it is the same run (same ``run_id``) or a restart of the same RLJob (same uid, from the
  operator's ``job.json``: a restarted pod replaces the dead one),
- the holder ran on this host and its process is gone (a killed local run), or
- the heartbeat is older than ``stale_after_s`` (a holder that died elsewhere).

Every write is a compare-and-swap on the store (S3 ``If-None-Match: *`` to create, ``If-Match:
<etag>`` to renew or take over; on a file system an exclusive create and a compare under a file
lock): of two runs that read the same state, only the first write lands, the other finds the
object changed, reads it again and stops. A server without conditional writes (501) falls back to
write, wait ``settle_s`` and read back, which a slow write can still beat; the read-back also stays
after a conditional write, for servers that ignore the headers.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from rljob_worker.checkpoint.commit import CheckpointError
from rljob_worker.checkpoint.store import (
    ConditionalWriteUnsupported,
    ObjectNotFoundError,
    ObjectStore,
    PreconditionFailed,
    StorageError,
)

log = logging.getLogger(__name__)

LEASE = "LEASE"


class LeaseHeld(CheckpointError):
    """Another live run holds the checkpoint prefix."""


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (ticks since boot), so a reused pid is not taken for the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def local_identity(job_uid: str | None = None) -> dict[str, Any]:
    pid = os.getpid()
    return {"run_id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": pid, "pid_start": _process_start(pid),
            "job_uid": job_uid or os.environ.get("RLJOB_UID") or None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


class CheckpointLease:
    def __init__(self, store: ObjectStore, base_prefix: str, identity: dict[str, Any] | None = None, *,
                 stale_after_s: float = 120.0, heartbeat_s: float = 20.0, settle_s: float = 0.5):
        self.store = store
        self.key = f"{base_prefix.strip('/')}/{LEASE}"
        self.identity = identity or local_identity()
        self.stale_after_s, self.heartbeat_s, self.settle_s = stale_after_s, heartbeat_s, settle_s
        self.lost = False
        self._etag: str | None = None  # the tag of our last write; None until acquired
        self._conditional = True  # False after the server said it has no conditional writes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def uri(self) -> str:
        return self.store.uri_for(self.key)

    def read(self) -> dict[str, Any] | None:
        return self._read_tagged()[0]

    def _read_tagged(self) -> tuple[dict[str, Any] | None, str | None]:
        """(holder, etag); holder None when there is no lease, {} for a torn or foreign object (free)."""
        try:
            data, etag = self.store.get_bytes_tagged(self.key)
        except ObjectNotFoundError:
            return None, None
        try:
            holder = json.loads(data)
        except ValueError:
            return {}, etag
        return (holder if isinstance(holder, dict) else {}), etag

    def _write(self, match: str | None) -> None:
        """Write our heartbeat if the lease is still at tag ``match`` (None: absent); PreconditionFailed if not."""
        data = json.dumps({**self.identity, "heartbeat": time.time()}).encode()
        if self._conditional:
            try:
                self._etag = self.store.put_bytes_if(self.key, data, match)
                return
            except ConditionalWriteUnsupported as e:
                log.warning("%s; the checkpoint lease falls back to write and read back", e)
                self._conditional = False
        self.store.put_bytes(self.key, data)
        self._etag = self.store.get_bytes_tagged(self.key)[1]

    def _may_take(self, holder: dict[str, Any]) -> str | None:
        """Why `holder`'s lease may be taken over (None: it may not)."""
        me = self.identity
        if holder.get("run_id") == me["run_id"]:
            return "ours"
        if holder.get("job_uid") and holder.get("job_uid") == me.get("job_uid"):
            return "a restart of the same RLJob"
        age = time.time() - float(holder.get("heartbeat") or 0)
        if age > self.stale_after_s:
            return f"its last heartbeat was {age:.0f} s ago"
        if holder.get("host") == me["host"] and holder.get("pid") is not None:
            alive = _process_start(int(holder["pid"]))
            if alive is None or alive != holder.get("pid_start"):
                return f"its process {holder['pid']} on this host is gone"
        return None

    def _refusal(self, holder: dict[str, Any]) -> LeaseHeld:
        age = time.time() - float(holder.get("heartbeat") or 0)
        who = f"pid {holder.get('pid')} on host {holder.get('host')}" + (
            f" (RLJob uid {holder['job_uid']})" if holder.get("job_uid") else "")
        return LeaseHeld(
            f"checkpoint prefix {self.uri.rsplit('/', 1)[0]}/ is in use by another run: {who}, started "
            f"{holder.get('started')}, last heartbeat {age:.0f} s ago. Two runs on one prefix overwrite each "
            f"other's checkpoints: stop the other run first (if it died, its lease expires {self.stale_after_s:.0f} s "
            "after its last heartbeat), or give this one another job name or spec.checkpoint.uri")

    def refusal_if_held(self) -> LeaseHeld | None:
        """Read only: the refusal a run of this identity would meet now (None when the prefix is free or its
        holder may be taken over). `rljob run --fresh` asks before deleting anything."""
        holder = self.read()
        if holder is None or self._may_take(holder) is not None:
            return None
        return self._refusal(holder)

    def acquire(self) -> None:
        for _attempt in range(5):  # each retry follows a write that lost a race, so the next read sees the winner
            holder, etag = self._read_tagged()
            if holder is not None:
                why = self._may_take(holder) if holder else "it is not a lease this version wrote"
                if why is None:
                    raise self._refusal(holder)
                if why != "ours":
                    log.warning("taking over the checkpoint lease %s from pid %s on %s: %s", self.uri,
                                holder.get("pid"), holder.get("host"), why)
            try:
                self._write(etag)
                break
            except PreconditionFailed:
                continue
        else:
            raise self._refusal(self.read() or {})
        time.sleep(self.settle_s)
        now, _ = self._read_tagged()
        if not now or now.get("run_id") != self.identity["run_id"]:
            raise self._refusal(now or holder or {})
        self._thread = threading.Thread(target=self._beat, name="rljob-lease", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                try:
                    self._write(self._etag)
                    continue
                except PreconditionFailed:
                    pass
                holder, etag = self._read_tagged()
                if holder is None:  # deleted behind our back (nobody holds it): take it again
                    self._write(None)
                elif holder.get("run_id") == self.identity["run_id"]:  # our own retried write landed
                    self._etag = etag
                else:
                    self.lost = True
                    log.error("lost the checkpoint lease %s to pid %s on %s; this run will not save again",
                              self.uri, holder.get("pid"), holder.get("host"))
                    return
            except PreconditionFailed:  # someone created it in between: the next beat reads who
                self._etag = None
            except StorageError as e:  # an outage: the next beat retries; staleness needs stale_after_s
                log.warning("checkpoint lease heartbeat failed (will retry): %s", e)

    def check(self) -> None:
        """Raise before a save if another run took the prefix over."""
        if self.lost:
            raise LeaseHeld(f"another run took over {self.uri}; not saving over its checkpoints")

    def release(self) -> None:
        atexit.unregister(self.release)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            try:
                holder, etag = self._read_tagged()
                if holder and holder.get("run_id") == self.identity["run_id"] and etag is not None:
                    self.store.delete_if(self.key, etag)  # not if another run took it meanwhile
            except PreconditionFailed:
                pass
            except StorageError as e:
                log.warning("could not release the checkpoint lease %s: %s", self.uri, e)
