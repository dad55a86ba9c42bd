"""Checkpoint upload benchmark on a real SeaweedFS S3 server (a benchmark, not a test).

Measures, in one run and on the same server:

(a) throughput: ``CheckpointManager.commit_folder(..., blocking=True)`` (sha256 of every file, parallel
    multipart upload, meta.json, listing check, COMMIT) against plain boto3 ``upload_file`` of the
    same files one after the other with boto3's default transfer settings;
(b) training stall per save: a loop of fake training steps (fixed CPU work in numpy, which like
    torch kernels releases the GIL) saving every few steps, synchronously (``blocking=True``) and
    in the background (``blocking=False``). Two numbers per mode: the time the loop is blocked
    inside ``save()``, and the loop slowdown (wall time - the same loop without saves), which
    also counts CPU the upload takes from the training steps (large on a machine of few cores).

    python bench/checkpoint.py                 # 256 MB checkpoint
    python bench/checkpoint.py --mb 1024 --repeats 3

The server comes from tests/conftest.py's ``start_s3_server`` (the same ``weed mini`` the tests
use), with data on local disk: absolute numbers reflect this machine's disk and CPUs, the ratios
are the point.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the fake training step uses one core, like one rank

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


def start_server(workdir: Path):
    """Reuse the test suite's SeaweedFS launcher (free ports, credentials, readiness probe)."""
    spec = importlib.util.spec_from_file_location("rljob_tests_conftest", REPO / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.start_s3_server(workdir)


def write_fake_checkpoint(path: Path, total_mb: int, seed: int = 0) -> int:
    """A folder like a megatron distributed checkpoint: one large shard, several smaller ones,
    hidden metadata and small common files. Returns the byte count."""
    import random

    rnd = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    big = total_mb * 5 // 8
    rest = total_mb - big
    sizes = {"__0_0.distcp": big * MiB}
    n_small = 6
    for i in range(n_small):
        sizes[f"__{i + 1}_0.distcp"] = rest * MiB // n_small
    for name, size in sizes.items():
        with open(path / name, "wb") as f:
            left = size
            while left:
                chunk = min(left, 16 * MiB)
                f.write(rnd.randbytes(chunk))
                left -= chunk
    (path / ".metadata").write_bytes(rnd.randbytes(200_000))
    (path / "common.pt").write_bytes(rnd.randbytes(50_000))
    (path / "trainer_state.json").write_text('{"step": 1}')
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_boto3_upload(client, bucket: str, prefix: str, local_dir: Path) -> None:
    for p in sorted(local_dir.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local_dir).as_posix()}")


