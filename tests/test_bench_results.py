"""bench/results.py: every result line carries all fields, ratios agree with their values, merging
adds each line once; the committed bench/results.jsonl passes the same check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import results as R


def test_record_appends_one_complete_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RLJOB_BENCH_RESULTS", str(tmp_path / "r.jsonl"))
    monkeypatch.setenv("RLJOB_BENCH_COMMIT", "abc123")
    R.record("actor_update megatron", "0.5b mbs 8", "tokens_per_s", 60_000.0, "tok/s", card="NVIDIA H100",
             baseline="hf-packed mbs 8", baseline_value=50_000.0, same_run=True)
    R.record("rollout", "batch 256", "decode_ms_per_step", 3.0, "ms", card="NVIDIA H100",
             baseline="hf generate", baseline_value=9.0)
    R.record("weight_sync", "0.5b", "seconds_per_gb", 0.002, "s/GB", card="NVIDIA H100")
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [tuple(x) for x in lines] == [R.FIELDS] * 3
    assert lines[0]["ratio"] == pytest.approx(1.2) and lines[0]["same_run"] is True
    assert lines[1]["ratio"] == pytest.approx(3.0)  # a time: baseline / value, > 1 = faster
    assert lines[2]["ratio"] is None and lines[2]["same_run"] is None
    assert {x["commit"] for x in lines} == {"abc123"}
    assert lines[0]["command"].startswith("python3 ")
    assert R.check(lines) == []


def test_out_dir_is_the_default_target_on_the_device(tmp_path, monkeypatch):
    monkeypatch.delenv("RLJOB_BENCH_RESULTS", raising=False)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert R.results_path() == tmp_path / "results.jsonl"
    monkeypatch.delenv("OUT")
    assert R.results_path() == R.DEFAULT_FILE


def test_bad_records_are_refused_or_reported():
    with pytest.raises(ValueError, match="baseline and baseline_value go together"):
        R.make_record("w", "s", "m", 1.0, "tok/s", baseline="x", card="c", commit="c")
    with pytest.raises(ValueError, match="value must be a number"):
        R.make_record("w", "s", "m", float("nan"), "tok/s", card="c", commit="c")
    good = R.make_record("w", "s", "m", 2.0, "tok/s", baseline="b", baseline_value=1.0, card="c", commit="c")
    assert R.check([{**good, "ratio": 3.0}]) == ["line 1: ratio 3.0 but value/baseline give 2.0"]
    assert "missing ['commit']" in R.check([{k: v for k, v in good.items() if k != "commit"}])[0]


def test_merge_adds_each_line_once(tmp_path):
    src, dst = tmp_path / "src.jsonl", tmp_path / "dst.jsonl"
    recs = [R.make_record("w", "s", "m", float(v), "tok/s", card="c", commit="c", date="2026-11-26") for v in (1, 2)]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    dst.write_text(json.dumps(recs[0]) + "\n")
    assert R.merge(src, dst) == 1
    assert R.merge(src, dst) == 0
    assert [r["value"] for r in R.load(dst)] == [1.0, 2.0]


def test_committed_results_are_complete_and_consistent():
    records = R.load(R.DEFAULT_FILE)
    assert records, "bench/results.jsonl is empty"
    assert R.check(records) == []
