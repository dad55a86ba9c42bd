"""Generate the RLJob CustomResourceDefinition from the pydantic models.

The API server needs a *structural* schema: no $ref, no anyOf-with-null, booleans
for exclusive bounds. `structural_schema` rewrites pydantic's JSON Schema into one;
`build_crd` adds printer columns, the status subresource and CEL rules for the
cross-field checks the API server can evaluate itself (the operator checks the rest).
`crds/rljob.dev_rljobs.yaml` is this output; a test fails when they drift.
"""
from __future__ import annotations

import copy
from enum import Enum
from typing import Any

import yaml

from rljob_api.models import (
    CATEGORIES,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    AlgorithmSpec,
    CheckpointSpec,
    MegatronSpec,
    RLJob,
    RLJobSpec,
    RLJobStatus,
)

_DROP_KEYS = {"title", "default", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline $refs and rewrite JSON Schema idioms into Kubernetes' structural dialect."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])
        # The field's own description wins over the referenced type's docstring.
        target.pop("description", None)
        target.update(node)
        node = target
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express anyOf {any_of} structurally")
        inner = copy.deepcopy(non_null[0])
        if "$ref" in inner:
            inner = _resolve(inner, defs)
            inner.pop("description", None)
        inner.update(node)
        node = inner
        if len(non_null) < len(any_of):
            node["nullable"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[flag] = node.pop(bound)
            node[bound] = True
    if node.get("additionalProperties") is False:
        # The API server forbids properties + additionalProperties together; it prunes unknown
        # fields instead, and `kubectl apply` (strict field validation) reports them.
        del node["additionalProperties"]
    if node.get("x-kubernetes-preserve-unknown-fields"):
        node.pop("additionalProperties", None)
    elif node.get("type") == "object" and node.get("additionalProperties") is True:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "description" in node and "default" in node and _describable(node["default"]):
        node["description"] = f"{node['description'].rstrip()} Default: {_show(node['default'])}."
    for key in list(node):
        if key in _DROP_KEYS:
            del node[key]
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    for key in ("properties", "additionalProperties", "items"):
        if key in node and isinstance(node[key], dict):
            if key == "properties":
                node[key] = {k: _resolve(v, defs) for k, v in node[key].items()}
            else:
                node[key] = _resolve(node[key], defs)
    return node


def _describable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, Enum)) and value != ""


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def structural_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _resolve(raw, defs)


# ---- CEL rules: cross-field checks expressed for the API server. Defaults are read from
# the models so the CEL and pydantic cannot disagree about an omitted field.

def _get(path: str, default: Any) -> str:
    """CEL for `self.a.b` falling back to the model default when any part is omitted."""
    parts = path.split(".")
    guards = " && ".join("has(self." + ".".join(parts[: i + 1]) + ")" for i in range(len(parts)))
    lit = repr(default) if not isinstance(default, bool) else str(default).lower()
    return f"(({guards}) ? self.{path} : {lit})"


def _default(model: type, field: str) -> Any:
    return model.model_fields[field].default


