"""``python -m rljob_worker ARGS`` for test_worker_run.py, with one change: TrainerTelemetry.close()
waits a few seconds before it stops serving /metrics, so that Prometheus (scraping every second)
always sees the final state of a run, which otherwise may end between two scrapes.

    python linger_worker.py --spec SPEC.json
"""
from __future__ import annotations

import os
import runpy
import sys
import time

from rljob_worker.telemetry import trainer_metrics as telemetry

LINGER_S = float(os.environ.get("RLJOB_TEST_METRICS_LINGER_S", "2.5"))
_close = telemetry.TrainerTelemetry.close


def _close_after_linger(self: telemetry.TrainerTelemetry) -> None:
    time.sleep(LINGER_S)
    _close(self)


telemetry.TrainerTelemetry.close = _close_after_linger
sys.argv = ["rljob_worker", *sys.argv[1:]]
runpy.run_module("rljob_worker", run_name="__main__", alter_sys=True)
