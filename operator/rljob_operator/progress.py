"""Training progress from the worker to ``RLJob.status.trainer``: the annotation path.

Design
    Rank 0 of the worker merge-patches one annotation, ``rljob.dev/progress``, onto its OWN
    RLJob after each step (and after each committed checkpoint). The value is compact JSON::

        {"step": 12, "totalSteps": 900, "rewardMean": 0.41, "valRewardMean": 0.38,
         "lastCheckpoint": {"step": 10, "uri": "s3://b/p/ns/job/step_000010", "time": "..."},
         "time": "2026-11-26T04:15:04Z"}

    The operator watches RLJobs; when the annotation's ``time`` is newer than
    ``status.trainer.lastUpdatedTime`` it folds the annotation into ``status.trainer``
    (adding ``progressPercentage``) in the same level-based reconcile that writes the
    conditions. The operator stays the ONLY writer of ``status``.

    Permissions: the operator creates, per RLJob and owned by it, a ServiceAccount
    ``<job>-worker``, a Role ``<job>-progress`` granting ``get, patch`` on ``rljobs`` with
    ``resourceNames: [<job>]``, and a RoleBinding. (If ``podTemplate.serviceAccountName`` is set,
    the Role is bound to that account instead.) The pods use the account's projected token.

    Why not the alternatives: patching ``rljobs/status`` from the worker would make two writers
    of the conditions list and let a worker forge ``Succeeded``; writing to the PyTorchJob's
    annotations would need ``patch`` on ``pytorchjobs``, which lets a pod rewrite its own pod
    template. The grant chosen here lets a pod edit only its own RLJob, which the job's author
    controls anyway; a ValidatingAdmissionPolicy can narrow it to metadata-only edits (see README).

Worker side: ``encode_progress(...)`` builds the value; ``patch_progress(value, name=, namespace=)``
sends it with the in-cluster service-account token using only ``urllib`` (the worker image needs
no kubernetes client). Operator side: ``decode_progress(value)`` returns the camelCase
``status.trainer`` dict. Standard library only: the worker imports this module.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

ANNOTATION = "rljob.dev/progress"
MAX_VALUE_BYTES = 4096  # the annotation is tiny; refuse anything that is not

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ProgressError(ValueError):
    """A progress annotation that cannot be understood (the operator ignores it and logs why)."""


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _finite(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def encode_progress(
    step: int,
    *,
    total_steps: int | None = None,
    reward_mean: float | None = None,
    val_reward_mean: float | None = None,
    last_checkpoint: Mapping[str, Any] | None = None,
    time: str | None = None,
    nonfinite_rewards: int | None = None,
    quarantined: Any = None,
    tracker_runs: Any = None,
    val_pass_at_k: Mapping[str, float] | None = None,
) -> str:
    """The annotation value (compact JSON). `last_checkpoint` is {"step", "uri", "time"?}.

    Non-finite rewards (nan/inf) are dropped rather than sent. Raises ProgressError on bad input.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ProgressError(f"step must be a non-negative integer, got {step!r}")
    doc: dict[str, Any] = {"step": step}
    if total_steps is not None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ProgressError(f"total_steps must be a positive integer, got {total_steps!r}")
        doc["totalSteps"] = total_steps
    for key, value in (("rewardMean", reward_mean), ("valRewardMean", val_reward_mean)):
        value = _finite(value, key)
        if value is not None:
            doc[key] = round(value, 6)
    if val_pass_at_k:
        doc["valPassAtK"] = {k: round(v, 6) for k, v in _pass_at_k(val_pass_at_k).items()}
    if nonfinite_rewards:
        doc["nonfiniteRewards"] = _count(nonfinite_rewards, "nonfiniteRewards")
    if last_checkpoint is not None:
        doc["lastCheckpoint"] = _checkpoint(last_checkpoint)
    if tracker_runs:
        doc["trackerRuns"] = _tracker_runs(tracker_runs)
    doc["time"] = time or utc_now()
    text = _dumps(doc)
    if len(text.encode()) > MAX_VALUE_BYTES:
        raise ProgressError(f"progress annotation is {len(text.encode())} bytes; the limit is {MAX_VALUE_BYTES}")
    if quarantined:
        text = _with_quarantined(doc, _quarantined(quarantined, limit=None))
    return text


def _dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), sort_keys=False)


