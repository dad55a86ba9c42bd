"""The CRD's CEL rules (`x-kubernetes-validations`), evaluated with celpy as the API server would:
at the node they are attached to, with `self` that node's value, absent fields absent.

celpy handles every construct the rules use (has() on nested selects guarded by has() of the
parent, ternaries, size(), %), so no adapter is needed beyond running each rule at its node and
counting an evaluation error as a rejection (as the API server does).
"""
from __future__ import annotations

import itertools
import random

import pytest
from api_cases import CROSS_INVALID, CROSS_VALID, M, R
from api_support import DELETE, EXAMPLE_PATHS, cel_failures, cel_rules, changed, errors_of, gpu_job, load_yaml

TP_GPUS = "spec.megatron.tensorModelParallelSize"
PP_GPUS = "spec.megatron.pipelineModelParallelSize"
CP_GPUS = "spec.megatron.contextParallelSize"
ROLLOUT = "spec.rollout.tensorModelParallelSize"
SP = "spec.megatron.sequenceParallel"
VPP = "spec.megatron.virtualPipelineModelParallelSize"
DATA = "spec.data"
RESUME = "spec.checkpoint.resumeFrom"
SFT = "spec.sft"
CRITIC = "spec.critic"
CRITIC_GPUS = "spec.critic.gpus"
CRITIC_TP = "spec.critic.megatron.tensorModelParallelSize"
CRITIC_PP = "spec.critic.megatron.pipelineModelParallelSize"
CRITIC_CP = "spec.critic.megatron.contextParallelSize"
CRITIC_LAYER = "spec.critic.outputLayerIndex"
CRITIC_SP = "spec.critic.megatron.sequenceParallel"
CRITIC_VPP = "spec.critic.megatron.virtualPipelineModelParallelSize"
GAE = {"spec.algorithm.advantageEstimator": "gae"}
GSPO = "spec.algorithm.lossAggregation"
MODE = "spec.rollout.mode"
ROLLOUT_GPUS = "spec.rollout.gpus"

# pydantic's error path(s) for the rule behind each CEL fieldPath
PYDANTIC_PATHS = {
    TP_GPUS: {"spec.megatron.tensorModelParallelSize"},
    PP_GPUS: {"spec.megatron.pipelineModelParallelSize"},
    CP_GPUS: {"spec.megatron.contextParallelSize"},
    ROLLOUT: {"spec.rollout.tensorModelParallelSize"},
    SP: {"spec.megatron.sequenceParallel"},
    VPP: {"spec.megatron.virtualPipelineModelParallelSize"},
    DATA: {"spec.data.trainFiles", "spec.data.synthetic"},
    RESUME: {"spec.checkpoint.resumeFrom"},
    SFT: {"spec.sft"},
    CRITIC: {"spec.critic"},
    CRITIC_GPUS: {"spec.critic.gpus"},
    CRITIC_TP: {"spec.critic.megatron.tensorModelParallelSize"},
    CRITIC_PP: {"spec.critic.megatron.pipelineModelParallelSize"},
    CRITIC_CP: {"spec.critic.megatron.contextParallelSize"},
    CRITIC_LAYER: {"spec.critic.outputLayerIndex"},
    CRITIC_SP: {"spec.critic.megatron.sequenceParallel"},
    CRITIC_VPP: {"spec.critic.megatron.virtualPipelineModelParallelSize"},
    GSPO: {"spec.algorithm.lossAggregation"},
    MODE: {"spec.rollout.mode"},
    ROLLOUT_GPUS: {"spec.rollout.gpus"},
}


def test_every_crd_rule_is_covered_here():
    assert {".".join(path) + field for path, field, *_ in cel_rules()} == set(PYDANTIC_PATHS)


@pytest.mark.parametrize("path", EXAMPLE_PATHS, ids=[p.name for p in EXAMPLE_PATHS])
def test_examples_pass_every_rule(path):
    assert cel_failures(load_yaml(path)) == []


def minimal(spec: dict) -> dict:
    """A manifest with only what is given: CEL must fall back to the model defaults for the rest."""
    return {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "t"}, "spec": spec}


SYN = {"synthetic": {"task": "digit-sum"}}
FILES = {"trainFiles": ["/data/t.parquet"]}

