"""A checkpoint's path through the code goes down the layers, never back up.

The run loop talks to one face (``run_checkpoints.RunCheckpoints``); the face uses the lease and the
commit protocol; the protocol uses the object store. A save traced call by call (the background
upload thread included) only ever calls from a layer into a layer below it, so each checkpoint
module is entered once on the way down per save.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from rljob_api.validation import parse_spec
from rljob_worker.checkpoint import commit, lease, run_checkpoints, store
from rljob_worker.runtime.distributed import DistEnv

LAYERS = [Path(m.__file__).resolve() for m in (run_checkpoints, lease, commit, store)]


class _WritesAFile:
    """An actor as the face sees it: a collective that writes its shards into the step folder."""

    def save_checkpoint(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.bin").write_bytes(b"\0" * 64)


def _trace_calls(edges: list[tuple[Path, Path]]):
    def profile(frame, event, _arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = Path(frame.f_code.co_filename), Path(frame.f_back.f_code.co_filename)
        if callee != caller and callee in LAYERS and caller in LAYERS:
            edges.append((caller, callee))
    return profile


def test_one_save_only_calls_down_the_layers(tmp_path):
    spec = parse_spec({"model": {"path": "builtin://tiny-qwen2"}, "reward": {"function": "target-token"},
                       "data": {"synthetic": {"task": "target-token"}},
                       "checkpoint": {"uri": (tmp_path / "store").as_uri()}})
    ctx = SimpleNamespace(job_name="layers", namespace="test", workdir=tmp_path / "work", checkpoint_uri=None)
    face = run_checkpoints.RunCheckpoints(spec, ctx, DistEnv())
    face.resume(_WritesAFile())  # takes the lease; nothing to resume

    edges: list[tuple[Path, Path]] = []
    profile = _trace_calls(edges)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        face.save(1, _WritesAFile(), {"step": 1}, {"reward": 0.5})
        ref = face.wait()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    face.lease.release()

    assert ref is not None and ref.step == 1
    layer = {path: i for i, path in enumerate(LAYERS)}
    upward = sorted({(a.name, b.name) for a, b in edges if layer[b] <= layer[a]})
    assert upward == [], f"calls back up the checkpoint layers: {upward}"
    entered = [b.name for _, b in edges]
    assert {"lease.py", "commit.py", "store.py"} <= set(entered), entered
