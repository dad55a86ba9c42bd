"""Operator load benchmark: apply N RLJobs to the test API server, measure apply -> PyTorchJob latency and RSS.

    python bench/operator_load.py                      # 500 jobs paced at 25/s, then 500 in a burst
    python bench/operator_load.py --jobs 200 --rate 0  # one burst only
    python bench/operator_load.py --json out.json

Setup: the kmock-based test API server (tests/operator/apiserver.py, its own process, validating
every write against the CRD schemas and CEL rules) and the real operator, also a process
(`python -m rljob_operator --all-namespaces`); this driver applies the jobs from 8 threads. A watch on PyTorchJobs timestamps each creation as it arrives;
latency is that time minus the moment the RLJob POST started. The operator's RSS is sampled every
0.2 s (peak and at the end) from /proc. This is a benchmark, not a test: it prints numbers
(goal: p99 <= 1 s, RSS <= 150 MB) and exits non-zero only if jobs are missing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "operator"))

import opschema
from cluster import PYTORCHJOBS, RLJOBS, KubeClient, OperatorProcess, free_port, wait_until


def rljob(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"] = {"name": name}
    return doc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (robust against other load on the machine)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Watcher(threading.Thread):
    """Records when each PyTorchJob's ADDED event arrives."""

    def __init__(self, kube: KubeClient):
        super().__init__(daemon=True)
        self.kube, self.seen, self.stop_flag = kube, {}, threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        rv = self.kube.list(PYTORCHJOBS)["metadata"]["resourceVersion"]
        self.ready.set()
        while not self.stop_flag.is_set():
            try:
                for event in self.kube.watch(PYTORCHJOBS, timeout=2, resourceVersion=rv, timeoutSeconds="30"):
                    meta = event["object"]["metadata"]
                    if event["type"] == "ADDED":
                        self.seen.setdefault((meta["namespace"], meta["name"]), time.monotonic())
                    rv = meta.get("resourceVersion", rv)
                    if self.stop_flag.is_set():
                        return
            except OSError:
                continue


class RssSampler(threading.Thread):
    def __init__(self, op: OperatorProcess):
        super().__init__(daemon=True)
        self.op, self.peak, self.stop_flag = op, 0, threading.Event()

    def run(self) -> None:
        while not self.stop_flag.wait(0.2):
            try:
                self.peak = max(self.peak, self.op.rss_bytes())
            except OSError:
                return


