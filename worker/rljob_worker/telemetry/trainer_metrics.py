"""Trainer telemetry: Prometheus metrics on ``/metrics`` and, optionally, TensorBoard scalars.

This is the only worker module that imports ``prometheus_client`` (STYLE.md habit 12). The trainer
talks to one :class:`TrainerTelemetry` object and never to prometheus-client itself::

    tel = TrainerTelemetry(job="gsm8k", namespace="ml", rank=0, model="Qwen/Qwen2.5-0.5B",
                           algorithm="grpo", nnodes=1, save_freq=30)
    tel.serve(spec.metrics.port)            # one serving process per pod (a port binds once)
    tel.set_total_steps(total)
    for step in ...:
        with tel.stage("rollout"):
            ...                             # call tel.heartbeat() inside long loops
        ...
        tel.record_step(step, metrics, step_seconds)
    tel.close()

Conventions (``docs/metrics.md`` lists every metric):

- every name starts with ``rljob_``; every series carries exactly the labels ``rljob`` (the RLJob
  name), ``namespace`` and ``rank`` (global rank, as a string), plus ``stage`` or ``key`` where
  stated. ``job`` and ``instance`` are never used as label names: Prometheus owns them.
- gauges hold the last value of a scalar, histograms (``rljob_stage_seconds``,
  ``rljob_step_seconds``) hold durations with buckets from 10 ms to 1 h; a gauge appears only once
  it has a value, so a dashboard never shows a made-up 0 reward before the first step.
- non-finite values (NaN, inf) are exported as they are: the alert rules look for them.
- ``record_step`` keys the trainer produces are mapped to named gauges (:data:`STEP_GAUGES`); any
  other key is exported generically as ``rljob_trainer_metric{key="<the key>"}`` (at most
  :data:`MAX_EXTRA_KEYS` distinct keys, so a bug cannot explode the series count).
- the heartbeat (``rljob_heartbeat_timestamp_seconds``) is set at construction, on entering and
  leaving every stage, on every recorded step and by :meth:`TrainerTelemetry.heartbeat`. No
  background thread sets it: a hung training loop must look hung.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Self

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

log = logging.getLogger(__name__)

#: Label names carried by every series. Never ``job`` or ``instance``: Prometheus sets those
#: itself and would rename ours to ``exported_job``/``exported_instance``.
LABELS: tuple[str, ...] = ("rljob", "namespace", "rank")

#: The trainer's stages, in loop order. Other names are recorded too (with a one-time warning).
STAGES: tuple[str, ...] = (
    "rollout",
    "reward",
    "old_logprob",
    "ref_logprob",
    "critic_values",
    "critic_update",
    "actor_update",
    "weight_sync",
    "actor_offload",
    "checkpoint",
    "validation",
)

#: Histogram buckets (seconds) for stage and step durations: 10 ms to 1 h, roughly 1-2.5-5 steps.
DURATION_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
    120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
)

#: ``record_step`` key -> (gauge name, help). The keys are the trainer's metric names.
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "reward/mean": ("rljob_reward_mean", "Mean sequence reward of the last step's rollout batch."),
    "lora/adapter_norm": (
        "rljob_lora_adapter_norm", ("Frobenius norm of the LoRA deltas (alpha/rank) B A over the whole model: "
                                    "how far the policy is from its base.")),
    "lora/update_norm": (
        "rljob_lora_update_norm", "Norm of the change of the LoRA adapter parameters in the last step's updates."),
    "reward/std": ("rljob_reward_std", "Standard deviation of sequence rewards in the last step's batch."),
    "reward/min": ("rljob_reward_min", "Smallest sequence reward in the last step's batch."),
    "reward/max": ("rljob_reward_max", "Largest sequence reward in the last step's batch."),
    "reward/nonfinite_count": (
        "rljob_reward_nonfinite", "Samples of the last step's batch whose reward was NaN or +-Inf (scored 0)."),
    "actor/skipped": (
        "rljob_actor_update_skipped", "1 when the last step's optimizer update was skipped (non-finite gradients)."),
    "response_length/mean": (
        "rljob_response_length_mean_tokens", "Mean response length (tokens) of the last step's batch."),
    "response_length/max": (
        "rljob_response_length_max_tokens", "Longest response (tokens) of the last step's batch."),
    "response_length/clip_ratio": (
        "rljob_response_clip_ratio",
        "Fraction of the last step's responses truncated at the maximum response length (0..1)."),
    "actor/kl": ("rljob_actor_kl", "Mean KL divergence of the policy from the reference model (last step)."),
    "actor/entropy": ("rljob_actor_entropy", "Mean token entropy of the policy (nats, last step)."),
    "actor/clip_fraction": (
        "rljob_actor_clip_fraction", "Fraction of tokens whose importance ratio was clipped (last step)."),
    "actor/grad_norm": ("rljob_actor_grad_norm", "Gradient norm before clipping (last step)."),
    "actor/lr": ("rljob_actor_learning_rate", "Learning rate of the actor optimizer (last step)."),
    "actor/pg_loss": ("rljob_actor_pg_loss", "Policy-gradient loss (last step)."),
    "critic/value_loss": ("rljob_critic_value_loss", "Clipped value loss of the critic (PPO, last step)."),
    "critic/explained_variance": (
        "rljob_critic_explained_variance",
        "1 - Var(returns - values) / Var(returns) over the last batch's response tokens (1: perfect critic)."),
    "critic/value_clip_fraction": (
        "rljob_critic_value_clip_fraction", "Fraction of tokens whose clipped value error counted (last step)."),
    "critic/vpred_mean": ("rljob_critic_vpred_mean", "Mean predicted value over response tokens (last step)."),
    "critic/grad_norm": ("rljob_critic_grad_norm", "Critic gradient norm before clipping (last step)."),
    "critic/lr": ("rljob_critic_learning_rate", "Learning rate of the critic optimizer (last step)."),
    "critic/update_s": (
        "rljob_critic_update_seconds",
        "Wall time of the last critic update (with split placement it overlaps the actor update)."),
    "throughput/rollout_tokens_per_s": (
        "rljob_rollout_tokens_per_second", "Generated tokens per second during the last rollout stage."),
    "throughput/train_tokens_per_s": (
        "rljob_train_tokens_per_second", "Tokens per second processed by the last actor update."),
    "perf/mfu": ("rljob_mfu_ratio", "Model FLOPs utilisation of the last actor update (0..1)."),
    "rollout/logprob_mismatch_mean": (
        "rljob_rollout_logprob_mismatch_mean",
        "Mean |log p_rollout - log p_trainer| per token of the last batch (engine/trainer drift)."),
    "rollout/logprob_mismatch_frac": (
        "rljob_rollout_logprob_mismatch_fraction",
        "Fraction of tokens whose rollout and trainer log-probs differ beyond tolerance (last batch)."),
    "rollout/correction_weight_mean": (
        "rljob_rollout_correction_weight_mean",
        "Mean rollout-correction weight of the policy gradient per response token (1 when off or on-policy)."),
    "rollout/correction_clipped_frac": (
        "rljob_rollout_correction_clipped_fraction",
        "Fraction of response tokens whose ratio pi_train / pi_rollout exceeds algorithm.rolloutCorrection.threshold."),
    "rollout/correction_masked_frac": (
        "rljob_rollout_correction_masked_fraction",
        "Fraction of responses whose sequence ratio leaves [1/threshold, threshold] (masked with sequenceMasking)."),
    # a separate rollout pool (rollout.placement: separate)
    "rollout/staleness_max": (
        "rljob_rollout_staleness_max_versions",
        "Policy versions between the trainer and the oldest sample of the last batch (<= rollout.maxStaleness)."),
    "rollout/staleness_mean": (
        "rljob_rollout_staleness_mean_versions", "Mean policy versions between the trainer and the last batch's samples."),
    "rollout/buffer_depth": (
        "rljob_rollout_buffer_depth_batches", "Batches the rollout pool holds or generates ahead of the trainer."),
    "rollout/dropped_stale_samples": (
        "rljob_rollout_dropped_stale_samples",
        "Samples of the last step dropped for being older than rollout.maxStaleness (generated again)."),
    "timing/trainer_idle_s": (
        "rljob_trainer_idle_seconds", "Seconds the trainer waited for the rollout pool in the last step."),
    "timing/rollout_idle_s": (
        "rljob_rollout_idle_seconds", "Seconds the rollout pool waited for requests before the last step's batches."),
}

#: ``record_validation`` key -> (gauge name, help).
VALIDATION_GAUGES: dict[str, tuple[str, str]] = {
    "val/reward_mean": ("rljob_validation_reward_mean", "Mean reward on the validation set (last validation)."),
    "val/accuracy": ("rljob_validation_accuracy", "Accuracy on the validation set (last validation, 0..1)."),
}

#: At most this many distinct unknown keys are exported as ``rljob_trainer_metric{key}``.
MAX_EXTRA_KEYS = 64

#: Steps averaged for the step-time part of ``rljob_checkpoint_interval_seconds_estimate``.
_STEP_WINDOW = 20

_STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


def _default_registry() -> CollectorRegistry:
    """A fresh registry with the process, platform and GC collectors (RSS, CPU, Python version)."""
    reg = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg


def _as_float(value: Any) -> float | None:
    """``float(value)`` for numbers and 0-d tensors; None for what cannot be converted."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


