"""Unit tests of rljob_worker.telemetry.trainer_metrics on its own registry (no Prometheus server)."""
from __future__ import annotations

import builtins
import math
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from rljob_worker.telemetry import trainer_metrics as tm
from rljob_worker.telemetry.trainer_metrics import (
    MAX_EXTRA_KEYS,
    STEP_GAUGES,
    VALIDATION_GAUGES,
    TrainerTelemetry,
)

BASE = {"rljob": "demo", "namespace": "ml", "rank": "0"}


@pytest.fixture
def tel():
    t = TrainerTelemetry(job="demo", namespace="ml", rank=0, model="m", algorithm="grpo", nnodes=2,
                         registry=CollectorRegistry())
    yield t
    t.close()


def value(t: TrainerTelemetry, name: str, **labels: str) -> float | None:
    return t.registry.get_sample_value(name, {**BASE, **labels})


def all_step_metrics(x: float) -> dict[str, float]:
    return {key: x for key in STEP_GAUGES}


def test_identity_series_exist_from_the_start(tel):
    assert value(tel, "rljob_job_info", model="m", algorithm="grpo", nnodes="2") == 1
    assert value(tel, "rljob_nodes") == 2
    assert abs(value(tel, "rljob_heartbeat_timestamp_seconds") - time.time()) < 5
    assert abs(value(tel, "rljob_start_timestamp_seconds") - time.time()) < 5


def test_no_made_up_values_before_the_first_record(tel):
    # A 0 reward, step or checkpoint time before any was recorded would mislead dashboards and alerts
    # (a checkpoint timestamp of 0 would make the checkpoint alert fire at once).
    for name in ("rljob_reward_mean", "rljob_step", "rljob_total_steps", "rljob_last_checkpoint_step",
                 "rljob_last_checkpoint_timestamp_seconds", "rljob_validation_step",
                 "rljob_checkpoint_interval_seconds_estimate", "rljob_gpu_memory_allocated_bytes"):
        assert value(tel, name) is None, name


def test_record_step_maps_every_trainer_key_to_its_gauge(tel):
    metrics = {key: float(i) + 0.5 for i, key in enumerate(STEP_GAUGES)}
    tel.record_step(7, metrics, step_seconds=3.25)
    for key, (name, _doc) in STEP_GAUGES.items():
        assert value(tel, name) == metrics[key], name
    assert value(tel, "rljob_step") == 7
    assert value(tel, "rljob_steps_total") == 1
    assert value(tel, "rljob_step_last_seconds") == 3.25
    assert value(tel, "rljob_step_seconds_count") == 1
    assert value(tel, "rljob_step_seconds_sum") == 3.25
    assert value(tel, "rljob_step_seconds_bucket", le="5.0") == 1
    assert value(tel, "rljob_step_seconds_bucket", le="2.5") == 0


def test_unknown_keys_are_exported_generically_and_bad_values_skipped(tel):
    tel.record_step(1, {"reward/mean": 0.5, "timing/gen_s": 1.5, "note": "text", "none": None}, 1.0)
    assert value(tel, "rljob_trainer_metric", key="timing/gen_s") == 1.5
    assert value(tel, "rljob_trainer_metric", key="note") is None
    assert value(tel, "rljob_trainer_metric", key="none") is None
    assert value(tel, "rljob_reward_mean") == 0.5


def test_generic_keys_are_capped(tel, caplog):
    tel.record_step(1, {f"extra/k{i}": float(i) for i in range(MAX_EXTRA_KEYS + 10)}, 1.0)
    exported = [s for m in tel.registry.collect() if m.name == "rljob_trainer_metric" for s in m.samples]
    assert len(exported) == MAX_EXTRA_KEYS
    assert "not exported" in caplog.text
    # keys already exported keep updating
    tel.record_step(2, {"extra/k0": 99.0}, 1.0)
    assert value(tel, "rljob_trainer_metric", key="extra/k0") == 99.0


def test_non_finite_values_are_exported_as_they_are(tel):
    tel.record_step(1, {"reward/mean": math.nan, "actor/grad_norm": math.inf}, 1.0)
    assert math.isnan(value(tel, "rljob_reward_mean"))
    assert value(tel, "rljob_actor_grad_norm") == math.inf


