"""Learning is shown by a reward that rises: real GRPO runs of the trainer on CPU.

Each run is a separate process (megatron's parallel state is process-global). The
sabotaged runs prove these tests can fail: the same run with the loss sign flipped or
the advantages zeroed must not learn.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("trainer_harness.py")


def quickstart_spec() -> dict:
    return yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())["spec"]


def digit_sum_spec() -> dict:
    spec = quickstart_spec()
    spec["data"] = {"synthetic": {"task": "digit-sum", "numPrompts": 100, "numValPrompts": 0},
                    "maxPromptLength": 8, "maxResponseLength": 2}
    spec["reward"] = {"function": "digit-sum"}
    spec["training"].update(trainBatchSizePerNode=16, ppoMiniBatchSizePerNode=16, microBatchSizePerGpu=64,
                            lr=3.0e-4, totalTrainingSteps=400, testFreq=-1, valBeforeTrain=False, seed=1)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    return spec


def run_trainer(spec: dict, workdir: Path, *extra: str, timeout: float = 600) -> list[dict]:
    """Run the trainer to completion and return its per-step metrics (last record per step)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HARNESS), str(spec_path), str(workdir), *extra],
                          check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(workdir)


def read_metrics(workdir: Path) -> list[dict]:
    by_step = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def logged_steps(log: Path) -> list[int]:
    """Steps of metrics.jsonl's complete lines: a running job may be appending its last line as we read."""
    text = log.read_text() if log.exists() else ""
    return [json.loads(line)["step"] for line in text[:text.rfind("\n") + 1].splitlines()]


def rewards(records: list[dict]) -> np.ndarray:
    return np.array([r["reward/mean"] for r in records])


def test_target_token_learns(tmp_path):
    records = run_trainer(quickstart_spec(), tmp_path)
    r = rewards(records)
    assert len(r) == 30
    assert r[:5].mean() < 0.3, r
    assert r[-5:].mean() > 0.9, r
    # the loop trained for real: gradients flowed while rewards still differed within groups
    # (once every sample of a batch is perfect, advantages and gradients are zero by design)
    assert all(rec["actor/grad_norm"] > 0 for rec in records[:10])
    assert {"actor/pg_loss", "actor/clip_fraction", "response_length/mean"} <= set(records[0])


@pytest.mark.parametrize("sabotage", ["flip-sign", "zero-advantages"])
def test_target_token_sabotaged_does_not_learn(tmp_path, sabotage):
    r = rewards(run_trainer(quickstart_spec(), tmp_path, "--sabotage", sabotage))
    assert r[-5:].mean() < 0.5, f"{sabotage} still learned: {r}"


@pytest.mark.slow
def test_digit_sum_learns(tmp_path):
    r = rewards(run_trainer(digit_sum_spec(), tmp_path))
    first, last = r[:50].mean(), r[-50:].mean()
    print(f"digit-sum reward: first 50 {first:.3f}, last 50 {last:.3f}")
    assert last >= 0.35 and last >= 3 * first, (first, last)


ALGORITHM_VARIANTS = {
    "kl-in-loss": {"algorithm": {"klCoef": 0.001, "klEstimator": "low_var_kl"}},
    "kl-in-reward": {"algorithm": {"klCoef": 0.001, "klEstimator": "k1", "klPlacement": "reward"}},
    "two-minibatches-two-epochs": {"training": {"ppoMiniBatchSizePerNode": 2, "ppoEpochs": 2, "microBatchSizePerGpu": 8}},
    # GSPO takes the sequence-level aggregation (validation refuses the token sums with it)
    "gspo-dual-clip": {"algorithm": {"normAdvByStd": False, "lossAggregation": "seq-mean-token-mean",
                                     "importanceLevel": "sequence", "dualClipC": 3.0}},
    # (no overlong buffer here: this task rewards filling every position, which the buffer penalises)
    "dapo": {"algorithm": {"clipRatioHigh": 0.28, "dynamicSampling": True}},
    "rloo-entropy-dr-grpo-sum": {"algorithm": {"advantageEstimator": "rloo", "entropyCoeff": 0.001,
                                               "lossAggregation": "seq-mean-token-sum-norm"}},
}