def spec_cel_rules() -> list[dict[str, str]]:
    spec_default = lambda f: _default(RLJobSpec, f)
    meg = lambda f: _default(MegatronSpec, f)
    alg = lambda f: _default(AlgorithmSpec, f)
    nnodes = _get("nnodes", spec_default("nnodes"))
    gpus = _get("gpusPerNode", spec_default("gpus_per_node"))
    tp = _get("megatron.tensorModelParallelSize", meg("tensor_model_parallel_size"))
    pp = _get("megatron.pipelineModelParallelSize", meg("pipeline_model_parallel_size"))
    cp = _get("megatron.contextParallelSize", meg("context_parallel_size"))
    rollout_tp = _get("rollout.tensorModelParallelSize", 1)
    # A split critic takes critic.gpus of every node; the actor and the rollout engine run on the rest.
    placement_split = "(has(self.critic) && has(self.critic.placement) && self.critic.placement == 'split')"
    split = f"({placement_split} && has(self.critic.gpus) && self.critic.gpus < {gpus})"  # else rule .critic.gpus fails
    # A separate rollout pool takes rollout.gpus of every node too (when that leaves the trainer no GPU the
    # rollout.gpus rule fails and the sizes are checked against the whole node, as pydantic does).
    placement_separate = f"({_get('rollout.placement', 'colocated')} == 'separate')"
    separate = f"({placement_separate} && has(self.rollout.gpus))"
    trainer_gpus = f"(({split} ? {gpus} - self.critic.gpus : {gpus}) - ({separate} ? self.rollout.gpus : 0))"
    actor_gpus = f"({trainer_gpus} > 0 ? {trainer_gpus} : {gpus})"
    critic_gpus = f"({split} ? self.critic.gpus : {gpus})"
    ctp = _get("critic.megatron.tensorModelParallelSize", meg("tensor_model_parallel_size"))
    cpp = _get("critic.megatron.pipelineModelParallelSize", meg("pipeline_model_parallel_size"))
    ccp = _get("critic.megatron.contextParallelSize", meg("context_parallel_size"))
    gae = "(has(self.algorithm) && has(self.algorithm.advantageEstimator) && self.algorithm.advantageEstimator == 'gae')"
    sft = "(has(self.algorithm) && has(self.algorithm.name) && self.algorithm.name == 'sft')"
    no_critic_pool = f"(!has(self.critic) || ({placement_split} && !{split}))"  # no critic, or .critic.gpus fails
    return [
        # One rule per size, so the error names the size that breaks divisibility (as pydantic does).
        {
            "rule": f"({nnodes} * {actor_gpus}) % {tp} == 0",
            "message": "nnodes x gpusPerNode (minus a split critic's critic.gpus and a separate rollout pool's rollout.gpus per node) must be divisible by "
                       "megatron TP x PP x CP; TP (tensorModelParallelSize) alone does not divide it",
            "fieldPath": ".megatron.tensorModelParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"({nnodes} * {actor_gpus}) % {tp} != 0 || ({nnodes} * {actor_gpus}) % ({tp} * {pp}) == 0",
            "message": "nnodes x gpusPerNode (minus a split critic's critic.gpus and a separate rollout pool's rollout.gpus per node) must be divisible by "
                       "megatron TP x PP x CP; TP x PP (pipelineModelParallelSize) does not divide it",
            "fieldPath": ".megatron.pipelineModelParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"(({nnodes} * {actor_gpus}) % ({tp} * {pp}) != 0 || "
                    f"({nnodes} * {actor_gpus}) % ({tp} * {pp} * {cp}) == 0) && "
                    f"(({nnodes} * {actor_gpus}) % ({tp} * {pp} * {cp}) != 0 || {cp} == 1 || {pp} == 1)",
            "message": "nnodes x gpusPerNode (minus a split critic's critic.gpus and a separate rollout pool's rollout.gpus per node) must be divisible by "
                       "megatron TP x PP x CP, and contextParallelSize > 1 needs pipelineModelParallelSize 1; TP x PP "
                       "x CP (contextParallelSize) does not divide it, or CP and PP are both above 1",
            "fieldPath": ".megatron.contextParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"{placement_separate} ? {rollout_tp} == 1 : ({gpus} % {rollout_tp} == 0 && "
                    f"{actor_gpus} % {rollout_tp} == 0)",
            "message": "rollout.tensorModelParallelSize must divide gpusPerNode (and the actor's GPUs per node with a "
                       "split critic), and be 1 with rollout.placement separate (one engine per rollout GPU)",
            "fieldPath": ".rollout.tensorModelParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"{_get('rollout.mode', 'sync')} == 'sync' || ({placement_separate} && !has(self.rollout.agent))",
            "message": "rollout.mode one-step and async generate while the trainer trains, which needs GPUs that do "
                       "not train: set rollout.placement: separate and rollout.gpus, or mode: sync (the agent loop "
                       "runs with mode sync only)",
            "fieldPath": ".rollout.mode",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"{placement_separate} ? (has(self.rollout.gpus) && self.rollout.gpus + ({placement_split} && "
                    f"has(self.critic.gpus) ? self.critic.gpus : 0) < {gpus}) : !(has(self.rollout) && has(self.rollout.gpus))",
            "message": "rollout.placement separate needs rollout.gpus, the rollout pool's GPUs per node, leaving the "
                       "trainer at least one GPU (with a split critic's critic.gpus); without it rollout.gpus is unused",
            "fieldPath": ".rollout.gpus",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"!{_get('megatron.sequenceParallel', False)} || {tp} > 1",
            "message": "megatron.sequenceParallel needs tensorModelParallelSize > 1",
            "fieldPath": ".megatron.sequenceParallel",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"!has(self.megatron) || !has(self.megatron.virtualPipelineModelParallelSize) || {pp} >= 2",
            "message": "megatron.virtualPipelineModelParallelSize needs pipelineModelParallelSize >= 2",
            "fieldPath": ".megatron.virtualPipelineModelParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"{_get('algorithm.name', alg('name').value)} == 'sft' || "
                    f"{_get('algorithm.importanceLevel', alg('importance_level').value)} != 'sequence' || "
                    f"{_get('algorithm.lossAggregation', alg('loss_aggregation').value)} == 'seq-mean-token-mean'",
            "message": "algorithm.importanceLevel sequence (GSPO) needs a sequence-level lossAggregation: set "
                       "spec.algorithm.lossAggregation: seq-mean-token-mean (token-mean and the token sums weight "
                       "responses by length)",
            "fieldPath": ".algorithm.lossAggregation",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "(has(self.algorithm) && has(self.algorithm.name) && self.algorithm.name == 'sft') == "
                    "has(self.sft)",
            "message": "algorithm.name sft needs the spec.sft section, and spec.sft is only for algorithm.name sft",
            "fieldPath": ".sft",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "(has(self.data) && ((has(self.data.trainFiles) && size(self.data.trainFiles) > 0) != "
                    "(has(self.data.synthetic))))",
            "message": "set exactly one of data.trainFiles and data.synthetic",
            "fieldPath": ".data",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"has(self.critic) ? ({gae} && !{sft}) : (!{gae} || {sft})",
            "message": "algorithm.advantageEstimator gae needs spec.critic, and spec.critic is only for gae",
            "fieldPath": ".critic",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"!has(self.critic) || ({placement_split} == has(self.critic.gpus) && "
                    f"(!has(self.critic.gpus) || self.critic.gpus < {gpus}))",
            "message": "critic.gpus is required by (and only used by) placement split, and must be below gpusPerNode",
            "fieldPath": ".critic.gpus",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"{no_critic_pool} || ({nnodes} * {critic_gpus}) % {ctp} == 0",
            "message": "the critic's GPUs (nnodes x critic.gpus when split, else nnodes x gpusPerNode) must be "
                       "divisible by critic megatron TP x PP x CP; its TP alone does not divide them",
            "fieldPath": ".critic.megatron.tensorModelParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"{no_critic_pool} || ({nnodes} * {critic_gpus}) % {ctp} != 0 || "
                    f"({nnodes} * {critic_gpus}) % ({ctp} * {cpp}) == 0",
            "message": "the critic's GPUs must be divisible by critic megatron TP x PP x CP; its TP x PP does not "
                       "divide them",
            "fieldPath": ".critic.megatron.pipelineModelParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"{no_critic_pool} || ((({nnodes} * {critic_gpus}) % ({ctp} * {cpp}) != 0 || "
                    f"({nnodes} * {critic_gpus}) % ({ctp} * {cpp} * {ccp}) == 0) && "
                    f"(({nnodes} * {critic_gpus}) % ({ctp} * {cpp} * {ccp}) != 0 || {ccp} == 1 || {cpp} == 1))",
            "message": "the critic's GPUs must be divisible by critic megatron TP x PP x CP, and its "
                       "contextParallelSize > 1 needs its pipelineModelParallelSize 1; its TP x PP x CP does not "
                       "divide them, or its CP and PP are both above 1",
            "fieldPath": ".critic.megatron.contextParallelSize",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"!has(self.critic) || !has(self.critic.outputLayerIndex) || {cpp} == 1",
            "message": "critic.outputLayerIndex needs critic megatron.pipelineModelParallelSize 1",
            "fieldPath": ".critic.outputLayerIndex",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": f"!{_get('critic.megatron.sequenceParallel', False)} || {ctp} > 1",
            "message": "critic megatron.sequenceParallel needs its tensorModelParallelSize > 1",
            "fieldPath": ".critic.megatron.sequenceParallel",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "!has(self.critic) || !has(self.critic.megatron) || "
                    f"!has(self.critic.megatron.virtualPipelineModelParallelSize) || {cpp} >= 2",
            "message": "critic megatron.virtualPipelineModelParallelSize needs its pipelineModelParallelSize >= 2",
            "fieldPath": ".critic.megatron.virtualPipelineModelParallelSize",
            "reason": "FieldValueInvalid",
        },
    ]


def checkpoint_cel_rules() -> list[dict[str, str]]:
    assert _default(CheckpointSpec, "resume_mode").value == "auto"
    return [{
        "rule": "!has(self.resumeMode) || self.resumeMode != 'uri' || has(self.resumeFrom)",
        "message": "checkpoint.resumeMode uri needs checkpoint.resumeFrom",
        "fieldPath": ".resumeFrom",
        "reason": "FieldValueRequired",
    }]


PRINTER_COLUMNS = [
    {"name": "Step", "type": "integer", "jsonPath": ".status.trainer.step"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.trainer.rewardMean"},
    {"name": "Running", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Running")].status'},
    {"name": "Succeeded", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Succeeded")].status'},
    # Kueue's admission (Queued / Admitted / Suspended); empty for a job in no queue.
    {"name": "Queue", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Admitted")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.trainer.lastCheckpoint.step", "priority": 1},
    {"name": "Progress", "type": "string", "jsonPath": ".status.trainer.progressPercentage", "priority": 1},
    # The first tracker run's URL (MLflow, else W&B), set once the worker has opened it.
    {"name": "Tracker", "type": "string", "jsonPath": ".status.trainer.trackerRuns[0].url", "priority": 1},
]


def openapi_schema() -> dict[str, Any]:
    spec = structural_schema(RLJobSpec)
    # A model class without a docstring has no description of its own: use the RLJob field's.
    spec["description"] = RLJob.model_fields["spec"].description
    spec["x-kubernetes-validations"] = spec_cel_rules()
    spec["properties"]["checkpoint"]["x-kubernetes-validations"] = checkpoint_cel_rules()
    status = structural_schema(RLJobStatus)
    status["description"] = RLJob.model_fields["status"].description
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["items"]["required"] = ["type", "status", "reason"]
    status["properties"]["conditions"]["maxItems"] = 16
    return {
        "type": "object",
        "description": "RLJob runs RL post-training (GRPO) of a language model on megatron-core with a colocated "
                       "rollout engine, as a Kubeflow PyTorchJob.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "rljob.dev/v1alpha1"},
            "kind": {"type": "string", "description": "RLJob"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "rljob", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": CATEGORIES,
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated from operator/rljob_api/models.py by `rljob crd`; do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