def test_tensor_values_are_accepted(tel):
    torch = pytest.importorskip("torch")
    tel.record_step(1, {"reward/mean": torch.tensor(0.25)}, 1.0)
    assert value(tel, "rljob_reward_mean") == 0.25


def test_stage_times_observes_and_heartbeats(tel):
    before = value(tel, "rljob_heartbeat_timestamp_seconds")
    inside = threading.Event()
    release = threading.Event()

    def work():
        with tel.stage("rollout"):
            inside.set()
            release.wait(5)
            time.sleep(0.05)

    th = threading.Thread(target=work)
    th.start()
    assert inside.wait(5)
    assert value(tel, "rljob_stage_active", stage="rollout") == 1
    release.set()
    th.join(5)
    assert value(tel, "rljob_stage_active", stage="rollout") == 0
    assert value(tel, "rljob_stage_seconds_count", stage="rollout") == 1
    last = value(tel, "rljob_stage_last_seconds", stage="rollout")
    assert 0.05 <= last < 2
    assert value(tel, "rljob_stage_seconds_sum", stage="rollout") == last
    assert value(tel, "rljob_heartbeat_timestamp_seconds") >= before


def test_stage_is_recorded_when_its_body_raises(tel):
    with pytest.raises(RuntimeError), tel.stage("checkpoint"):
        raise RuntimeError("upload failed")
    assert value(tel, "rljob_stage_seconds_count", stage="checkpoint") == 1
    assert value(tel, "rljob_stage_active", stage="checkpoint") == 0


def test_stage_names(tel, caplog):
    with tel.stage("prefetch"):  # not a standard stage: recorded, with a warning
        pass
    assert value(tel, "rljob_stage_seconds_count", stage="prefetch") == 1
    assert "not one of the standard stages" in caplog.text
    for bad in ("", "Rollout", "a b", "x" * 80):
        with pytest.raises(ValueError), tel.stage(bad):
            pass


def test_heartbeat_moves_forward(tel):
    first = value(tel, "rljob_heartbeat_timestamp_seconds")
    time.sleep(0.02)
    tel.heartbeat()
    assert value(tel, "rljob_heartbeat_timestamp_seconds") > first


def test_validation(tel):
    tel.record_validation(10, {"val/reward_mean": 0.7, "val/accuracy": 0.6, "val/pass@4": 0.8})
    for key, (name, _doc) in VALIDATION_GAUGES.items():
        assert value(tel, name) == {"val/reward_mean": 0.7, "val/accuracy": 0.6}[key]
    assert value(tel, "rljob_validation_step") == 10
    assert value(tel, "rljob_trainer_metric", key="val/pass@4") == 0.8


def test_checkpoint_interval_from_save_freq_and_step_times():
    t = TrainerTelemetry(job="demo", namespace="ml", rank=0, model="m", algorithm="grpo", nnodes=1,
                         registry=CollectorRegistry(), save_freq=10)
    assert value(t, "rljob_checkpoint_save_freq_steps") == 10
    assert value(t, "rljob_checkpoint_interval_seconds_estimate") is None
    for step, seconds in enumerate([2.0, 4.0, 3.0], start=1):
        t.record_step(step, {}, seconds)
    assert value(t, "rljob_checkpoint_interval_seconds_estimate") == pytest.approx(30.0)
    t.record_checkpoint(3, 1000.0)
    assert value(t, "rljob_last_checkpoint_step") == 3
    assert value(t, "rljob_last_checkpoint_timestamp_seconds") == 1000.0
    assert value(t, "rljob_checkpoints_total") == 1
    t.close()


@pytest.mark.parametrize("save_freq", [None, -1, 0])
def test_checkpoint_interval_from_observed_checkpoints(save_freq):
    t = TrainerTelemetry(job="demo", namespace="ml", rank=0, model="m", algorithm="grpo", nnodes=1,
                         registry=CollectorRegistry(), save_freq=save_freq)
    t.record_step(1, {}, 5.0)
    assert value(t, "rljob_checkpoint_save_freq_steps") is None
    t.record_checkpoint(1, 1000.0)
    assert value(t, "rljob_checkpoint_interval_seconds_estimate") is None  # one checkpoint: no interval yet
    t.record_checkpoint(2, 1100.0)
    t.record_checkpoint(3, 1300.0)
    assert value(t, "rljob_checkpoint_interval_seconds_estimate") == pytest.approx(150.0)
    t.close()