def run_phase(kube: KubeClient, watcher: Watcher, namespace: str, jobs: int, rate: float,
              concurrency: int) -> dict[str, Any]:
    kube.create_namespace(namespace)
    starts: dict[tuple[str, str], float] = {}
    lock = threading.Lock()

    def apply(i: int) -> None:
        name = f"job-{i:04d}"
        with lock:
            starts[(namespace, name)] = time.monotonic()
        kube.create(RLJOBS, namespace, rljob(name))

    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = []
        for i in range(jobs):
            if rate > 0:
                delay = began + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            futures.append(pool.submit(apply, i))
        for f in futures:
            f.result()
    applied = time.monotonic() - began
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(1 for k in starts if k in watcher.seen) < jobs:
        time.sleep(0.1)
    latencies = [watcher.seen[k] - t for k, t in starts.items() if k in watcher.seen]
    all_done = max((watcher.seen[k] for k in starts if k in watcher.seen), default=began) - began

    def accepted() -> int:
        items = kube.items(RLJOBS, namespace)
        return sum(1 for j in items for cond in (j.get("status") or {}).get("conditions", [])
                   if cond["type"] == "Accepted" and cond["status"] == "True")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and accepted() < jobs:
        time.sleep(0.5)
    return {
        "jobs": jobs, "rate_per_s": rate or "burst", "apply_seconds": round(applied, 2),
        "created": len(latencies), "accepted": accepted(),
        "latency_p50_s": round(percentile(latencies, 50), 3), "latency_p90_s": round(percentile(latencies, 90), 3),
        "latency_p99_s": round(percentile(latencies, 99), 3), "latency_max_s": round(max(latencies, default=0), 3),
        "latency_mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "all_created_after_s": round(all_done, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rate", type=float, default=25.0, help="RLJobs applied per second (0: one burst only)")
    parser.add_argument("--concurrency", type=int, default=8, help="parallel client connections applying jobs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="rljob-bench-"))
    port = free_port()
    kubeconfig = workdir / "kubeconfig.json"
    server = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "operator" / "apiserver.py"), "--port", str(port),
         "--kubeconfig", str(kubeconfig), "--crd", str(REPO / "crds" / "rljob.dev_rljobs.yaml"),
         "--crd", str(opschema.VENDORED_PYTORCHJOB_CRD),
         *([] if importlib.util.find_spec("kubernetes_validate") else ["--no-validate-builtins"])],
        stdout=open(workdir / "apiserver.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    kube = KubeClient(f"http://127.0.0.1:{port}", timeout=30)
    wait_until(lambda: kube.maybe_get(("apiextensions.k8s.io", "v1", "customresourcedefinitions"), None,
                                      "pytorchjobs.kubeflow.org"), timeout=60, what="the test API server")
    served = lambda: kube.request("GET", "/harness/stats")["requests"]
    op = OperatorProcess(kubeconfig, workdir / "operator.log",
                         all_namespaces=True, env={"RLJOB_API_TIMEOUT_SECONDS": "30"}, extra_args=["--quiet"]).start()
    results: dict[str, Any] = {"phases": []}
    try:
        op.wait_ready()
        idle_rss = op.rss_bytes()
        watcher = Watcher(kube)
        watcher.start()
        watcher.ready.wait(10)
        sampler = RssSampler(op)
        sampler.start()
        requests_before = served()
        phases = [("paced", args.rate), ("burst", 0.0)] if args.rate > 0 else [("burst", 0.0)]
        for label, rate in phases:
            before = served()
            cpu_before = cpu_seconds(op.proc.pid), cpu_seconds(server.pid)
            phase = run_phase(kube, watcher, f"bench-{label}-{uuid.uuid4().hex[:4]}", args.jobs, rate,
                              args.concurrency)
            phase["phase"] = label
            phase["api_requests_per_job"] = round((served() - before) / args.jobs, 1)
            phase["operator_cpu_ms_per_job"] = round((cpu_seconds(op.proc.pid) - cpu_before[0]) * 1000 / args.jobs, 1)
            phase["apiserver_cpu_ms_per_job"] = round((cpu_seconds(server.pid) - cpu_before[1]) * 1000 / args.jobs, 1)
            results["phases"].append(phase)
            print(json.dumps(phase), flush=True)
        time.sleep(2)
        sampler.stop_flag.set()
        watcher.stop_flag.set()
        results.update({
            "jobs_total": args.jobs * len(phases),
            "operator_rss_idle_mb": round(idle_rss / 2**20, 1),
            "operator_rss_peak_mb": round(sampler.peak / 2**20, 1),
            "operator_rss_end_mb": round(op.rss_bytes() / 2**20, 1),
            "reconciles_ok": op.metric("rljob_operator_reconciles_total", result="ok"),
            "api_errors": sum(op.metric("rljob_operator_api_errors_total", code=str(code)) for code in (0, 409, 500)),
            "api_requests_total": served() - requests_before,
        })
    finally:
        op.stop()
        server.terminate()
        server.wait(timeout=10)
    print(json.dumps({k: v for k, v in results.items() if k != "phases"}, indent=1))
    print("\nphase   jobs  rate    p50     p90     p99     max     all-created  requests/job  "
          "operator-cpu-ms/job  apiserver-cpu-ms/job")
    for p in results["phases"]:
        print(f"{p['phase']:<7} {p['jobs']:<5} {p['rate_per_s']!s:<7} {p['latency_p50_s']:<7} "
              f"{p['latency_p90_s']:<7} {p['latency_p99_s']:<7} {p['latency_max_s']:<7} "
              f"{p['all_created_after_s']:<12} {p['api_requests_per_job']:<13} {p['operator_cpu_ms_per_job']:<20} "
              f"{p['apiserver_cpu_ms_per_job']}")
    print(f"load average during the run (other work on this machine skews latency): {os.getloadavg()}")
    print(f"operator RSS: idle {results['operator_rss_idle_mb']} MB, peak {results['operator_rss_peak_mb']} MB, "
          f"end {results['operator_rss_end_mb']} MB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    missing = sum(p["jobs"] - p["created"] for p in results["phases"])
    if missing:
        print(f"{missing} RLJobs got no PyTorchJob; see {workdir / 'operator.log'}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