# (id, manifest, CEL rules that must fail)
CASES = [
    # nnodes x gpusPerNode divisible by TP x PP x CP
    ("tp3-of-8", changed(gpu_job(), {M + "tensorModelParallelSize": 3}), {TP_GPUS}),
    ("tp2-pp2-cp4-of-8", changed(gpu_job(), {M + "tensorModelParallelSize": 2, M + "pipelineModelParallelSize": 2,
                                             M + "contextParallelSize": 4}), {CP_GPUS}),
    ("cp16-of-3x8", changed(gpu_job(), {"spec.nnodes": 3, M + "contextParallelSize": 16}), {CP_GPUS}),
    ("tp2-pp3-of-8", changed(gpu_job(), {M + "tensorModelParallelSize": 2, M + "pipelineModelParallelSize": 3}),
     {PP_GPUS}),
    ("defaults-8-gpus-tp16", minimal({"model": {"path": "/m"}, "data": FILES, "megatron": {"tensorModelParallelSize": 16}}),
     {TP_GPUS}),
    ("defaults-gpus-6-tp1", minimal({"model": {"path": "/m"}, "data": FILES, "gpusPerNode": 6}), set()),
    ("pp-over-two-nodes", changed(gpu_job(), {"spec.nnodes": 2, M + "pipelineModelParallelSize": 16}), set()),
    ("tp2-pp4-of-8", changed(gpu_job(), {M + "tensorModelParallelSize": 2, M + "pipelineModelParallelSize": 4,
                                         "spec.training.microBatchSizePerGpu": 64}), set()),
    # rollout TP divides gpusPerNode
    ("rollout-tp3-of-8", changed(gpu_job(), {R + "tensorModelParallelSize": 3}), {ROLLOUT}),
    ("rollout-tp16-over-nodes", changed(gpu_job(), {"spec.nnodes": 2, R + "tensorModelParallelSize": 16}), {ROLLOUT}),
    ("defaults-rollout-tp16", minimal({"model": {"path": "/m"}, "data": FILES, "rollout": {"tensorModelParallelSize": 16}}),
     {ROLLOUT}),
    ("defaults-rollout-tp4", minimal({"model": {"path": "/m"}, "data": FILES, "rollout": {"tensorModelParallelSize": 4}}),
     set()),
    ("rollout-tp8-of-8", changed(gpu_job(), {R + "tensorModelParallelSize": 8}), set()),
    # sequence parallel needs TP > 1
    ("sp-tp1", changed(gpu_job(), {M + "sequenceParallel": True}), {SP}),
    ("sp-default-tp", minimal({"model": {"path": "/m"}, "data": FILES, "megatron": {"sequenceParallel": True}}), {SP}),
    ("sp-tp2", changed(gpu_job(), {M + "sequenceParallel": True, M + "tensorModelParallelSize": 2}), set()),
    ("no-sp-tp1", changed(gpu_job(), {M + "sequenceParallel": False}), set()),
    # VPP needs PP >= 2
    ("vpp-pp1", changed(gpu_job(), {M + "virtualPipelineModelParallelSize": 2, M + "pipelineModelParallelSize": 1}), {VPP}),
    ("vpp-default-pp", changed(gpu_job(), {M + "virtualPipelineModelParallelSize": 2}), {VPP}),
    ("vpp-pp2", changed(gpu_job(), {M + "virtualPipelineModelParallelSize": 2, M + "pipelineModelParallelSize": 2}), set()),
    # exactly one of trainFiles and synthetic
    ("both-data", changed(gpu_job(), {"spec.data.synthetic": {"task": "digit-sum"}}), {DATA}),
    ("neither-data", changed(gpu_job(), {"spec.data.trainFiles": DELETE}), {DATA}),
    ("empty-files-no-synthetic", changed(gpu_job(), {"spec.data.trainFiles": []}), {DATA}),
    ("no-data-section", changed(gpu_job(), {"spec.data": DELETE}), {DATA}),
    ("synthetic-only", changed(gpu_job(), {"spec.data": SYN}), set()),
    ("synthetic-with-empty-files", changed(gpu_job(), {"spec.data": {**SYN, "trainFiles": []}}), set()),
    # algorithm sft <-> spec.sft
    ("sft-without-section", changed(gpu_job(), {"spec.algorithm.name": "sft"}), {SFT}),
    ("sft-section-under-grpo", changed(gpu_job(), {"spec.sft": {"format": "tokenized"}}), {SFT}),
    # GSPO (importanceLevel sequence) refuses token-mean, the default aggregation
    ("gspo-default-aggregation", changed(gpu_job(), {"spec.algorithm.importanceLevel": "sequence"}), {GSPO}),
    ("gspo-token-mean", changed(gpu_job(), {"spec.algorithm.importanceLevel": "sequence",
                                            "spec.algorithm.lossAggregation": "token-mean"}), {GSPO}),
    ("gspo-minimal", minimal({"model": {"path": "/m"}, "data": FILES, "algorithm": {"importanceLevel": "sequence"}}),
     {GSPO}),
    ("gspo-seq-mean", changed(gpu_job(), {"spec.algorithm.importanceLevel": "sequence",
                                          "spec.algorithm.lossAggregation": "seq-mean-token-mean"}), set()),
    ("gspo-dr-grpo", changed(gpu_job(), {"spec.algorithm.importanceLevel": "sequence",
                                         "spec.algorithm.lossAggregation": "seq-mean-token-sum-norm"}), {GSPO}),
    ("token-level-token-mean", changed(gpu_job(), {"spec.algorithm.importanceLevel": "token"}), set()),
    # resumeMode uri needs resumeFrom
    ("resume-uri-no-from", changed(gpu_job(), {"spec.checkpoint.resumeMode": "uri"}), {RESUME}),
    ("resume-uri-with-from", changed(gpu_job(), {"spec.checkpoint.resumeMode": "uri",
                                                 "spec.checkpoint.resumeFrom": "/ckpt/step_000010"}), set()),
    ("resume-auto", changed(gpu_job(), {"spec.checkpoint.resumeMode": "auto"}), set()),
    # gae <-> spec.critic (sft takes neither)
    ("gae-no-critic", changed(gpu_job(), GAE), {CRITIC}),
    ("critic-under-grpo", changed(gpu_job(), {"spec.critic": {}}), {CRITIC}),
    ("gae-critic", changed(gpu_job(), {**GAE, "spec.critic": {}}), set()),
    ("gae-critic-defaults-only", minimal({"model": {"path": "/m"}, "data": FILES, "algorithm": {"advantageEstimator": "gae"},
                                          "critic": {}}), set()),
    # split pools: critic.gpus with split only, below gpusPerNode; the actor's pool fits its TP x PP x CP
    ("split-no-gpus", changed(gpu_job(), {**GAE, "spec.critic": {"placement": "split"}}), {CRITIC_GPUS}),
    ("shared-with-gpus", changed(gpu_job(), {**GAE, "spec.critic": {"gpus": 2}}), {CRITIC_GPUS}),
    ("split-whole-node", changed(gpu_job(), {**GAE, "spec.critic": {"placement": "split", "gpus": 8}}),
     {CRITIC_GPUS}),
    ("split-actor-6-tp4", changed(gpu_job(), {**GAE, M + "tensorModelParallelSize": 4,
                                              "spec.critic": {"placement": "split", "gpus": 2}}), {TP_GPUS}),
    ("split-4-4-rollout-tp8", changed(gpu_job(), {**GAE, R + "tensorModelParallelSize": 8,
                                                  "spec.critic": {"placement": "split", "gpus": 4}}), {ROLLOUT}),
    ("split-critic-4-tp8", changed(gpu_job(), {**GAE, "spec.critic": {"placement": "split", "gpus": 4,
                                                                       "megatron": {"tensorModelParallelSize": 8}}}),
     {CRITIC_TP}),
    ("shared-critic-tp8", changed(gpu_job(), {**GAE, "spec.critic": {"megatron": {"tensorModelParallelSize": 8}}}),
     set()),
    ("split-4-4-tp4", changed(gpu_job(), {**GAE, M + "tensorModelParallelSize": 4, R + "tensorModelParallelSize": 4,
                                          "spec.critic": {"placement": "split", "gpus": 4,
                                                          "megatron": {"tensorModelParallelSize": 4}}}), set()),
    # outputLayerIndex needs critic PP 1; the critic's SP / VPP rules
    ("layer-with-pp2", changed(gpu_job(), {**GAE, "spec.critic": {"outputLayerIndex": 20,
                                                                   "megatron": {"pipelineModelParallelSize": 2}}}),
     {CRITIC_LAYER}),
    ("layer-with-pp1", changed(gpu_job(), {**GAE, "spec.critic": {"outputLayerIndex": 20}}), set()),
    ("critic-sp-tp1", changed(gpu_job(), {**GAE, "spec.critic": {"megatron": {"sequenceParallel": True}}}), {CRITIC_SP}),
    ("critic-vpp-pp1", changed(gpu_job(), {**GAE, "spec.critic": {"megatron": {"virtualPipelineModelParallelSize": 2}}}),
     {CRITIC_VPP}),
    # several at once
    ("all-rules-at-once", changed(gpu_job(), {
        M + "tensorModelParallelSize": 3, R + "tensorModelParallelSize": 3, M + "virtualPipelineModelParallelSize": 2,
        "spec.data.synthetic": {"task": "digit-sum"}, "spec.checkpoint.resumeMode": "uri"}),
     {TP_GPUS, ROLLOUT, VPP, DATA, RESUME}),
]