def test_gpu_memory(tel):
    tel.set_gpu_memory(allocated_bytes=1e9, reserved_bytes=2e9, max_allocated_bytes=1.5e9, total_bytes=8e10)
    assert value(tel, "rljob_gpu_memory_allocated_bytes") == 1e9
    assert value(tel, "rljob_gpu_memory_reserved_bytes") == 2e9
    assert value(tel, "rljob_gpu_memory_max_allocated_bytes") == 1.5e9
    assert value(tel, "rljob_gpu_memory_total_bytes") == 8e10


def test_record_gpu_memory_is_a_no_op_without_cuda(tel, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tel.record_gpu_memory()
    assert value(tel, "rljob_gpu_memory_allocated_bytes") is None


@pytest.mark.gpu
def test_record_gpu_memory_reads_cuda(tel):
    import torch

    x = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 64 MiB
    tel.record_gpu_memory()
    assert value(tel, "rljob_gpu_memory_allocated_bytes") >= x.numel()
    assert value(tel, "rljob_gpu_memory_reserved_bytes") >= value(tel, "rljob_gpu_memory_allocated_bytes")
    assert value(tel, "rljob_gpu_memory_max_allocated_bytes") >= x.numel()
    assert value(tel, "rljob_gpu_memory_total_bytes") > 1e9


def test_labels_are_few_and_never_job_or_instance(tel):
    tel.record_step(1, {**all_step_metrics(0.5), "extra": 1.0}, 1.0)
    tel.record_validation(1, {"val/accuracy": 0.5, "val/reward_mean": 0.5})
    tel.record_checkpoint(1, time.time())
    tel.set_total_steps(10)
    tel.set_gpu_memory(allocated_bytes=1, reserved_bytes=1, max_allocated_bytes=1, total_bytes=1)
    with tel.stage("rollout"):
        pass
    allowed_extra = {"stage", "key", "le", "model", "algorithm", "nnodes"}
    seen = 0
    for family in tel.registry.collect():
        for sample in family.samples:
            if not sample.name.startswith("rljob_"):
                continue
            seen += 1
            labels = set(sample.labels)
            assert {"rljob", "namespace", "rank"} <= labels, sample
            assert not labels & {"job", "instance"}, sample
            assert labels - {"rljob", "namespace", "rank"} <= allowed_extra, sample
    assert seen > 40


def test_serve_exposes_metrics_over_http_and_close_stops_it():
    t = TrainerTelemetry(job="demo", namespace="ml", rank=3, model="m", algorithm="grpo", nnodes=1)
    port = t.serve(0, addr="127.0.0.1")
    assert port > 0
    with pytest.raises(RuntimeError, match="already served"):
        t.serve(0, addr="127.0.0.1")
    t.record_step(5, {"reward/mean": 0.5}, 1.0)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    body = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert families["rljob_step"].samples[0].value == 5
    assert families["rljob_step"].samples[0].labels == {"rljob": "demo", "namespace": "ml", "rank": "3"}
    assert "process_resident_memory_bytes" in families  # default registry has process metrics
    t.close()
    t.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        opener.open(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_two_instances_do_not_collide():
    a = TrainerTelemetry(job="a", namespace="ml", rank=0, model="m", algorithm="grpo", nnodes=1)
    b = TrainerTelemetry(job="b", namespace="ml", rank=0, model="m", algorithm="grpo", nnodes=1)
    a.record_step(1, {}, 1.0)
    assert a.registry.get_sample_value("rljob_step", {"rljob": "a", "namespace": "ml", "rank": "0"}) == 1
    assert b.registry.get_sample_value("rljob_step", {"rljob": "b", "namespace": "ml", "rank": "0"}) is None


@pytest.mark.parametrize("kwargs", [{"job": ""}, {"rank": -1}, {"nnodes": 0}])
def test_invalid_arguments(kwargs):
    args = {"job": "demo", "namespace": "ml", "rank": 0, "model": "m", "algorithm": "grpo", "nnodes": 1, **kwargs}
    with pytest.raises(ValueError):
        TrainerTelemetry(**args)


def test_tensorboard_missing_is_a_warning_not_a_crash(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("TensorBoard logging requires TensorBoard version 1.15 or above")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.warns(RuntimeWarning, match="install the 'tensorboard' package"):
        t = TrainerTelemetry(job="demo", namespace="ml", rank=0, model="m", algorithm="grpo", nnodes=1,
                             registry=CollectorRegistry(), tensorboard_dir=str(tmp_path / "tb"))
    t.record_step(1, {"reward/mean": 0.5}, 1.0)
    assert value(t, "rljob_reward_mean") == 0.5
    t.close()


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (optional)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = TrainerTelemetry(job="demo", namespace="ml", rank=0, model="m", algorithm="grpo", nnodes=1,
                         registry=CollectorRegistry(), tensorboard_dir=str(tmp_path))
    for step in (1, 2):
        with t.stage("rollout"):
            pass
        t.record_step(step, {"reward/mean": 0.1 * step, "custom/x": 1.0}, 2.0)
    t.record_validation(2, {"val/accuracy": 0.5})
    t.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "custom/x", "timing/step_seconds", "timing/rollout_seconds", "val/accuracy"} <= tags
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2)]