def _with_quarantined(doc: dict[str, Any], entries: list[dict[str, Any]]) -> str:
    """`doc` plus the newest quarantined entries that fit the cap (at most MAX_QUARANTINED) and a
    count of the rest. The list gives way, never the step: long URIs or many entries only shorten it."""
    head = {k: v for k, v in doc.items() if k != "time"}
    for keep in range(min(len(entries), MAX_QUARANTINED), -1, -1):
        trial = dict(head)
        if keep:
            trial["quarantinedCheckpoints"] = entries[-keep:]
        if keep < len(entries):
            trial["quarantinedCheckpointsOmitted"] = len(entries) - keep
        trial["time"] = doc["time"]
        text = _dumps(trial)
        if len(text.encode()) <= MAX_VALUE_BYTES:
            return text
    return _dumps(doc)


_PASS_AT_K_KEY = re.compile(r"^(pass|mean)@[0-9]{1,3}$")
MAX_PASS_AT_K = 16


def _pass_at_k(raw: Any) -> dict[str, float]:
    """{pass@k | mean@n: finite number}, at most MAX_PASS_AT_K entries."""
    if not isinstance(raw, Mapping) or len(raw) > MAX_PASS_AT_K:
        raise ProgressError(f"valPassAtK must be an object of at most {MAX_PASS_AT_K} entries")
    out = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not _PASS_AT_K_KEY.match(key):
            raise ProgressError(f"valPassAtK key {key!r} is not pass@k or mean@n")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProgressError(f"valPassAtK[{key}] must be a finite number, got {value!r}")
        out[key] = float(value)
    return out


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProgressError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _checkpoint(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ProgressError(f"lastCheckpoint must be an object, got {type(raw).__name__}")
    step, uri = raw.get("step"), raw.get("uri")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ProgressError(f"lastCheckpoint.step must be a non-negative integer, got {step!r}")
    if not isinstance(uri, str) or not uri:
        raise ProgressError(f"lastCheckpoint.uri must be a non-empty string, got {uri!r}")
    out: dict[str, Any] = {"step": step, "uri": uri}
    if raw.get("time") is not None:
        if not isinstance(raw["time"], str):
            raise ProgressError("lastCheckpoint.time must be an RFC 3339 string")
        out["time"] = raw["time"]
    return out


MAX_QUARANTINED = 8  # newest kept; keeps the annotation small


def _quarantined(raw: Any, limit: int | None = MAX_QUARANTINED) -> list[dict[str, Any]]:
    """Checkpoint steps the worker moved to quarantine/: [{"step", "uri", "reason"?}], newest last;
    the newest `limit` of them (all with None)."""
    if not isinstance(raw, (list, tuple)):
        raise ProgressError(f"quarantinedCheckpoints must be a list, got {type(raw).__name__}")
    out = []
    for item in list(raw)[-limit if limit else 0:]:
        entry = _checkpoint({"step": item.get("step"), "uri": item.get("uri")} if isinstance(item, Mapping) else item)
        reason = item.get("reason")
        if reason:
            if not isinstance(reason, str):
                raise ProgressError("quarantinedCheckpoints[].reason must be a string")
            entry["reason"] = reason[:200]
        out.append(entry)
    return out


TRACKERS = ("mlflow", "wandb")


def _tracker_runs(raw: Any) -> list[dict[str, Any]]:
    """The experiment-tracker runs: [{"tracker", "runId", "url"?}], one per tracker."""
    if not isinstance(raw, (list, tuple)):
        raise ProgressError(f"trackerRuns must be a list, got {type(raw).__name__}")
    out = []
    for item in list(raw)[:len(TRACKERS)]:
        if not isinstance(item, Mapping) or item.get("tracker") not in TRACKERS:
            raise ProgressError(f"trackerRuns[].tracker must be one of {', '.join(TRACKERS)}")
        run_id, url = item.get("runId"), item.get("url")
        if not isinstance(run_id, str) or not run_id or len(run_id) > 128:
            raise ProgressError("trackerRuns[].runId must be a non-empty string of at most 128 characters")
        entry = {"tracker": item["tracker"], "runId": run_id}
        if url is not None:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 1024:
                raise ProgressError("trackerRuns[].url must be an http(s) URL of at most 1024 characters")
            entry["url"] = url
        out.append(entry)
    return out


def decode_progress(value: str) -> dict[str, Any]:
    """The annotation value as a camelCase `status.trainer` dict, with progressPercentage and
    lastUpdatedTime. Raises ProgressError on anything malformed."""
    if not isinstance(value, str) or len(value.encode()) > MAX_VALUE_BYTES:
        raise ProgressError("progress annotation is missing or too large")
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise ProgressError(f"progress annotation is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProgressError("progress annotation must be a JSON object")
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ProgressError(f"step must be a non-negative integer, got {step!r}")
    time = doc.get("time")
    if not isinstance(time, str) or not time:
        raise ProgressError("time (RFC 3339) is required")
    trainer: dict[str, Any] = {"step": step}
    total = doc.get("totalSteps")
    if total is not None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ProgressError(f"totalSteps must be a positive integer, got {total!r}")
        trainer["totalSteps"] = total
        trainer["progressPercentage"] = max(0, min(100, (step * 100) // total))
    for key in ("rewardMean", "valRewardMean"):
        v = doc.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ProgressError(f"{key} must be a finite number, got {v!r}")
        trainer[key] = float(v)
    if doc.get("valPassAtK"):
        trainer["valPassAtK"] = _pass_at_k(doc["valPassAtK"])
    if doc.get("nonfiniteRewards") is not None:
        trainer["nonfiniteRewards"] = _count(doc["nonfiniteRewards"], "nonfiniteRewards")
    if doc.get("lastCheckpoint") is not None:
        trainer["lastCheckpoint"] = _checkpoint(doc["lastCheckpoint"])
    if doc.get("quarantinedCheckpoints"):
        trainer["quarantinedCheckpoints"] = _quarantined(doc["quarantinedCheckpoints"])
    if doc.get("quarantinedCheckpointsOmitted"):
        trainer["quarantinedCheckpointsOmitted"] = _count(doc["quarantinedCheckpointsOmitted"],
                                                          "quarantinedCheckpointsOmitted")
    if doc.get("trackerRuns"):
        trainer["trackerRuns"] = _tracker_runs(doc["trackerRuns"])
    trainer["lastUpdatedTime"] = time
    return trainer


def is_newer(value: str | None, status_trainer: Mapping[str, Any] | None) -> bool:
    """Whether the annotation carries a report the status does not have yet (cheap; no full decode)."""
    if not value:
        return False
    try:
        doc = json.loads(value)
    except ValueError:
        return False
    seen = (status_trainer or {}).get("lastUpdatedTime")
    stamp = doc.get("time") if isinstance(doc, dict) else None
    if not isinstance(stamp, str):
        return False
    if seen is None:
        return True
    return stamp != seen or (status_trainer or {}).get("step") != doc.get("step")


def patch_progress(
    value: str,
    *,
    name: str,
    namespace: str,
    api_base: str | None = None,
    token: str | None = None,
    ca_file: str | None = None,
    timeout: float = 5.0,
) -> None:
    """Merge-patch the progress annotation onto RLJob `namespace/name` with the pod's own token.

    Defaults come from the in-cluster environment (KUBERNETES_SERVICE_HOST/PORT and the mounted
    service-account token and CA). Raises urllib.error.URLError / HTTPError on failure; callers
    treat progress reporting as best effort (a failed report never stops training).
    """
    if api_base is None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a cluster: KUBERNETES_SERVICE_HOST is unset and no api_base was given")
        api_base = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
    if token is None:
        token_path = os.path.join(SA_DIR, "token")
        if os.path.exists(token_path):
            with open(token_path) as fh:
                token = fh.read().strip()
    if ca_file is None and os.path.exists(os.path.join(SA_DIR, "ca.crt")):
        ca_file = os.path.join(SA_DIR, "ca.crt")
    url = (f"{api_base.rstrip('/')}/apis/rljob.dev/v1alpha1/namespaces/"
           f"{urllib.parse.quote(namespace, safe='')}/rljobs/{urllib.parse.quote(name, safe='')}")
    body = json.dumps({"metadata": {"annotations": {ANNOTATION: value}}}).encode()
    headers = {"Content-Type": "application/merge-patch+json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, method="PATCH", headers=headers)
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # the API server is never proxied
    if url.startswith("https://"):
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca_file)))
    with urllib.request.build_opener(*handlers).open(request, timeout=timeout) as response:
        response.read()
