"""The run loop every trainer shares: start-up, resume, the step loop with validation, checkpoint
due-ness, SIGTERM / preemption, progress lines, telemetry, status, final export.

A trainer (:class:`~rljob_worker.trainers.grpo.GRPOTrainer`, :class:`~rljob_worker.trainers.sft.SFTTrainer`)
subclasses :class:`RunLoop` and supplies its data and model (:meth:`RunLoop.build_data`,
:meth:`RunLoop.build_model`), its step (:meth:`RunLoop.train_step`), its validation
(:meth:`RunLoop.validate_for_log`) and the words of its progress line. Which trainer runs is decided
by ``algorithm.name`` in :mod:`rljob_worker.__main__`.

One step of the loop, on every rank::

    step += 1; metrics = train_step()            (+ timing/step_s, timing/<stage>_s, memory/<stage>_peak_gib)
    telemetry, checkpoint poll
    validation when due (testFreq, and after the last step)
    metrics.jsonl line (and the same to the experiment trackers of spec.tracking), progress line, RLJob status
    all ranks agree whether SIGTERM arrived; save when due (saveFreq, last step; never with saveFreq 0) or on preemption
    on SIGTERM: wait for the upload, raise Preempted (exit 143: PyTorchJob retries)
"""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rljob_api.models import RLJobSpec

from rljob_worker.runtime.distributed import DistEnv, dist_env_from_environ, init_distributed

log = logging.getLogger("rljob.run")

EXIT_PREEMPTED = 143  # 128 + SIGTERM: "retryable" for PyTorchJob restartPolicy ExitCode


@dataclass
class RunContext:
    """Where this run lives; the operator (or `rljob run`) decides, the spec does not."""

    job_name: str = "rljob"
    namespace: str = "default"
    workdir: Path = field(default_factory=lambda: Path("/tmp/rljob"))
    checkpoint_uri: str | None = None  # overrides spec.checkpoint.uri
    max_steps: int | None = None  # overrides spec.training.totalTrainingSteps
    show_progress_bar: bool = False


@dataclass
class StepResult:
    step: int
    metrics: dict[str, float]


