"""Worker -> RLJob.status: rank 0 patches the `rljob.dev/progress` annotation on its own RLJob.

The operator folds the annotation into `status.trainer` (see rljob_operator.progress for the
design and the narrowly scoped Role that allows it). Best effort: reports are rate-limited,
never raise, and a failing API server never slows training by more than the request timeout.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from rljob_operator.progress import encode_progress, patch_progress

log = logging.getLogger(__name__)


@dataclass
class StatusReporter:
    name: str
    namespace: str
    api_base: str | None  # None: in-cluster defaults (KUBERNETES_SERVICE_HOST, service-account token)
    enabled: bool
    min_interval_s: float = 5.0
    _last_sent: float = 0.0
    _warned: bool = False

    @classmethod
    def from_environ(cls, name: str, namespace: str) -> StatusReporter:
        """In a pod (KUBERNETES_SERVICE_HOST set) or with RLJOB_PROGRESS_API_URL (local e2e stand-in)."""
        api = os.environ.get("RLJOB_PROGRESS_API_URL") or None
        enabled = bool(api or os.environ.get("KUBERNETES_SERVICE_HOST")) and os.environ.get("RLJOB_PROGRESS") != "off"
        interval = float(os.environ.get("RLJOB_PROGRESS_INTERVAL_S", "5"))
        return cls(name, namespace, api, enabled, interval)

    def report(self, *, step: int, total_steps: int | None, reward_mean: float | None,
               val_reward_mean: float | None, last_checkpoint: dict[str, Any] | None, force: bool = False,
               nonfinite_rewards: int | None = None, quarantined: list[dict[str, Any]] | None = None,
               tracker_runs: list[dict[str, Any]] | None = None,
               val_pass_at_k: dict[str, float] | None = None) -> bool:

        if not self.enabled:
            return False
        now = time.monotonic()
        if not force and now - self._last_sent < self.min_interval_s:
            return False
        try:
            value = encode_progress(step, total_steps=total_steps, reward_mean=reward_mean,
                                    val_reward_mean=val_reward_mean, last_checkpoint=last_checkpoint,
                                    nonfinite_rewards=nonfinite_rewards, quarantined=quarantined,
                                    tracker_runs=tracker_runs,
                                    val_pass_at_k=val_pass_at_k)
            patch_progress(value, name=self.name, namespace=self.namespace, api_base=self.api_base, timeout=3.0)
        except Exception as exc:  # noqa: BLE001 - progress is best effort; training goes on
            if not self._warned:
                log.warning("cannot report progress to RLJob %s/%s (will keep trying): %s", self.namespace,
                            self.name, exc)
                self._warned = True
            return False
        self._last_sent = now
        return True