@pytest.mark.parametrize("variant", sorted(ALGORITHM_VARIANTS))
def test_algorithm_variants_learn(tmp_path, variant):
    """Every loss/KL/sampling path the spec offers runs end to end and still learns the easy task."""
    spec = quickstart_spec()
    for section, values in ALGORITHM_VARIANTS[variant].items():
        spec[section].update(values)
    spec["training"].update(totalTrainingSteps=12, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    records = run_trainer(spec, tmp_path)
    r = rewards(records)
    assert r[-3:].mean() > r[:3].mean() + 0.15, f"{variant} did not learn: {r}"
    if "kl" in variant:
        assert any(rec.get("actor/kl", 0) != 0 for rec in records[1:]), "KL never moved"
    if variant == "dapo":
        assert "dynamic_sampling/kept_group_fraction" in records[0]


def test_kl_in_reward_is_subtracted_before_group_normalisation(tmp_path):
    """Issue #18's example through the trainer's real step: one group of 2, k1, coef 0.1, rewards [1, 1],
    summed KL [2, 0]: the scores [0.8, 1.0] are group-normalised to advantages [-1, +1] (subtracting the
    KL from the finished advantages gave [-0.2, 0])."""
    spec = quickstart_spec()
    spec["algorithm"].update(klCoef=0.1, klEstimator="k1", klPlacement="reward")
    spec["rollout"]["samplesPerPrompt"] = 2
    spec["training"].update(trainBatchSizePerNode=1, ppoMiniBatchSizePerNode=1, microBatchSizePerGpu=2,
                            totalTrainingSteps=1, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(HARNESS.with_name("kl_reward_probe.py")), str(tmp_path / "spec.json"),
                           str(tmp_path), str(out)], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(out.read_text())
    (rows,) = result["advantages"]  # one mini-batch
    assert all(v == pytest.approx(-1.0, abs=1e-4) for v in rows[0]), rows
    assert all(v == pytest.approx(1.0, abs=1e-4) for v in rows[1]), rows
    assert result["metrics"]["reward/kl_penalty_mean"] == pytest.approx(0.1, abs=1e-5)  # 0.1 x mean(2, 0)


def test_trainer_logprobs_are_of_the_distribution_the_rollout_sampled(tmp_path):
    """At temperature 0.7 the trainer's recomputed log-probs are of softmax(logits / 0.7), as the engine's
    (fp32 on CPU: equal to float noise). Without the division the gap was 0.116 nats per token here."""
    spec = quickstart_spec()
    spec["rollout"]["temperature"] = 0.7
    spec["training"].update(totalTrainingSteps=1, testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    records = run_trainer(spec, tmp_path)
    gaps = [rec["rollout/logprob_mismatch_mean"] for rec in records]
    print("mean |engine - trainer| log-prob per token at T=0.7:", gaps)
    assert len(gaps) == 1 and max(gaps) < 1e-4, gaps


def test_rollout_correction_learns_under_a_controlled_mismatch(tmp_path):
    """The engine samples from the nucleus of mass 0.9 (top-p, which the trainer's policy does not apply):
    a known rollout/training gap, the engine's log-prob of each sampled token above the trainer's by
    minus the log of the nucleus' mass (at most -ln 0.9 = 0.105 nats). With sequence masking on (a band
    [1/1.1, 1.1], ln 1.1 = 0.095 nats, inside that bound so that it acts on this small gap) the target-token task still learns, and the metrics report the gap and what the
    correction did. (The gap has one sign, trainer below engine, so truncation, which caps weights above
    the threshold, has nothing to cap here; tests/worker/test_rollout_correction.py covers it by hand.)"""
    spec = quickstart_spec()
    spec["rollout"]["topP"] = 0.9
    spec["algorithm"]["rolloutCorrection"] = {"tokenTruncation": True, "sequenceMasking": True, "threshold": 1.1,
                                                "sequenceMaskingThreshold": 1.1}
    spec["training"].update(testFreq=-1, valBeforeTrain=False)
    spec["checkpoint"].update(saveFreq=-1, exportHf=False)
    records = run_trainer(spec, tmp_path)
    r = rewards(records)
    print("rollout correction rewards:", np.round(r, 3).tolist())
    print("mismatch / weight / clipped / masked:", [(round(rec["rollout/logprob_mismatch_mean"], 4),
          round(rec["rollout/correction_weight_mean"], 4), round(rec["rollout/correction_clipped_frac"], 4),
          round(rec["rollout/correction_masked_frac"], 4)) for rec in records[:3]])
    assert r[:5].mean() < 0.3 and r[-5:].mean() > 0.8, r
    assert all(rec["rollout/logprob_mismatch_mean"] > 0.01 for rec in records[:10])  # ~0 without top-p
    masked = [rec["rollout/correction_masked_frac"] for rec in records]
    assert max(masked) > 0, masked
    assert masked[0] < 0.5, masked  # late, a sharp policy's nucleus is one token whose trainer ratio is p < 1/1.1
    assert all(rec["rollout/correction_weight_mean"] <= 1.0 + 1e-6 for rec in records)  # trainer below engine
    assert any(rec["rollout/correction_weight_mean"] != pytest.approx(1.0, abs=1e-3) for rec in records)
