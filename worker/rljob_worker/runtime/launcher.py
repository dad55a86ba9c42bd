"""`rljob run FILE`: run an RLJob on this machine with the environment a PyTorchJob would give it.

For every "pod" (nnodes of them) this starts the pod's own command, `torchrun -m rljob_worker
--spec spec.json`, with PET_NNODES / PET_NODE_RANK / PET_NPROC_PER_NODE / PET_MASTER_ADDR /
PET_MASTER_PORT set as the Kubeflow training-operator sets them, so a local run exercises the
same start-up path as a cluster run. The local e2e test drives pods through the same
`pod_environment` / `start_pod` functions.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from rljob_api.models import RLJob
from rljob_api.validation import processes_per_node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_environment(job: RLJob, node_rank: int, master_port: int, *, master_addr: str = "127.0.0.1",
                    metrics_port: int | None = None) -> dict[str, str]:
    """The variables the training-operator injects into replica `node_rank` (0 = Master), plus ours."""
    spec = job.spec
    env = {
        "PET_NNODES": str(spec.nnodes),
        "PET_NPROC_PER_NODE": str(processes_per_node(spec)),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": str(master_port),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(node_rank),
        "WORLD_SIZE": str(spec.nnodes),  # the pod count, as the operator sets it; the worker does not trust it
        "RLJOB_NAME": job.metadata.name,
        "RLJOB_NAMESPACE": job.metadata.namespace,
    }
    if metrics_port is not None:
        env["RLJOB_METRICS_PORT"] = str(metrics_port)
    return env


def pod_command(spec_path: Path) -> list[str]:
    """The container command the operator puts in the PyTorchJob (torchrun reads the PET_* variables)."""
    return [sys.executable, "-m", "rljob_worker.runtime.launch", "-m", "rljob_worker", "--spec", str(spec_path)]


def write_spec(job: RLJob, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "spec.json"
    path.write_text(json.dumps(job.spec.model_dump(mode="json", by_alias=True), indent=2))
    return path


def start_pod(job: RLJob, node_rank: int, master_port: int, spec_path: Path, extra_env: dict[str, str],
              log_path: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, **pod_environment(job, node_rank, master_port,
                                           metrics_port=job.spec.metrics.port + node_rank), **extra_env}
    env.setdefault("OMP_NUM_THREADS", "1" if job.spec.nnodes * processes_per_node(job.spec) > 1 else "2")
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child process
    return subprocess.Popen(pod_command(spec_path), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)


RUN_MARKER = ".rljob-run"  # the run's manifest in its workdir: which job, and every path a run of it wrote
_RUN_FILES = ("spec.json", "output.log", "work")  # top-level names a run writes (besides pod-N.log)


class FreshRefused(ValueError):
    """`--fresh` would delete something the job did not write."""


class WorkdirRefused(ValueError):
    """A run would write over a path in its workdir that it did not create."""


def _read_manifest(root: Path) -> dict | None:
    try:
        doc = json.loads((root / RUN_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _is_ours(job: RLJob, doc: dict | None) -> bool:
    return bool(doc) and doc.get("job") == job.metadata.name and doc.get("namespace") == job.metadata.namespace


def _write_manifest(root: Path, doc: dict) -> None:
    tmp = root / f"{RUN_MARKER}.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, root / RUN_MARKER)


def files_under(folder: Path, root: Path) -> set[str]:
    """Every file (and symlink) below `folder`, relative to `root`."""
    if not folder.is_dir():
        return set()
    return {p.relative_to(root).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}


def claim_workdir(job: RLJob, root: Path, nnodes: int = 1) -> set[str]:
    """Before a run writes into `root`: refuse when a path it would write exists and no earlier run of this
    job wrote it (the user's own `spec.json` in `--workdir .`), else write the manifest. Returns the files
    under `root/work` now (a run adds to the manifest only what appears there while it runs)."""
    doc = _read_manifest(root)
    if doc is not None and not _is_ours(job, doc):
        raise WorkdirRefused(f"--workdir {root}: it holds the outputs of job {doc.get('namespace')}/{doc.get('job')} "
                             f"({RUN_MARKER}); pass --workdir with a new or empty folder")
    written = set(doc.get("written", ())) if doc else set()
    ours = {n.rstrip("/") for n in written}  # "work/": the folder is the run's (it created it)
    for name in (*_RUN_FILES, *(f"pod-{r}.log" for r in range(1, nnodes))):
        if (root / name).exists() and name not in ours:
            raise WorkdirRefused(f"--workdir {root}: {root / name} exists and was not written by `rljob run` of "
                                 f"{job.metadata.namespace}/{job.metadata.name}; a run writes spec.json, output.log, "
                                 "work/ and pod-N.log there: pass --workdir with a new or empty folder")
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "work").exists():
        written.add("work/")
    _write_manifest(root, {"job": job.metadata.name, "namespace": job.metadata.namespace, "written": sorted(written)})
    return files_under(root / "work", root)


def record_written(job: RLJob, root: Path, paths: set[str]) -> None:
    """Add `paths` (relative to `root`) to the manifest: what `--fresh` may delete later."""
    doc = _read_manifest(root) or {"job": job.metadata.name, "namespace": job.metadata.namespace}
    doc["written"] = sorted(set(doc.get("written", ())) | set(paths))
    _write_manifest(root, doc)


def mark_workdir(job: RLJob, root: Path) -> None:
    """Claim `root` for this job (see claim_workdir)."""
    claim_workdir(job, root)


def fresh_targets(job: RLJob, root: Path) -> list[Path]:
    """What `--fresh` deletes in `root`: the files the manifest says a run of this job wrote, and the manifest.

    Raises FreshRefused for a folder with content but no manifest of this job (a folder the run
    did not create, e.g. `--workdir .` on a first run), so nothing of the user's is ever deleted."""
    if not root.exists():
        return []
    doc = _read_manifest(root)
    if not _is_ours(job, doc):
        if not root.is_dir() or any(root.iterdir()):
            who = f"job {doc.get('namespace')}/{doc.get('job')}" if doc else "no rljob run"
            raise FreshRefused(
                f"--fresh: refusing to delete anything in {root}: it was not created by `rljob run` for "
                f"{job.metadata.namespace}/{job.metadata.name} ({who} marker {RUN_MARKER} there); "
                "pass --workdir with a new or empty folder, or delete what you no longer need by hand")
        return []
    found = [root / rel for rel in doc.get("written", ()) if (root / rel).is_file() or (root / rel).is_symlink()]
    return found + [root / RUN_MARKER]


def clear_previous_run(job: RLJob, root: Path, checkpoint_uri: str) -> None:
    """`--fresh`: remove the job's committed checkpoints and the run outputs it wrote into `root`.

    Checks the workdir first, so a refusal deletes nothing at all."""
    from rljob_worker.checkpoint.lease import CheckpointLease
    from rljob_worker.checkpoint.store import open_store

    targets = fresh_targets(job, root)
    store = open_store(checkpoint_uri, endpoint_url=job.spec.s3.endpoint, region=job.spec.s3.region)
    prefix = f"{job.metadata.namespace}/{job.metadata.name}/"
    held = CheckpointLease(store, prefix).refusal_if_held()  # a running job's steps and LEASE stay
    if held is not None:
        raise FreshRefused(f"--fresh: deleting nothing: {held}")
    store.delete_prefix(prefix)
    for path in targets:
        path.unlink(missing_ok=True)
    # folders the deletions emptied (never one that still holds a file the run cannot prove it wrote)
    for folder in sorted({p.parent for p in targets if p.parent != root}, key=lambda p: -len(p.parts)):
        while folder != root and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    kept = files_under(root / "work", root)
    listed = (f"{len(targets) - 1} file(s) the earlier runs wrote in {root}" if len(targets) > 1 else "no local outputs")
    if kept:
        listed += f" (kept {len(kept)} file(s) under {root / 'work'} no run recorded writing, e.g. {min(kept)})"
    print(f"rljob: --fresh: deleted the checkpoints under {store.uri_for(prefix.rstrip('/'))}/ and {listed}",
          flush=True)


PEER_GONE_GRACE_S = 30.0  # after SIGTERM, how long the pods left behind by a failed one get to stop


def wait_pods(pods: list[subprocess.Popen], grace_s: float = PEER_GONE_GRACE_S, poll_s: float = 0.2,
              stopping: Callable[[], bool] = lambda: False) -> tuple[list[int], int | None]:
    """(each pod's exit code, the index of the first pod that failed or None). A pod that fails (a start-up error
    of its own, a crash) leaves the others waiting for it in distributed init or their next collective until
    torch's 30-minute timeout, so they get SIGTERM (they save if they still can and exit 143) and SIGKILL after
    ``grace_s``. Not while ``stopping()`` (the user stopped the run: every pod saves, however long it takes)."""
    failed: list[int] = []  # pods in the order they were seen failing
    failed_at = None
    while True:
        codes = [pod.poll() for pod in pods]
        failed += [i for i, c in enumerate(codes) if c not in (None, 0) and i not in failed]
        if all(c is not None for c in codes):
            return codes, (failed[0] if failed else None)
        if failed and not stopping():
            if failed_at is None:
                failed_at, sig = time.monotonic(), signal.SIGTERM
            else:
                sig = signal.SIGKILL if time.monotonic() - failed_at > grace_s else None
            for pod in pods:
                if sig is not None and pod.poll() is None:
                    try:
                        os.killpg(pod.pid, sig)
                    except ProcessLookupError:  # it ended since the poll
                        pass
        time.sleep(poll_s)


def run_local(job: RLJob, workdir: str | None = None, checkpoint_uri: str | None = None,
              steps: int | None = None, fresh: bool = False) -> int:
    spec = job.spec
    if spec.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            print("note: spec.device is gpu but no GPU is visible; running on CPU with gloo", file=sys.stderr)
    root = Path(workdir or Path("runs") / job.metadata.name).resolve()
    from rljob_worker.checkpoint.store import StorageError, parse_uri

    if checkpoint_uri is not None:
        try:
            parse_uri(checkpoint_uri)
        except ValueError as exc:
            print(f"rljob: --checkpoint-uri: {exc}", file=sys.stderr)
            return 2
    if fresh:
        try:
            clear_previous_run(job, root, checkpoint_uri or spec.checkpoint.uri)
        except (FreshRefused, StorageError) as exc:
            print(f"rljob: {exc}", file=sys.stderr)
            return 2
    try:
        work_before = claim_workdir(job, root, spec.nnodes)
    except WorkdirRefused as exc:
        print(f"rljob: {exc}", file=sys.stderr)
        return 2
    top_before = {n for n in ("output.log", *(f"pod-{r}.log" for r in range(1, spec.nnodes))) if (root / n).exists()}
    from rljob_worker.runtime.pipe_output import OUTPUT_LOG_VAR, protect_output

    output_log = root / "output.log"
    protect_output(output_log)  # a closed stdout (`| tee` ended by Ctrl-C) must not stop the run or its save
    spec_path = write_spec(job, root)
    record_written(job, root, {"spec.json"})
    master_port = free_port()
    extra = {"RLJOB_WORKDIR": str(root / "work"), "RLJOB_PROGRESS_BAR": "1" if sys.stdout.isatty() else "0",
             OUTPUT_LOG_VAR: str(output_log)}
    if checkpoint_uri:
        extra["RLJOB_CHECKPOINT_URI"] = checkpoint_uri
    if steps is not None:
        extra["RLJOB_MAX_STEPS"] = str(steps)
    ckpt = checkpoint_uri or spec.checkpoint.uri
    print(f"rljob: running {job.metadata.name} locally: {spec.nnodes} pod(s) x {processes_per_node(spec)} process(es); "
          f"metrics on :{spec.metrics.port}; checkpoints under {ckpt.rstrip('/')}/{job.metadata.namespace}/"
          f"{job.metadata.name}/", flush=True)
    started = time.monotonic()
    from rljob_worker.runtime.process_guard import RUN_ID_VAR, kill_run, start_guard

    run_id = uuid.uuid4().hex
    extra[RUN_ID_VAR] = run_id  # every process of the run inherits it; the guard ends them all
    guard = start_guard(run_id)
    pods: list[subprocess.Popen] = []
    stopping: list[int] = []

    def forward(signum, _frame):  # SIGTERM, Ctrl-C, a closed terminal: the pods save and stop
        stopping.append(signum)
        for pod in pods:
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        pods.extend(start_pod(job, rank, master_port, spec_path, extra,
                              log_path=None if rank == 0 else root / f"pod-{rank}.log") for rank in range(spec.nnodes))
        codes, first_failed = wait_pods(pods, stopping=lambda: bool(stopping))
    finally:
        # Helpers that outlived their worker (reward pools, checkpoint writers) go now, not never.
        kill_run(run_id, grace_s=5.0)
        if guard is not None:
            guard.stdin.close()
            guard.wait()
        # what this run wrote, so that `--fresh` deletes exactly that (files the user adds later stay)
        new_top = {n for n in ("output.log", *(f"pod-{r}.log" for r in range(1, spec.nnodes)))
                   if (root / n).exists() and n not in top_before}
        record_written(job, root, new_top | (files_under(root / "work", root) - work_before))
    code = codes[first_failed] if first_failed is not None else 0  # the pod that failed, not the peers it stopped
    if first_failed and not stopping:  # its output is in its log file, not above: say what it said
        log = root / f"pod-{first_failed}.log"
        said = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("rljob")]
        print(f"rljob: pod {first_failed} failed first (exit code {code}; the others were stopped); its output is in "
              f"{log}" + (f", ending: {said[-1]}" if said else ""), file=sys.stderr, flush=True)
    print(f"rljob: {job.metadata.name} finished with exit code {code} in {time.monotonic() - started:.0f}s; "
          f"outputs in {root}", flush=True)
    return code