def test_module_is_the_only_prometheus_client_importer():
    """STYLE.md habit 12: prometheus-client only in the metrics module."""
    from pathlib import Path

    metrics_module = Path(tm.__file__).resolve()
    worker = metrics_module.parents[1]
    offenders = [p.relative_to(worker).as_posix() for p in worker.rglob("*.py")
                 if p != metrics_module and "prometheus_client" in p.read_text()]
    assert offenders == []


class _Allocator:
    """torch.cuda's peak semantics: the peak follows allocations; a reset sets it to what is allocated now."""

    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n):
        self.allocated -= n

    def reset(self):
        self.peak = self.allocated


def test_stage_peak_memory_by_hand_with_nested_stages():
    from rljob_worker.telemetry.trainer_metrics import StagePeakMemory

    mem = _Allocator()
    peaks = StagePeakMemory(lambda: mem.peak, mem.reset)
    mem.alloc(100)  # before any stage: counts only towards since_start
    mem.free(60)
    peaks.enter()  # rollout: 40 held
    mem.alloc(50)  # 90
    mem.free(50)
    peaks.enter()  # reward, nested: 40 held
    mem.alloc(20)  # 60
    mem.free(20)
    peaks.exit("reward")
    mem.alloc(10)  # 50
    peaks.exit("rollout")  # its peak (90) survives the reset the nested stage made
    mem.free(10)
    peaks.enter()
    mem.alloc(200)  # 240
    mem.free(200)
    peaks.exit("actor_update")
    assert peaks.pending == {"reward": 60, "rollout": 90, "actor_update": 240}
    assert peaks.since_start == 240
    peaks.enter()  # a stage seen twice in a step keeps its larger peak
    mem.alloc(5)
    peaks.exit("reward")
    assert peaks.pending["reward"] == 60


def test_stage_compile_seconds_follow_the_clock_only_while_it_is_set(tel):
    """A process's first step counts each stage's compile seconds by the clock the run loop sets; nested stages
    count in both (as their seconds do); without a clock nothing is counted."""
    clock = [0.0]
    tel.compile_clock = lambda: clock[0]
    with tel.stage("rollout"):
        clock[0] += 2.0
        with tel.stage("old_logprob"):
            clock[0] += 0.5
    with tel.stage("actor_update"):
        pass
    tel.compile_clock = None
    with tel.stage("actor_update"):
        clock[0] += 7.0
    assert dict(tel.stage_compile_seconds) == {"rollout": 2.5, "old_logprob": 0.5, "actor_update": 0.0}


def test_the_compile_clock_sees_a_real_compile_inside_its_stage(tel):
    """The run loop's clock is dynamo's own: a torch.compile inside a stage is counted there, a stage that only
    calls the compiled function again counts none of it."""
    import torch
    from rljob_worker.run_loop import _seconds_compiling

    def scaled(x):
        return torch.sin(x) * 3 + 1

    fn = torch.compile(scaled, backend="eager")
    tel.compile_clock = _seconds_compiling
    with tel.stage("rollout"):
        fn(torch.ones(4))
    with tel.stage("actor_update"):
        fn(torch.ones(4))
    assert tel.stage_compile_seconds["rollout"] > 0
    assert tel.stage_compile_seconds["actor_update"] == 0
