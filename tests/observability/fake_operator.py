"""The operator's REAL metrics module (rljob_operator.metrics) fed made-up work, for the observability
tests (the operator itself is not started there).

    python fake_operator.py

Prints ``PORT <n>`` once /metrics is served on 127.0.0.1, then until killed: a reconcile cycle every
0.1 s through ``metrics.record_cycle`` (every 5th one an ``error``), an API error every 7th cycle,
children created every 3rd; RLJob conditions via ``metrics.record_conditions``: Running True for
two jobs, Succeeded for one, Failed for one, Accepted for all four.
"""
from __future__ import annotations

import sys
import time

from prometheus_client import REGISTRY, start_http_server
from rljob_operator import metrics

JOBS = {"train-a": "Running", "train-b": "Running", "done": "Succeeded", "broken": "Failed"}
TYPES = ("Accepted", "Running", "Succeeded", "Failed", "Suspended")


def main() -> int:
    for name, true_type in JOBS.items():
        conditions = [{"type": t, "status": "True" if t in (true_type, "Accepted") else "False"} for t in TYPES]
        metrics.record_conditions("ml-ops", name, {"conditions": conditions})
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    print(f"PORT {server.server_port}", flush=True)
    i = 0
    while True:
        time.sleep(0.1)
        i += 1
        metrics.record_cycle("timer", "error" if i % 5 == 0 else "ok", 0.005 + 0.01 * (i % 7))
        if i % 7 == 0:
            metrics.record_api_error("patch", 409 if i % 2 else 500)
        if i % 3 == 0:
            metrics.record_created([{"kind": "PyTorchJob"}, {"kind": "ConfigMap"}])


if __name__ == "__main__":
    sys.exit(main())