@pytest.mark.parametrize("doc, failing", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cel_rule(doc, failing):
    assert set(cel_failures(doc)) == failing


def cel_covered_pydantic_paths(doc) -> set[str]:
    """Which CEL rules pydantic's errors correspond to (errors of rules CEL does not express are ignored)."""
    paths = {e.path for e in errors_of(doc)}
    return {rule for rule, mine in PYDANTIC_PATHS.items() if paths & mine}


@pytest.mark.parametrize("doc, failing", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_pydantic_agrees_on_cel_cases(doc, failing):
    assert cel_covered_pydantic_paths(doc) == failing


ALL_CROSS = CROSS_INVALID + [(name, changes, {}) for name, changes in CROSS_VALID]


@pytest.mark.parametrize("changes", [c[1] for c in ALL_CROSS], ids=[c[0] for c in ALL_CROSS])
def test_cel_and_pydantic_agree_on_cross_field_table(changes):
    doc = changed(gpu_job(), changes)
    assert set(cel_failures(doc)) == cel_covered_pydantic_paths(doc)


def test_cel_and_pydantic_agree_on_a_grid_of_parallel_layouts():
    """Random layouts (fixed seed): CEL rejects exactly what pydantic rejects for the rules both express."""
    rng = random.Random(20240601)
    grid = list(itertools.product([1, 2, 3], [1, 2, 3, 4, 6, 8], [1, 2, 3, 4, 8], [1, 2, 4], [1, 2],
                                  [1, 2, 3, 4, 8], [False, True], [None, 2]))
    disagreements = []
    for nnodes, gpus, tp, pp, cp, rollout_tp, sp, vpp in rng.sample(grid, 100):
        megatron = {"tensorModelParallelSize": tp, "pipelineModelParallelSize": pp, "contextParallelSize": cp,
                    "sequenceParallel": sp}
        if vpp:
            megatron["virtualPipelineModelParallelSize"] = vpp
        doc = changed(gpu_job(), {"spec.nnodes": nnodes, "spec.gpusPerNode": gpus, "spec.megatron": megatron,
                                  R + "tensorModelParallelSize": rollout_tp})
        cel, pyd = set(cel_failures(doc)), cel_covered_pydantic_paths(doc)
        if cel != pyd:
            disagreements.append((nnodes, gpus, tp, pp, cp, rollout_tp, sp, vpp, sorted(cel), sorted(pyd)))
    assert not disagreements, disagreements[:5]


def test_cel_and_pydantic_agree_on_a_grid_of_critic_layouts():
    """Random PPO layouts (fixed seed): placement, critic GPUs, both pools' TP / PP, outputLayerIndex, rollout TP."""
    rng = random.Random(20261126)
    grid = list(itertools.product([1, 2], [2, 4, 8], ["shared", "split"], [None, 1, 2, 4, 8], [1, 2, 4], [1, 2, 4],
                                  [1, 2], [None, 20], [1, 2, 4]))
    disagreements = []
    for nnodes, gpus, placement, critic_gpus, tp, ctp, cpp, layer, rollout_tp in rng.sample(grid, 150):
        critic = {"placement": placement, "megatron": {"tensorModelParallelSize": ctp, "pipelineModelParallelSize": cpp},
                  "microBatchSizePerGpu": 1}
        if critic_gpus is not None:
            critic["gpus"] = critic_gpus
        if layer is not None:
            critic["outputLayerIndex"] = layer
        doc = changed(gpu_job(), {**GAE, "spec.nnodes": nnodes, "spec.gpusPerNode": gpus, M + "tensorModelParallelSize": tp,
                                  R + "tensorModelParallelSize": rollout_tp, "spec.critic": critic,
                                  "spec.training.microBatchSizePerGpu": 1})
        cel, pyd = set(cel_failures(doc)), cel_covered_pydantic_paths(doc)
        if cel != pyd:
            disagreements.append((nnodes, gpus, placement, critic_gpus, tp, ctp, cpp, layer, rollout_tp,
                                  sorted(cel), sorted(pyd)))
    assert not disagreements, disagreements[:5]


def test_cel_check_can_fail():
    """A rule that lost its default fallback (reads self.megatron.tensorModelParallelSize unguarded) errors on
    a manifest without megatron, and errors count as failures."""
    import celpy

    env = celpy.Environment()
    program = env.program(env.compile("self.gpusPerNode % self.megatron.tensorModelParallelSize == 0"))
    spec = celpy.json_to_cel({"gpusPerNode": 8})
    with pytest.raises(Exception):  # noqa: B017  (celpy's CELEvalError)
        result = program.evaluate({"self": spec})
        if isinstance(result, Exception):
            raise result