class Preempted(Exception):
    pass


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """``spec.model.dtype`` as a torch dtype; float32 on CPU whatever the spec says."""
    if device.type == "cpu" and name != "float32":
        log.warning("model.dtype %s on CPU: training in float32 instead (CPU half precision is slow and lossy)", name)
        return torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def stage_peaks_over_ranks(peaks: dict[str, int], device: torch.device) -> dict[str, float]:
    """{memory/<stage>_peak_gib: the largest peak of any rank} for the standard stages (collective on a GPU;
    {} on CPU, where telemetry measures no peaks)."""
    if device.type != "cuda":
        return {}
    from rljob_worker.telemetry.trainer_metrics import STAGES

    values = torch.tensor([float(peaks.get(s, 0)) for s in STAGES], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {f"memory/{s}_peak_gib": v / 2**30 for s, v in zip(STAGES, values.tolist()) if v > 0}


class RunLoop:
    """The loop; subclasses supply the hooks below. After :meth:`setup` a trainer has ``actor``,
    ``tokenizer``, ``model_dir``, ``sampler``, ``val_set`` (or None), ``total_steps``,
    ``checkpoints`` and ``telemetry``."""

    progress_name = "train"  # the progress bar's label

    def __init__(self, spec: RLJobSpec, ctx: RunContext, env: DistEnv | None = None):
        self.spec, self.ctx = spec, ctx
        self.env = env or dist_env_from_environ(os.environ)
        self.history: list[StepResult] = []
        self.step = 0
        self._stop_requested = False
        self._status_reporter = None
        self.trackers = None  # rank 0's experiment trackers (spec.tracking), opened after the resume
        self._tracker_state: dict[str, Any] | None = None  # their run ids, from the checkpoint
        self._completed = False

    # ------------------------------------------------------------------ what a trainer supplies
    def build_data(self) -> None:
        """Tokenizer, data sets, sampler, ``total_steps`` (and anything else checked before the
        checkpoint store is): cheap, and where the usual configuration mistakes fail."""
        raise NotImplementedError

    def build_model(self) -> None:
        """``self.actor`` (and whatever else the step needs: reference model, rollout engine)."""
        raise NotImplementedError

    def train_step(self) -> dict[str, float]:
        """One optimizer step (``self.step`` is already the new step's number); its metrics."""
        raise NotImplementedError

    def validate_for_log(self) -> dict[str, float]:
        """Validate now; what goes into this step's metrics.jsonl line (may be empty)."""
        raise NotImplementedError

    def progress_line(self, metrics: dict[str, float], eta_s: float) -> str:
        raise NotImplementedError

    def progress_postfix(self, metrics: dict[str, float]) -> str:
        return ""

    def status_values(self, metrics: dict[str, float]) -> dict[str, float | None]:
        """``reward_mean`` and ``val_reward_mean`` for RLJob.status."""
        return {"reward_mean": None, "val_reward_mean": None}

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the model (extend it, and :meth:`load_trainer_state`)."""
        return {"step": self.step, "sampler": self.sampler.state_dict(),
                "history": [{"step": r.step, "metrics": r.metrics} for r in self.history[-1000:]],
                "trackers": self.trackers.state() if self.trackers is not None else self._tracker_state}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.history = [StepResult(h["step"], h["metrics"]) for h in state.get("history", [])]
        self._tracker_state = state.get("trackers")

    def after_resume(self) -> None:
        """After a checkpoint was loaded (e.g. hand the weights to a rollout engine)."""

    def validation_table(self) -> tuple[list[str], list[list[Any]]] | None:
        """Rank 0, after a validation: (columns, rows) of its samples for the experiment trackers, or None."""
        return None

    def checkpoint_models(self) -> dict[str, Any]:
        """Models saved and resumed beside ``self.actor`` in the same step folder, by sub-folder name."""
        return {}

    def summary_line(self) -> str | None:
        """Printed by rank 0 when the run ends."""
        return None

    def close(self) -> None:
        """Release what the run holds (always called, also after a failure)."""
        if self.trackers is not None:
            self.trackers.close(completed=self._completed)  # bounded flush (RLJOB_TRACKER_FLUSH_S)
            self.trackers = None
        telemetry = getattr(self, "telemetry", None)
        if telemetry is not None:
            telemetry.close()

    # ------------------------------------------------------------------ set-up
    def _phase(self, name: str, since: float) -> float:
        """One line per start-up phase with its time (rank 0), so a start-up is never a silent minute."""
        now = time.monotonic()
        if self.env.rank == 0:
            print(f"start-up: {name} {now - since:.1f}s", flush=True)
        return now

    def setup(self) -> None:
        """Everything that can fail on bad input fails here, before any training."""
        from rljob_worker import STARTED

        spec, env = self.spec, self.env
        t = self._phase("imports", STARTED)
        init_distributed(env)
        self.is_main = env.rank == 0
        self.device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        seed = spec.training.seed
        random.seed(seed + env.rank)
        np.random.seed(seed + env.rank)
        torch.manual_seed(seed)
        self.dtype = torch_dtype(spec.model.dtype.value, self.device)

        t = self._phase("distributed init", t)
        self.build_data()  # configuration first (cheap, and the usual mistakes)
        t = self._phase("data", t)
        from rljob_worker.checkpoint.run_checkpoints import RunCheckpoints

        self.checkpoints = RunCheckpoints(spec, self.ctx, self.env)
        self.checkpoints.check_access()
        self.finished_at = self._finished_step()
        t = self._phase("checkpoint store", t)
        if self.finished_at is not None:  # a re-run with nothing left: say so before building any model
            self.step = self.finished_at
            return
        self.compile_cache = self._restore_compile_cache()
        t = self._phase("compile cache", t)
        if self.device.type == "cpu":  # (imports megatron: part of the model's build)
            from rljob_worker.megatron.cpu_compat import apply_cpu_patches

            apply_cpu_patches()
        self.build_model()
        t = self._phase("model build", t)
        self.telemetry = self._make_telemetry()
        signal.signal(signal.SIGTERM, self._request_stop)
        self._resume()
        self._phase("resume", t)
        if self.is_main and (self.spec.tracking.mlflow or self.spec.tracking.wandb):
            self._open_trackers()

    def _restore_compile_cache(self):
        """A new pod's compiled kernels from the job's storage (checkpoint.compileCache), before any engine
        compiles; says on the start-up lines whether the first rollout will compile."""
        if not self.spec.checkpoint.compile_cache:
            return None
        from rljob_worker.checkpoint import compile_cache as cc
        from rljob_worker.rollout.compile_config import compile_enabled

        engine = {"engine": self.spec.rollout.engine.value,
                  "compile": compile_enabled(self.spec.rollout.compile, self.device),  # as resolved (env wins)
                  "tp": self.spec.rollout.tensor_model_parallel_size, "lora": self.spec.lora is not None,
                  "enforce_eager": self.spec.rollout.enforce_eager}
        parts = cc.fingerprint(cc.model_config_of(getattr(self, "model_dir", None)), dtype=self.spec.model.dtype.value,
                               engine=engine, device=cc.device_name(self.device))
        sync = cc.CompileCacheSync(self.checkpoints.store, self.checkpoints.manager.base_prefix, cc.archive_key(parts),
                                   cc.cache_roots(), uploads=self.is_main)
        words = sync.restore()
        if self.is_main:
            print(f"compile cache: {words}", flush=True)
        return sync

    def _engine_compiles(self):
        """The rollout engine's compiles, one per sampler (rollout/compile_once), if it compiles any."""
        return getattr(getattr(self, "engine", None), "compiles", None)

    def _engine_compiles_grew(self) -> bool:
        """Whether the engine compiled a sampler since the last call (a validation's, after the first step)."""
        compiles = self._engine_compiles()
        done = compiles.done if compiles is not None else 0
        grew, self._compiles_seen = done > getattr(self, "_compiles_seen", 0), done
        return grew

    def _save_compile_cache(self) -> None:
        sync = getattr(self, "compile_cache", None)
        if sync is not None and sync.save_if_grown():
            log.info("compile cache: the caches grew; uploading them in the background")

    def _open_trackers(self) -> None:
        from rljob_worker.telemetry.trackers import RunTrackers

        self.trackers = RunTrackers.open(
            self.spec, job=self.ctx.job_name, namespace=self.ctx.namespace, workdir=Path(self.ctx.workdir),
            state=self._tracker_state, telemetry=self.telemetry,
            spec_doc=self.spec.model_dump(mode="json", by_alias=True))
        self.trackers.backfill(self.history)  # resumed: steps the tracker lost with the killed process

    def _finished_step(self) -> int | None:
        """The job's newest committed step when it is >= total_steps and would be resumed (resumeMode auto or
        uri, the same resume-fixed settings), read from the store's listing and meta.json; else None. The
        same answer on every rank."""
        from rljob_worker.runtime.distributed import broadcast_object

        found = None
        # (not with a split critic: its pool serves the actor's steps and waits for them)
        if (self.env.rank == 0 and self.spec.checkpoint.resume_mode.value != "disable"
                and getattr(self, "pools", None) is None):
            try:
                ref = self.checkpoints.manager.latest_committed()
            except Exception as exc:  # noqa: BLE001 - the full resume path reports storage problems properly
                log.info("could not list the committed steps early (%s); deciding at resume", exc)
                ref = None
            if ref is not None and ref.step >= self.total_steps and not any(
                    k in self.checkpoints.spec_fields and ref.spec_fields[k] != self.checkpoints.spec_fields[k]
                    for k in ref.spec_fields):
                found = ref.step
        return broadcast_object(found)

    def _make_telemetry(self):
        from rljob_worker.telemetry.trainer_metrics import TrainerTelemetry

        telemetry = TrainerTelemetry(job=self.ctx.job_name, namespace=self.ctx.namespace, rank=self.env.rank,
                                     model=self.spec.model.path, algorithm=self.spec.algorithm.name.value,
                                     nnodes=self.spec.nnodes, save_freq=self.spec.checkpoint.save_freq,
                                     tensorboard_dir=self.spec.metrics.tensorboard_dir if self.is_main else None)
        if self.spec.metrics.enabled and self.env.local_rank == 0:
            port = int(os.environ.get("RLJOB_METRICS_PORT", self.spec.metrics.port))
            self.metrics_port = telemetry.serve(port)
            log.info("metrics on :%d/metrics", self.metrics_port)
        telemetry.set_total_steps(self.total_steps)
        return telemetry

    def _request_stop(self, signum, _frame) -> None:
        log.warning("signal %d: finishing the current step, then saving a checkpoint", signum)
        self._stop_requested = True

    def _resume(self) -> None:
        state = self.checkpoints.resume(self.actor, self.checkpoint_models())
        if state is None:
            return
        self.load_trainer_state(state)
        self.after_resume()
        if self.is_main:
            log.info("resumed from step %d (epoch %d, batch %d)", self.step, self.sampler.epoch, self.sampler.position)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[StepResult]:
        spec, t = self.spec, self.spec.training
        seed = getattr(self.checkpoints, "seed_uri", None)
        if self.step >= self.total_steps and self.is_main and seed is not None:
            # (deleting the job's own folder would change nothing: the next run starts from the seed again)
            print(f"nothing to train: spec.checkpoint.resumeFrom {seed} is at step {self.step} and this run stops at "
                  f"step {self.total_steps} (steps count on from the seed's); raise training.totalTrainingSteps "
                  f"above {self.step} to train more", flush=True)
        elif self.step >= self.total_steps and self.is_main and getattr(self, "finished_at", None) is None:
            print(f"nothing to train: resumed at step {self.step} of {self.total_steps} from {self.checkpoints.uri}; "
                  "delete that checkpoint folder (or `rljob run --fresh`) to train again", flush=True)
        if getattr(self, "finished_at", None) is not None:
            if self.is_main:
                print(f"nothing to train: the newest committed step is {self.step} of {self.total_steps}, under "
                      f"{self.checkpoints.uri}; delete that checkpoint folder (or `rljob run --fresh`) to train again",
                      flush=True)
            return self.history
        if t.val_before_train and self.val_set is not None and self.step == 0:
            logged = self.validate_for_log()
            if logged:
                self._append_metrics_log(logged, validated=True)
            elif self.trackers is not None:
                self._track(logged, validated=True)
        bar = self._progress_bar()
        from rljob_worker.run_health import RunHealth

        self.health = RunHealth(self.total_steps)
        while self.step < self.total_steps:
            step_start = time.perf_counter()
            self.step += 1
            if not self.history:  # this process's first step: which stage compiled what (_log_first_step_compiles)
                self.telemetry.compile_clock = _seconds_compiling
                self._compiles_before_first_step = compile_totals()
            metrics = self.train_step()
            metrics["timing/step_s"] = time.perf_counter() - step_start
            if getattr(getattr(self, "engine", None), "compile_decode", False):  # 0 after a compile that failed
                metrics["rollout/decode_compiled"] = 1.0 if self._engine_compiles().done else 0.0
            metrics.update({f"timing/{stage}_s": s for stage, s in self.telemetry.pending_stage_seconds().items()})
            metrics.update(stage_peaks_over_ranks(self.telemetry.pending_stage_peak_bytes(), self.device))
            self.history.append(StepResult(self.step, metrics))
            if len(self.history) == 1:  # this process's first step: what it compiled, kept for the next pod
                self.telemetry.compile_clock = None
                self._log_first_step_compiles(metrics["timing/step_s"])
                self._save_compile_cache()
            elif self._engine_compiles_grew():  # a sampler compiled since (a validation's): keep it too
                self._save_compile_cache()
            self.telemetry.record_step(self.step, metrics, metrics["timing/step_s"])
            self.telemetry.record_gpu_memory()
            self._poll_checkpoint()

            last = self.step == self.total_steps
            logged = dict(metrics)
            validated = self.val_set is not None and t.test_freq > 0 and (self.step % t.test_freq == 0 or last)
            if validated:
                logged.update(self.validate_for_log())
            self._append_metrics_log(logged, validated=validated)
            self._report_progress(metrics, bar)
            self.health.record(self.step, metrics)  # same metrics on every rank: all stop together
            stop = self._agree_to_stop()
            freq = spec.checkpoint.save_freq  # 0: never (benchmarks)
            due = (last and freq != 0) or (freq > 0 and self.step % freq == 0)
            if due or (stop and spec.checkpoint.save_on_preemption):
                self.save_checkpoint(metrics)
                self._save_compile_cache()  # a validation or a new shape may have compiled since
            if stop:
                self.checkpoints.wait()
                raise Preempted(f"stopped by SIGTERM after step {self.step}")
        if bar is not None:
            bar.close()
        if self._engine_compiles_grew():  # the last validation's sampler, where no checkpoint saved the cache
            self._save_compile_cache()
        self.checkpoints.wait()
        if getattr(self, "compile_cache", None) is not None:
            self.compile_cache.wait()
        self._poll_checkpoint()
        self._publish_status(self.history[-1].metrics if self.history else {}, force=True)
        self.export_final_models()
        self._completed = True
        return self.history

    def _log_first_step_compiles(self, seconds: float) -> None:
        """One line saying whether the first step compiled or loaded its kernels (rank 0)."""
        if not self.is_main:
            return
        before = getattr(self, "_compiles_before_first_step", {})
        spent = {k: v - before.get(k, 0) for k, v in compile_totals().items()}  # this step's, not a validation's
        hits, misses = int(spent["fxgraph_cache_hit"]), int(spent["fxgraph_cache_miss"])
        if hits or misses:
            by_stage = ", ".join(f"{stage} {secs:.1f}s" for stage, secs in
                                 self.telemetry.stage_compile_seconds.items() if secs >= 0.05)
            print(f"first step {seconds:.1f}s: {misses} graph(s) compiled, {hits} loaded from the compile cache; "
                  f"{spent['_compile.compile_inner']:.1f}s in torch.compile (tracing {spent['bytecode_tracing']:.1f}s, "
                  f"guards {spent['build_guards']:.1f}s, backend {spent['OutputGraph.call_user_compiler']:.1f}s)"
                  + (f"; by stage: {by_stage}" if by_stage else ""), flush=True)

    def export_final_models(self) -> None:
        """After the last step: the policy in Hugging Face format (checkpoint.exportHf). Collective."""
        if self.spec.checkpoint.export_hf:
            self.checkpoints.export_hf(self.actor, self.tokenizer, self.model_dir)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, metrics: dict[str, float]) -> None:
        with self.telemetry.stage("checkpoint"):
            self.checkpoints.save(self.step, self.actor, self.trainer_state(), metrics, self.checkpoint_models())
        self._poll_checkpoint()

    def _poll_checkpoint(self) -> None:
        """Rank 0: publish a checkpoint once its upload has committed (metrics, RLJob status)."""
        if not self.is_main:
            return
        committed = self.checkpoints.poll()
        if committed is not None:
            self.telemetry.record_checkpoint(committed["step"], time.time())
            self._publish_status(self.history[-1].metrics if self.history else {}, force=True)

    # ------------------------------------------------------------------ helpers
    def _agree_to_stop(self) -> bool:
        """Every rank must stop at the same step: OR the SIGTERM flags over the world."""
        flag = torch.tensor([1 if self._stop_requested else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.device.type == "cuda":
                flag = flag.to(self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _progress_bar(self):
        if not (self.is_main and self.ctx.show_progress_bar):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc=self.progress_name, unit="step",
                    dynamic_ncols=True)

    def _report_progress(self, metrics: dict[str, float], bar) -> None:
        if not self.is_main:
            return
        recent = self.history[-10:]
        eta = sum(r.metrics.get("timing/step_s", 0.0) for r in recent) / len(recent) * (self.total_steps - self.step)
        line = self.progress_line(metrics, eta)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(self.progress_postfix(metrics))
            bar.write(line)
        else:
            print(line, flush=True)
        self._publish_status(metrics)

    def _append_metrics_log(self, metrics: dict[str, float], validated: bool = False) -> None:
        """One JSON line per step in <workdir>/metrics.jsonl (rank 0): the run's learning curve; the same
        line goes to the experiment trackers."""
        if not self.is_main:
            return
        if self.trackers is not None:
            self._track(metrics, validated)
        Path(self.ctx.workdir).mkdir(parents=True, exist_ok=True)
        line = (json.dumps({"step": self.step, **metrics}) + "\n").encode()
        # one write(2) on an O_APPEND descriptor: a reader following the file sees whole lines, except at worst a
        # last one still being copied in (buffered text I/O could split a line over several writes)
        fd = os.open(Path(self.ctx.workdir) / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def _track(self, metrics: dict[str, float], validated: bool) -> None:
        """Rank 0: this step's line to the trackers; after a validation also its scores (``last_validation``, which
        GRPO keeps out of metrics.jsonl) and its samples as a table. Queued: returns at once."""
        line = dict(metrics)
        if validated:
            line = {**(getattr(self, "last_validation", None) or {}), **line}
        self.trackers.log_metrics(self.step, line)
        table = self.validation_table() if validated else None
        if table is not None:
            self.trackers.log_table(self.step, "validation/samples", *table)

    def _publish_status(self, metrics: dict[str, float], force: bool = False) -> None:
        """Progress for RLJob.status (the operator folds it in); a no-op outside a cluster."""
        if not self.is_main:
            return
        if self._status_reporter is None:
            from rljob_worker.telemetry.status_report import StatusReporter

            self._status_reporter = StatusReporter.from_environ(self.ctx.job_name, self.ctx.namespace)
        health = getattr(self, "health", None)
        self._status_reporter.report(step=self.step, total_steps=self.total_steps,
                                     last_checkpoint=self.checkpoints.last_committed, force=force,
                                     nonfinite_rewards=health.nonfinite_rewards if health else None,
                                     quarantined=self.checkpoints.quarantined,
                                     tracker_runs=self.trackers.runs() if self.trackers is not None else None,
                                     **self.status_values(metrics))


def run(trainer: RunLoop) -> int:
    """Set up, train, and turn the outcome into the process exit code (0, or 143 when preempted)."""
    try:
        trainer.setup()
        trainer.fit()
    except Preempted as exc:
        log.warning("%s; checkpoint committed, exiting %d", exc, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    finally:
        trainer.close()
    if trainer.is_main:
        line = trainer.summary_line()
        if line:
            print(line, flush=True)
    return 0


def compile_totals() -> dict[str, float]:
    """This process's torch.compile totals so far: inductor's cache hits and misses (graphs loaded / compiled) and
    dynamo's seconds (all of it, tracing, guards, backend)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    totals = {k: float(counters["inductor"][k]) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    totals.update({k: sum(compilation_time_metrics.get(k, ())) for k in
                   ("_compile.compile_inner", "bytecode_tracing", "build_guards", "OutputGraph.call_user_compiler")})
    return totals


def _seconds_compiling() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo's own clock: tracing, guards, backend)."""
    return compile_totals()["_compile.compile_inner"]