def make_train_step(target_s: float):
    """A fixed amount of CPU work (numpy matmuls) calibrated to about target_s seconds."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)

    def work(n: int) -> None:
        x = a
        for _ in range(n):
            x = np.tanh(x @ a)

    t0 = time.perf_counter()
    work(50)
    per = (time.perf_counter() - t0) / 50
    n = max(1, int(target_s / per))
    return lambda: work(n)


def train_loop(step_fn, steps: int, save_every: int, save=None) -> float:
    """Wall seconds of ``steps`` fake training steps, calling ``save(step)`` every ``save_every``."""
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        step_fn()
        if save is not None and step % save_every == 0:
            save(step)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="checkpoint size in MB")
    ap.add_argument("--repeats", type=int, default=3, help="throughput repeats (median reported)")
    ap.add_argument("--steps", type=int, default=30, help="fake training steps in the stall loop")
    ap.add_argument("--save-every", type=int, default=10,
                    help="steps between saves (production: the upload finishes well within this)")
    ap.add_argument("--step-seconds", type=float, default=1.0, help="CPU work per fake training step")
    ap.add_argument("--workers", type=int, default=8, help="CheckpointManager file threads")
    args = ap.parse_args()

    sys.path.insert(0, str(REPO / "worker"))
    from rljob_worker.checkpoint.commit import CheckpointManager
    from rljob_worker.checkpoint.store import S3Store

    with tempfile.TemporaryDirectory(prefix="rljob-bench-") as tmp:
        tmp = Path(tmp)
        server = start_server(tmp / "s3")
        try:
            client = server.client()
            bucket = "bench-ckpt"
            client.create_bucket(Bucket=bucket)
            store = S3Store(
                bucket, "bench", endpoint_url=server.endpoint_url, region=server.region,
                access_key=server.access_key, secret_key=server.secret_key,
            )
            local = tmp / "ckpt"
            nbytes = write_fake_checkpoint(local, args.mb)
            n_files = sum(1 for p in local.rglob("*") if p.is_file())
            print(f"checkpoint: {nbytes / 1e6:.0f} MB in {n_files} files; server {server.endpoint_url}; "
                  f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

            # (a) throughput, interleaved so drift in machine load hits both alike
            mgr = CheckpointManager(store, "tput", max_to_keep=1, max_workers=args.workers)
            t_raw, t_mgr = [], []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                raw_boto3_upload(client, bucket, f"raw/{r}", local)
                t_raw.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                mgr.commit_folder(local, r + 1, {"loss": 0.0}, "bench", blocking=True)
                t_mgr.append(time.perf_counter() - t0)
            raw_s, mgr_s = statistics.median(t_raw), statistics.median(t_mgr)

            # (b) training stall per save: base, sync, background, base again (load drifts here)
            step_fn = make_train_step(args.step_seconds)
            n_saves = args.steps // args.save_every
            base1 = train_loop(step_fn, args.steps, args.save_every)
            runs = {}
            for mode in ("sync", "background"):
                mgr = CheckpointManager(store, mode, max_to_keep=2, max_workers=args.workers)
                blocked: list[float] = []
                handles = []

                def save(step: int, mgr=mgr, blocked=blocked, handles=handles, mode=mode) -> None:
                    t0 = time.perf_counter()
                    handles.append(mgr.commit_folder(local, step, {}, "bench", blocking=mode == "sync"))
                    blocked.append(time.perf_counter() - t0)

                wall = train_loop(step_fn, args.steps, args.save_every, save)
                t0 = time.perf_counter()
                mgr.wait_for_commit()
                drain = time.perf_counter() - t0
                assert mgr.latest_committed().step == args.steps
                runs[mode] = (wall, blocked, drain, [h.seconds for h in handles])
            base2 = train_loop(step_fn, args.steps, args.save_every)
        finally:
            server.stop()

    base = (base1 + base2) / 2
    print()
    print(f"(a) upload throughput (median of {args.repeats})      seconds     MB/s")
    print(f"    boto3 upload_file, file by file     {raw_s:8.2f} {nbytes / 1e6 / raw_s:8.1f}")
    print(f"    CheckpointManager.commit_folder(blocking)    {mgr_s:8.2f} {nbytes / 1e6 / mgr_s:8.1f}")
    print(f"    ratio save / raw boto3 (MB/s)       {raw_s / mgr_s:8.2f}x")
    print()
    print(f"(b) training stall: {args.steps} steps of ~{base / args.steps:.2f} s CPU work, a save every "
          f"{args.save_every} steps ({n_saves} saves); loop without saves {base1:.1f} s before, {base2:.1f} s after")
    print("                        loop s   blocked in save() per save   loop slowdown per save   uploads s")
    stall = {}
    for mode, (wall, blocked, drain, upl) in runs.items():
        stall[mode] = (wall - base) / n_saves
        print(f"    {mode:<18} {wall:7.1f}   {statistics.mean(blocked):12.3f} s              "
              f"{stall[mode]:8.2f} s           {', '.join(f'{u:.1f}' for u in upl)}"
              + (f"  (+ final wait {drain:.1f} s)" if mode == "background" else ""))
    b_sync = statistics.mean(runs["sync"][1])
    b_bg = max(statistics.mean(runs["background"][1]), 1e-6)
    slowdown = (f"loop slowdown {stall['sync'] / stall['background']:.1f}x" if stall["background"] > 0.01
                else "loop slowdown of the background run below noise")
    print(f"    ratio sync / background: blocked time {b_sync / b_bg:,.0f}x, {slowdown}")

if __name__ == "__main__":
    main()