class TrainerTelemetry:
    """Metrics of one trainer process. Thread-safe; every method is cheap (no I/O but TensorBoard).

    ``job``, ``namespace`` and ``rank`` become the labels ``rljob``, ``namespace`` and ``rank`` of
    every series; ``model``, ``algorithm`` and ``nnodes`` go into ``rljob_job_info``.
    ``save_freq`` (the spec's ``checkpoint.saveFreq``; None or <= 0 when unknown or end-only) feeds
    ``rljob_checkpoint_interval_seconds_estimate``, which the checkpoint-overdue alert compares
    with the age of the last checkpoint. ``tensorboard_dir`` also writes TensorBoard scalars there
    (give it on one rank only); without the ``tensorboard`` package that is a warning, not an error.
    ``registry`` defaults to a fresh one (with process metrics), so several instances can coexist.
    """

    def __init__(
        self,
        *,
        job: str,
        namespace: str,
        rank: int,
        model: str,
        algorithm: str,
        nnodes: int,
        registry: CollectorRegistry | None = None,
        save_freq: int | None = None,
        tensorboard_dir: str | None = None,
    ) -> None:
        if not job:
            raise ValueError("job (the RLJob name) must not be empty")
        if int(rank) < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if int(nnodes) < 1:
            raise ValueError(f"nnodes must be >= 1, got {nnodes}")
        self.registry = registry if registry is not None else _default_registry()
        self._base = {"rljob": str(job), "namespace": str(namespace), "rank": str(int(rank))}
        self._lock = threading.Lock()
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._closed = False
        self._warned_stages: set[str] = set()
        self._warned_values: set[str] = set()
        self._extra_dropped_warned = False
        self._step_durations: collections.deque[float] = collections.deque(maxlen=_STEP_WINDOW)
        self._checkpoint_times: collections.deque[float] = collections.deque(maxlen=_STEP_WINDOW)
        self._pending_stage_seconds: dict[str, float] = collections.defaultdict(float)
        # set by the run loop for a process's first step: seconds spent compiling so far, so each stage also
        # counts what it compiled (stage_compile_seconds; nested stages count in both, as their seconds do)
        self.compile_clock: Callable[[], float] | None = None
        self.stage_compile_seconds: dict[str, float] = collections.defaultdict(float)
        self._stage_peaks = _cuda_stage_peaks()  # None without CUDA
        self._save_freq = int(save_freq) if save_freq is not None and int(save_freq) > 0 else None

        reg, lab = self.registry, list(LABELS)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, lab + list(extra), registry=reg)

        # Identity and progress.
        Info("rljob_job", "Static facts about the run (value 1): model, algorithm, nnodes.", lab,
             registry=reg).labels(**self._base).info(
            {"model": str(model), "algorithm": str(algorithm), "nnodes": str(int(nnodes))})
        gauge("rljob_nodes", "Number of nodes (pods) of the run (spec.nnodes).").labels(**self._base).set(
            int(nnodes))
        gauge("rljob_start_timestamp_seconds", "Unix time this trainer process started.").labels(
            **self._base).set_to_current_time()
        self._heartbeat = gauge(
            "rljob_heartbeat_timestamp_seconds",
            "Unix time the training loop last showed progress (stage boundaries, steps, explicit heartbeats).",
        ).labels(**self._base)
        # Children of these are created on the first value (a 0 before that would be a lie).
        self._step = gauge("rljob_step", "Last completed training step (global, survives resume).")
        self._total_steps = gauge("rljob_total_steps", "Total training steps planned for the run.")
        self._steps = Counter("rljob_steps", "Training steps completed by this process (resets on restart).",
                              lab, registry=reg).labels(**self._base)

        # Durations.
        self._step_hist = Histogram("rljob_step_seconds", "Wall time of whole training steps.", lab,
                                    buckets=DURATION_BUCKETS, registry=reg).labels(**self._base)
        self._step_last = gauge("rljob_step_last_seconds", "Wall time of the last training step.").labels(
            **self._base)
        self._stage_hist = Histogram("rljob_stage_seconds", "Wall time of trainer stages, by stage.",
                                     lab + ["stage"], buckets=DURATION_BUCKETS, registry=reg)
        self._stage_last = gauge("rljob_stage_last_seconds", "Wall time of the last run of each stage.",
                                 ("stage",))
        self._stage_active = gauge("rljob_stage_active",
                                   "1 while the trainer is inside the stage, else 0.", ("stage",))

        # Step and validation scalars (created on first value, see _set_scalar).
        self._scalar_gauges: dict[str, Gauge] = {
            name: gauge(name, doc) for name, doc in (*STEP_GAUGES.values(), *VALIDATION_GAUGES.values())
        }
        self._extra = gauge("rljob_trainer_metric",
                            "Trainer scalars without a dedicated metric, by their trainer key (last value).",
                            ("key",))
        self._extra_keys: set[str] = set()
        self._val_step = gauge("rljob_validation_step", "Step of the last validation.")

        # Checkpoints.
        self._ckpt_step = gauge("rljob_last_checkpoint_step", "Step of the last committed checkpoint.")
        self._ckpt_time = gauge("rljob_last_checkpoint_timestamp_seconds",
                                "Unix time the last checkpoint was committed.")
        self._ckpts = Counter("rljob_checkpoints", "Checkpoints committed by this process.", lab,
                              registry=reg).labels(**self._base)
        # Tool calls of multi-turn rollouts (spec.tools), by tool and outcome (ok, timeout, error, ...).
        self._tool_calls = Counter("rljob_tool_calls", "Tool calls of multi-turn rollouts, by tool and outcome.",
                                   lab + ["tool", "outcome"], registry=reg)
        self._save_freq_gauge = gauge("rljob_checkpoint_save_freq_steps",
                                      "Checkpoint save frequency in steps (spec.checkpoint.saveFreq).")
        self._ckpt_interval = gauge(
            "rljob_checkpoint_interval_seconds_estimate",
            "Expected seconds between checkpoints: saveFreq x mean recent step time, or else the mean "
            "observed interval between checkpoints.",
        )
        if self._save_freq is not None:
            self._save_freq_gauge.labels(**self._base).set(self._save_freq)

        # Experiment trackers (telemetry.trackers): calls that failed, records given up on.
        self._tracker_errors = Counter(
            "rljob_tracker_errors", "Failed experiment-tracker calls (MLflow, W&B), by tracker; training goes on.",
            lab + ["tracker"], registry=reg)
        self._tracker_dropped = Counter(
            "rljob_tracker_dropped", "Records (a step's metrics, a table) never delivered to an experiment tracker: "
            "its queue was full, or the run ended before the tracker came back.", lab + ["tracker"], registry=reg)
        # Remote rewards (record_remote_reward), by route: "*" (spec.reward) or the data source of bySource.
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lab + ["route"], registry=reg)

        self._remote = {
            "requests": counter("rljob_reward_remote_requests", "HTTP requests sent to a remote reward, retries included."),
            "retries": counter("rljob_reward_remote_retries", "Retried requests to a remote reward (errors, timeouts, "
                               "HTTP 408/429/5xx, malformed answers)."),
            "failures": counter("rljob_reward_remote_failures", "Samples a remote reward could not score after every "
                                "retry (onFailure then applied)."),
            "zeroed": counter("rljob_reward_remote_zeroed", "Failed remote samples scored 0 (onFailure zero)."),
            "dropped": counter("rljob_reward_remote_dropped", "Failed remote samples whose group was dropped from the "
                               "gradient (onFailure drop-group)."),
        }
        self._remote_seconds = Histogram("rljob_reward_remote_seconds",
                                         "Wall time of scoring one batch at a remote reward, by route.",
                                         lab + ["route"], buckets=DURATION_BUCKETS, registry=reg)

        # GPU memory (record_gpu_memory / set_gpu_memory).
        self._gpu = {
            "allocated": gauge("rljob_gpu_memory_allocated_bytes",
                               "GPU memory held by tensors of this process (torch.cuda.memory_allocated)."),
            "reserved": gauge("rljob_gpu_memory_reserved_bytes",
                              "GPU memory reserved by PyTorch's caching allocator (torch.cuda.memory_reserved)."),
            "max_allocated": gauge("rljob_gpu_memory_max_allocated_bytes",
                                   "Peak GPU memory held by tensors since start (torch.cuda.max_memory_allocated)."),
            "total": gauge("rljob_gpu_memory_total_bytes", "Total memory of this process's GPU."),
        }

        self._tb = self._open_tensorboard(tensorboard_dir) if tensorboard_dir else None
        self.heartbeat()

    # ------------------------------------------------------------------ serving and lifecycle
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` over HTTP from a daemon thread; return the bound port (0 picks a free one)."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"metrics already served on port {self._server.server_port}")
            try:
                server, thread = start_http_server(int(port), addr=addr, registry=self.registry)
            except OSError as e:
                from rljob_worker.startup_errors import StartupError

                raise StartupError(
                    f"spec.metrics.port {port}: cannot serve metrics there ({e.strerror}); another process (an "
                    "earlier run?) holds it: stop it, or choose another port") from None
            self._server, self._server_thread = server, thread
        bound = int(server.server_port)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        """Stop the HTTP server and flush/close TensorBoard. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, self._server = self._server, None
            tb, self._tb = self._tb, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if tb is not None:
            tb.flush()
            tb.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ progress
    def heartbeat(self) -> None:
        """Mark the training loop alive now. Call it inside long stages (every micro-batch is fine)."""
        self._heartbeat.set_to_current_time()

    def set_total_steps(self, total: int) -> None:
        self._total_steps.labels(**self._base).set(int(total))

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage: observe ``rljob_stage_seconds{stage=name}``, keep the last value, heartbeat.

        Stages may nest (e.g. a rollout inside ``validation``); each is timed on its own, so nested
        time counts in both. The time is recorded even when the body raises.
        """
        self._check_stage_name(name)
        labels = {**self._base, "stage": name}
        active = self._stage_active.labels(**labels)
        self.heartbeat()
        active.inc()
        if self._stage_peaks is not None:
            self._stage_peaks.enter()
        clock = self.compile_clock
        compiled_before = clock() if clock is not None else 0.0
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            if clock is not None:
                self.stage_compile_seconds[name] += clock() - compiled_before
            if self._stage_peaks is not None:
                self._stage_peaks.exit(name)
            active.dec()
            self._stage_hist.labels(**labels).observe(seconds)
            self._stage_last.labels(**labels).set(seconds)
            with self._lock:
                self._pending_stage_seconds[name] += seconds
            self.heartbeat()

    def record_stage(self, name: str, seconds: float) -> None:
        """A stage timed elsewhere (the critic pool of a split placement) recorded as if timed here."""
        self._check_stage_name(name)
        labels = {**self._base, "stage": name}
        self._stage_hist.labels(**labels).observe(float(seconds))
        self._stage_last.labels(**labels).set(float(seconds))
        with self._lock:
            self._pending_stage_seconds[name] += float(seconds)

    def pending_stage_peak_bytes(self) -> dict[str, int]:
        """Peak GPU memory allocated (bytes) per stage since the last :meth:`record_step`; {} without CUDA."""
        if self._stage_peaks is None:
            return {}
        with self._lock:
            return dict(self._stage_peaks.pending)

    def pending_stage_seconds(self) -> dict[str, float]:
        """Seconds per stage since the last :meth:`record_step` (the current step's breakdown)."""
        with self._lock:
            return dict(self._pending_stage_seconds)

    def record_step(self, step: int, metrics: Mapping[str, Any], step_seconds: float) -> None:
        """Record a finished step: its number, wall time and the trainer's metrics dict."""
        step_seconds = float(step_seconds)
        self._step.labels(**self._base).set(int(step))
        self._steps.inc()
        self._step_hist.observe(step_seconds)
        self._step_last.set(step_seconds)
        scalars = self._set_scalars(metrics, STEP_GAUGES)
        with self._lock:
            if math.isfinite(step_seconds) and step_seconds >= 0:
                self._step_durations.append(step_seconds)
            stage_seconds, self._pending_stage_seconds = self._pending_stage_seconds, collections.defaultdict(float)
            if self._stage_peaks is not None:
                self._stage_peaks.pending = {}
        self._update_checkpoint_estimate()
        self.heartbeat()
        if self._tb is not None:
            scalars["timing/step_seconds"] = step_seconds
            scalars.update({f"timing/{stage}_seconds": s for stage, s in stage_seconds.items()})
            self._write_tensorboard(int(step), scalars)

    def record_validation(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record a validation pass (``val/reward_mean``, ``val/accuracy``; other keys generically)."""
        self._val_step.labels(**self._base).set(int(step))
        scalars = self._set_scalars(metrics, VALIDATION_GAUGES)
        self.heartbeat()
        if self._tb is not None:
            self._write_tensorboard(int(step), scalars)

    def record_checkpoint(self, step: int, unix_time: float) -> None:
        """Record a committed checkpoint (call after its COMMIT marker is written)."""
        self._ckpt_step.labels(**self._base).set(int(step))
        self._ckpt_time.labels(**self._base).set(float(unix_time))
        self._ckpts.inc()
        with self._lock:
            self._checkpoint_times.append(float(unix_time))
        self._update_checkpoint_estimate()
        self.heartbeat()

    def record_tool_calls(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Add a rollout's tool calls, {(tool, outcome): count}, to rljob_tool_calls_total."""
        for (tool, outcome), count in counts.items():
            self._tool_calls.labels(**self._base, tool=str(tool), outcome=str(outcome)).inc(int(count))

    # ------------------------------------------------------------------ experiment trackers
    def record_tracker_error(self, tracker: str) -> None:
        """One failed call to an experiment tracker (``tracker``: mlflow or wandb)."""
        self._tracker_errors.labels(**self._base, tracker=tracker).inc()

    def record_tracker_dropped(self, tracker: str, records: int = 1) -> None:
        """Records the tracker will never get (queue full, or undelivered at the end)."""
        self._tracker_dropped.labels(**self._base, tracker=tracker).inc(records)

    def record_remote_reward(self, route: str, *, requests: int, retries: int, failures: int, zeroed: int,
                             dropped: int, seconds: float) -> None:
        """Count one scoring call at a remote reward (``route``: ``*`` for spec.reward, else the data source)."""
        for key, value in (("requests", requests), ("retries", retries), ("failures", failures),
                           ("zeroed", zeroed), ("dropped", dropped)):
            self._remote[key].labels(**self._base, route=str(route)).inc(int(value))
        self._remote_seconds.labels(**self._base, route=str(route)).observe(float(seconds))

    # ------------------------------------------------------------------ GPU memory
    def record_gpu_memory(self) -> None:
        """Export this process's CUDA memory (allocated, reserved, peak, device total); no-op without CUDA."""
        try:
            import torch  # lazily: the metrics module must not need torch to load
        except ImportError:
            return
        if not torch.cuda.is_available():
            return
        device = torch.cuda.current_device()
        _free, total = torch.cuda.mem_get_info(device)
        self.set_gpu_memory(
            allocated_bytes=torch.cuda.memory_allocated(device),
            reserved_bytes=torch.cuda.memory_reserved(device),
            max_allocated_bytes=max(torch.cuda.max_memory_allocated(device),
                                    self._stage_peaks.since_start if self._stage_peaks is not None else 0),
            total_bytes=total,
        )

    def set_gpu_memory(
        self,
        *,
        allocated_bytes: float,
        reserved_bytes: float,
        max_allocated_bytes: float | None = None,
        total_bytes: float | None = None,
    ) -> None:
        """Set the GPU memory gauges from given numbers (what record_gpu_memory reads from torch)."""
        self._gpu["allocated"].labels(**self._base).set(float(allocated_bytes))
        self._gpu["reserved"].labels(**self._base).set(float(reserved_bytes))
        if max_allocated_bytes is not None:
            self._gpu["max_allocated"].labels(**self._base).set(float(max_allocated_bytes))
        if total_bytes is not None:
            self._gpu["total"].labels(**self._base).set(float(total_bytes))

    # ------------------------------------------------------------------ internals
    def _check_stage_name(self, name: str) -> None:
        if not isinstance(name, str) or not _STAGE_NAME.match(name):
            raise ValueError(f"stage name must match {_STAGE_NAME.pattern}, got {name!r}")
        if name not in STAGES and name not in self._warned_stages:
            self._warned_stages.add(name)
            log.warning("stage %r is not one of the standard stages %s; recording it anyway", name, STAGES)

    def _set_scalars(self, metrics: Mapping[str, Any], known: Mapping[str, tuple[str, str]]) -> dict[str, float]:
        """Set a gauge per key (named, else generic); return the float values (for TensorBoard)."""
        out: dict[str, float] = {}
        for key, raw in metrics.items():
            value = _as_float(raw)
            if value is None:
                if key not in self._warned_values:
                    self._warned_values.add(key)
                    log.warning("metric %r has a non-numeric value of type %s; not exported", key,
                                type(raw).__name__)
                continue
            out[key] = value
            if key in known:
                self._scalar_gauges[known[key][0]].labels(**self._base).set(value)
            else:
                self._set_extra(str(key), value)
        return out

    def _set_extra(self, key: str, value: float) -> None:
        with self._lock:
            if key not in self._extra_keys:
                if len(self._extra_keys) >= MAX_EXTRA_KEYS:
                    if not self._extra_dropped_warned:
                        self._extra_dropped_warned = True
                        log.warning("more than %d distinct extra metric keys; %r and later new keys are "
                                    "not exported", MAX_EXTRA_KEYS, key)
                    return
                self._extra_keys.add(key)
        self._extra.labels(**self._base, key=key).set(value)

    def _update_checkpoint_estimate(self) -> None:
        with self._lock:
            estimate = None
            if self._save_freq is not None and self._step_durations:
                estimate = self._save_freq * (sum(self._step_durations) / len(self._step_durations))
            elif len(self._checkpoint_times) >= 2:
                times = list(self._checkpoint_times)
                gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
                estimate = sum(gaps) / len(gaps) if gaps else None
        if estimate is not None:
            self._ckpt_interval.labels(**self._base).set(estimate)

    def _open_tensorboard(self, log_dir: str) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # noqa: BLE001  (ImportError mostly; any failure only disables TensorBoard)
            msg = (f"TensorBoard scalars are off: metrics.tensorboardDir={log_dir!r} is set but "
                   f"torch.utils.tensorboard cannot be imported ({e}); install the 'tensorboard' package")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return None
        return SummaryWriter(log_dir=log_dir)

    def _write_tensorboard(self, step: int, scalars: Mapping[str, float]) -> None:
        tb = self._tb
        if tb is None:
            return
        try:
            for key, value in scalars.items():
                tb.add_scalar(key, value, global_step=step)
        except Exception as e:  # noqa: BLE001  (a full disk must not stop training)
            log.warning("writing TensorBoard scalars failed: %s", e)


class StagePeakMemory:
    """Peak device memory per stage from one process-wide peak counter (torch's ``max_memory_allocated``).

    Stages nest (reward inside rollout, rollout inside validation) but the counter is one: entering a
    stage folds the counter into the enclosing stage's running peak before resetting it, and leaving
    folds the stage's peak back into the enclosing one, so every stage reports the peak over its whole
    body, nested stages included. ``since_start`` keeps the process-wide peak the resets would lose.
    """

    def __init__(self, read_peak: Callable[[], int], reset_peak: Callable[[], None]):
        self._read, self._reset = read_peak, reset_peak
        self._open: list[int] = []  # running peak of each open stage, outermost first
        self.pending: dict[str, int] = {}  # stage -> peak bytes since the last step was recorded
        self.since_start = 0

    def enter(self) -> None:
        peak = int(self._read())
        if self._open:
            self._open[-1] = max(self._open[-1], peak)
        self.since_start = max(self.since_start, peak)
        self._reset()
        self._open.append(0)

    def exit(self, name: str) -> None:
        peak = max(self._open.pop(), int(self._read()))
        if self._open:
            self._open[-1] = max(self._open[-1], peak)
        self.since_start = max(self.since_start, peak)
        self.pending[name] = max(self.pending.get(name, 0), peak)


def _cuda_stage_peaks() -> StagePeakMemory | None:
    try:
        import torch  # lazily: the metrics module must not need torch to load
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return StagePeakMemory(torch.cuda.max_memory_allocated, torch.cuda.reset_peak_memory_stats)
