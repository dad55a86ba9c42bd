"""String enums shared by the API, the operator and the worker's algorithm functions.

Each value is what users write in YAML; the worker selects algorithm functions by them.
"""
from enum import Enum


class StrEnum(str, Enum):
    def __str__(self) -> str:  # so f-strings and YAML dumps show the bare value
        return self.value


class AlgorithmName(StrEnum):
    GRPO = "grpo"
    SFT = "sft"  # supervised fine-tuning (spec.sft): masked next-token NLL, no rollout


class SFTDataFormat(StrEnum):
    TOKENIZED = "tokenized"  # parquet columns input_ids, attention_mask, labels (-100: no loss)
    PROMPT_RESPONSE = "prompt-response"  # text columns data.promptKey + sft.responseKey, loss on the response
    MESSAGES = "messages"  # chat message lists (multi-turn), loss on assistant turns


class ToolCallFormat(StrEnum):
    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3)
    BARE = "bare"  # <tool_call>TEXT</tool_call>, TEXT the input of the job's only tool (tiny models)


class LoraTarget(StrEnum):
    """megatron-core's linear layers a LoRA adapter may wrap (HF names: what PEFT calls the same weights)."""
    LINEAR_QKV = "linear_qkv"  # q_proj, k_proj, v_proj (fused: one adapter input for the three)
    LINEAR_PROJ = "linear_proj"  # o_proj
    LINEAR_FC1 = "linear_fc1"  # gate_proj, up_proj (fused SwiGLU input)
    LINEAR_FC2 = "linear_fc2"  # down_proj


class LRSchedule(StrEnum):
    CONSTANT = "constant"  # linear warm-up, then the peak lr
    COSINE = "cosine"  # linear warm-up, then cosine decay to lr x minLrRatio at the last step


class AdvantageEstimator(StrEnum):
    GRPO = "grpo"  # group mean baseline, optional std normalisation
    RLOO = "rloo"  # leave-one-out group mean baseline
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"  # batch-normalised returns, no group baseline
    GAE = "gae"  # PPO: generalised advantage estimation against a learned value model (spec.critic)


class CriticPlacement(StrEnum):
    SHARED = "shared"  # actor and critic take turns on the same GPUs
    SPLIT = "split"  # the critic trains on its own GPUs (critic.gpus of each node), overlapping the actor


class KLEstimator(StrEnum):
    K1 = "k1"  # log(pi/ref)
    K2 = "k2"  # 0.5 * log(pi/ref)^2
    K3 = "k3"  # ref/pi - log(ref/pi) - 1 (Schulman's unbiased, non-negative)
    LOW_VAR_KL = "low_var_kl"  # k3 clamped to [-10, 10], as verl


class KLPlacement(StrEnum):
    LOSS = "loss"  # add coef * KL to the policy loss (GRPO paper)
    REWARD = "reward"  # subtract coef * KL from token rewards (PPO-style)


class LossAggregation(StrEnum):
    TOKEN_MEAN = "token-mean"  # mean over all response tokens of the batch (DAPO)
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # per-sequence mean, then mean over sequences (GRPO paper)
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"  # per-sequence sum / max length (Dr.GRPO)


class ImportanceLevel(StrEnum):
    TOKEN = "token"  # PPO / GRPO token-level ratio
    SEQUENCE = "sequence"  # GSPO: length-normalised sequence-level ratio


class ChildKind(StrEnum):
    """The workload object the operator creates for an RLJob (see README, "Child kinds")."""

    PYTORCHJOB = "PyTorchJob"  # Kubeflow training-operator v1: one Master, nnodes-1 Workers
    JOBSET = "JobSet"  # jobset.x-k8s.io/v1alpha2: a `trainer` replicatedJob (Indexed Job of nnodes pods)


class WhitenScope(StrEnum):
    BATCH = "batch"  # one mean and std over every response token of the step's batch (verl)
    MINI_BATCH = "mini-batch"  # over each mini-batch's response tokens, just before its update


class RolloutEngine(StrEnum):
    VLLM = "vllm"
    HF = "hf"
    AUTO = "auto"  # by measurement: see RolloutSpec.engine and rollout.base.resolve_engine_name


class RolloutRanks(StrEnum):
    """Which ranks sample with the hf engines (vLLM always samples on every rollout-TP group)."""

    AUTO = "auto"  # every-rank on GPUs, rank0 on CPU
    RANK0 = "rank0"  # global rank 0 samples the whole batch and broadcasts it
    EVERY_RANK = "every-rank"  # each rank holds the whole model and samples its share of the prompt groups


class RolloutPlacement(StrEnum):
    """Where the rollout engines run."""

    COLOCATED = "colocated"  # on the trainer's GPUs, taking turns with training
    SEPARATE = "separate"  # on rollout.gpus of each node of their own, which never train


class RolloutMode(StrEnum):
    """How far generation may run ahead of training (separate placement)."""

    SYNC = "sync"  # generate batch k with the policy of step k, then train it
    ONE_STEP = "one-step"  # batch k+1 is generated while batch k trains (one version behind)
    ASYNC = "async"  # up to rollout.maxStaleness batches generated ahead of the trainer


class RolloutCompile(StrEnum):
    """Whether the static hf engine compiles its decode step (not on/off: YAML 1.1 reads those as booleans)."""

    AUTO = "auto"  # on CUDA, not on CPU
    ENABLED = "enabled"
    DISABLED = "disabled"


class ResumeMode(StrEnum):
    AUTO = "auto"
    DISABLE = "disable"
    URI = "uri"  # resume from checkpoint.resumeFrom


class RecomputeGranularity(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class RecomputeMethod(StrEnum):
    UNIFORM = "uniform"
    BLOCK = "block"


class ModelDType(StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class PromptOverflow(StrEnum):
    FILTER = "filter"  # drop prompts longer than data.maxPromptLength (counted and reported)
    TRUNCATE_LEFT = "truncate-left"
    TRUNCATE_RIGHT = "truncate-right"
    ERROR = "error"


class RemoteProtocol(StrEnum):
    """How spec.reward.remote talks to its endpoint."""

    HTTP_JSON = "http-json"  # POST {"samples": [...]} -> {"scores": [...]}, in order
    OPENAI_CHAT = "openai-chat"  # one /v1/chat/completions call per sample with the judge's prompt template


class RemoteFailurePolicy(StrEnum):
    """What a sample whose remote scoring failed after every retry becomes."""

    FAIL = "fail"  # the step fails with a one-line error
    ZERO = "zero"  # the sample is scored 0
    DROP_GROUP = "drop-group"  # the sample's prompt group gets zero advantages (no gradient) and leaves the metrics


class JudgeScoreRule(StrEnum):
    """How an LLM judge's reply becomes a number in [0, 1]."""

    SCORE_TAG = "score-tag"  # the number inside the last <score>...</score>
    LAST_NUMBER = "last-number"  # the last number in the reply
