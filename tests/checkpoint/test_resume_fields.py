"""Every spec field, classified by what a change of it on resume does: the run resumes, the checkpoint
reshards into the new parallel layout, or the changed-spec guard stops the run (RESUME_FIXED_FIELDS).
A field added to the API fails here until it is classified."""
from __future__ import annotations

import functools
import types
import typing

import pytest
from pydantic import BaseModel
from rljob_api.models import RLJobSpec
from rljob_worker.checkpoint.run_checkpoints import RESUME_FIXED_FIELDS, resume_fixed_fields

STOPS = {  # what the weights mean, the objective, the data order
    "model.path", "model.tokenizerPath", "model.dtype",
    "data.trainFiles", "data.synthetic.task", "data.synthetic.numPrompts", "data.promptKey",
    "data.maxPromptLength", "data.promptOverflow", "data.applyChatTemplate", "data.shuffle",
    "algorithm.name", "algorithm.advantageEstimator", "algorithm.gamma", "algorithm.lambda",
    "algorithm.normAdvByStd", "algorithm.whitenScope", "algorithm.clipRatioLow", "algorithm.clipRatioHigh",
    "algorithm.dualClipC", "algorithm.importanceLevel", "algorithm.klCoef", "algorithm.klEstimator",
    "algorithm.klPlacement", "algorithm.entropyCoeff", "algorithm.lossAggregation", "algorithm.dynamicSampling",
    "algorithm.maxRefillBatches", "algorithm.overlongBuffer.enable", "algorithm.overlongBuffer.length",
    "algorithm.overlongBuffer.penaltyFactor", "algorithm.rolloutCorrection.tokenTruncation",
    "algorithm.rolloutCorrection.sequenceMasking", "algorithm.rolloutCorrection.threshold",
    "algorithm.rolloutCorrection.sequenceMaskingThreshold", "algorithm.routingReplay",
    "sft.format", "sft.responseKey", "sft.messagesKey", "sft.maxLength", "sft.overflow", "sft.lossOnPromptTokens",
    "sft.packing",
    "rollout.samplesPerPrompt",
    "training.trainBatchSizePerNode", "training.seed",
    "megatron.overrideTransformerConfig",
    "critic.model.path", "critic.outputLayerIndex", "critic.cliprangeValue", "critic.megatron.overrideTransformerConfig",
    *(f"{p}lora.{f}" for p in ("", "critic.") for f in ("rank", "alpha", "targetModules")),
}
RESHARDS = {  # megatron distributed checkpoints load into any layout
    "nnodes", "gpusPerNode", "device", "critic.placement", "critic.gpus",
    *(f"{p}megatron.{f}" for p in ("", "critic.") for f in (
        "tensorModelParallelSize", "pipelineModelParallelSize", "virtualPipelineModelParallelSize",
        "contextParallelSize", "expertModelParallelSize", "expertTensorParallelSize", "sequenceParallel",
        "useDistributedOptimizer")),
}
RESUMES = {  # schedules, validation, engines, rewards, storage, cluster settings
    "image", "imagePullPolicy", "suspend", "model.gradientCheckpointing", "model.trustRemoteCode",
    "data.valFiles", "data.synthetic.numValPrompts", "data.maxResponseLength",
    "sft.lrSchedule", "sft.minLrRatio",
    "rollout.engine", "rollout.ranks", "rollout.temperature", "rollout.topP", "rollout.topK",
    "rollout.tensorModelParallelSize", "rollout.gpuMemoryUtilization", "rollout.freeCacheEngine",
    "rollout.enforceEager", "rollout.compile", "rollout.maxNumBatchedTokens", "rollout.logProbMicroBatchSizePerGpu",
    "rollout.valTemperature", "rollout.valN",
    # a separate rollout pool: no state of its own is saved (batches in flight are redrawn on resume), and the
    # trainer's GPUs it leaves are a parallel layout megatron's checkpoints reshard to
    "rollout.placement", "rollout.gpus", "rollout.mode", "rollout.maxStaleness", "rollout.partial",
    "training.ppoMiniBatchSizePerNode", "training.microBatchSizePerGpu", "training.maxTokensPerMicroBatch",
    "training.ppoEpochs", "training.lr", "training.lrWarmupSteps", "training.weightDecay", "training.gradClip",
    "training.totalEpochs", "training.totalTrainingSteps", "training.testFreq", "training.valBeforeTrain",
    *(f"{p}megatron.{f}" for p in ("", "critic.") for f in (
        "paramOffload", "gradOffload", "optimizerOffload", "recomputeGranularity", "recomputeMethod",
        "recomputeNumLayers")),
    "critic.lr", "critic.lrWarmupSteps", "critic.weightDecay", "critic.gradClip", "critic.ppoEpochs",
    "critic.microBatchSizePerGpu", "critic.warmupSteps",
    # adapter dropout acts in training only; the merged export is written at the end
    *(f"{p}lora.{f}" for p in ("", "critic.") for f in ("dropout", "exportMerged")),
    "reward.function", "reward.numWorkers", "reward.timeoutSeconds", "reward.bySource",
    # rewards may change like reward.function does: a remote verifier or judge, its client settings, its server
    *(f"reward.remote.{f}" for f in (
        "backoffSeconds", "batchSize", "concurrency", "headersSecretRef.headers", "headersSecretRef.name",
        "judge.maxTokens", "judge.model", "judge.promptTemplate", "judge.scoreRule", "judge.systemPrompt",
        "judge.temperature", "onFailure", "overlap", "protocol", "rateLimit", "retries", "timeoutSeconds", "url")),
    *(f"reward.server.{f}" for f in ("gpus", "image", "model", "readyTimeoutSeconds", "vllmArgs")),
    # the agent loop and its tools shape the next rollouts only, as temperature does; no state is kept
    "rollout.agent.maxTurns", "rollout.agent.maxToolCallsPerTurn", "rollout.agent.toolCallFormat", "tools",
    # the child kind and the experiment trackers say where the run lives and reports, not what it learns
    "childKind",
    *(f"tracking.mlflow.{f}" for f in (
        "experiment", "runName", "tokenSecretRef.key", "tokenSecretRef.name", "trackingUri")),
    "tracking.required",
    *(f"tracking.wandb.{f}" for f in (
        "apiKeySecretRef.key", "apiKeySecretRef.name", "entity", "mode", "project", "runName")),
    "checkpoint.uri", "checkpoint.saveFreq", "checkpoint.maxToKeep", "checkpoint.resumeMode",
    "checkpoint.resumeFrom", "checkpoint.exportHf", "checkpoint.exportCritic", "checkpoint.saveOnPreemption", "checkpoint.compileCache",
    "s3.endpoint", "s3.region", "s3.credentialsSecretRef.name", "s3.credentialsSecretRef.accessKeyIdKey",
    "s3.credentialsSecretRef.secretAccessKeyKey", "s3.addressingStyle",
    "metrics.enabled", "metrics.port", "metrics.podMonitor", "metrics.tensorboardDir",
    "runPolicy.backoffLimit", "runPolicy.activeDeadlineSeconds", "runPolicy.ttlSecondsAfterFinished",
    *(f"podTemplate.{f}" for f in (
        "resources", "nodeSelector", "tolerations", "volumes", "volumeMounts", "env", "labels", "annotations",
        "serviceAccountName", "imagePullSecrets", "priorityClassName", "schedulerName",
        "terminationGracePeriodSeconds", "shmSize")),
}


def spec_leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """camelCase paths of every leaf field, descending into nested (and optional) sections."""
    out = []
    for name, f in model.model_fields.items():
        path = prefix + (f.alias or name)
        ann = f.annotation
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        args = [a for a in typing.get_args(ann) if a is not type(None)] if union else [ann]
        sub = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        out += spec_leaves(sub[0], path + ".") if sub else [path]
    return out


LEAVES = spec_leaves(RLJobSpec)


def test_every_spec_field_is_classified_once():
    assert not (STOPS & RESHARDS) and not (STOPS & RESUMES) and not (RESHARDS & RESUMES)
    unclassified = sorted(set(LEAVES) - STOPS - RESHARDS - RESUMES)
    assert not unclassified, f"classify these spec fields (resumes, reshards or stops on resume): {unclassified}"
    gone = sorted((STOPS | RESHARDS | RESUMES) - set(LEAVES))
    assert not gone, f"no longer spec fields: {gone}"


def _guarded(path: str, recorded: dict) -> bool:
    return any(path == k or path.startswith(k + ".") for k in recorded)


@functools.cache
def _recorded() -> dict:
    """What a checkpoint records of a spec with every optional section set."""
    from rljob_api.models import CriticSpec, SFTSpec, SyntheticDataSpec

    spec = RLJobSpec.model_validate({"model": {"path": "/m"}})
    full = spec.model_copy(update={
        "critic": CriticSpec(), "sft": SFTSpec(),
        "data": spec.data.model_copy(update={"synthetic": SyntheticDataSpec(task="digit-sum")}),
    })
    return resume_fixed_fields(full.model_dump(mode="json", by_alias=True))


@pytest.mark.parametrize("path", LEAVES)
def test_the_guard_records_exactly_the_fields_that_stop_a_resume(path):
    """resume_fixed_fields covers a field iff the field is classified as stopping the resume."""
    recorded = _recorded()
    assert _guarded(path, recorded) == (path in STOPS), (
        f"{path}: classified as {'stops' if path in STOPS else 'resumes/reshards'} but the guard "
        f"{'records' if _guarded(path, recorded) else 'does not record'} it; RESUME_FIXED_FIELDS = {RESUME_FIXED_FIELDS}")
