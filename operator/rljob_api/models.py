"""RLJob v1alpha1: the pydantic models behind the CRD, the operator and the worker.

Python uses snake_case; YAML/JSON use camelCase (aliases). Every field carries a
description, which the generated CRD keeps so `kubectl explain rlj.spec...` helps.
Defaults follow the seed recipes (verl / siiRL / Trinity-RFT Megatron GRPO) where
they have one; the seed's own key is named in the description as "(verl: ...)".

Cross-field rules live in `rljob_api.validation`; `parse_rljob` there is the one
entry point that turns a dict into a validated `RLJob`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.alias_generators import to_camel

from rljob_api.enums import (
    AdvantageEstimator,
    AlgorithmName,
    ChildKind,
    CriticPlacement,
    ImportanceLevel,
    JudgeScoreRule,
    KLEstimator,
    KLPlacement,
    LoraTarget,
    LossAggregation,
    LRSchedule,
    ModelDType,
    PromptOverflow,
    RecomputeGranularity,
    RecomputeMethod,
    RemoteFailurePolicy,
    RemoteProtocol,
    ResumeMode,
    RolloutCompile,
    RolloutEngine,
    RolloutMode,
    RolloutPlacement,
    RolloutRanks,
    SFTDataFormat,
    ToolCallFormat,
    WhitenScope,
)

GROUP = "rljob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]
CATEGORIES = ["ml"]

# A storage URI: s3://bucket[/prefix], file:///abs/path or an absolute path on a mounted volume.
STORAGE_URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?|file:///.*|/.*)$"
# A model source additionally accepts builtin://NAME (a tiny model rljob builds from a shipped config).
MODEL_URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?|file:///.*|/.*|builtin://[a-z0-9\-]+)$"


class BuiltinShape(NamedTuple):
    """The numbers of a built-in model's config that the parallel sizes must fit (the worker refuses the rest at
    start-up)."""

    attention_heads: int  # megatron TP divides it, and so does a vLLM rollout's TP
    kv_heads: int  # megatron TP divides it
    layers: int  # PP x VPP divides it
    head_dim: int  # a vLLM rollout at TP > 1 needs at least VLLM_MIN_TP_HEAD_DIM
    experts: int = 0  # EP divides it; 0: a dense model (EP 1)


# The builtin://NAME models the worker builds, with their shapes (rljob_worker.data.builtin_models holds their
# configs; tests/worker/test_builtin_model_shapes.py keeps the two equal), here so that validation refuses an unknown
# name, and sizes the model cannot be split by, without the worker's dependencies.
BUILTIN_MODEL_SHAPES = {
    "tiny-qwen2": BuiltinShape(attention_heads=4, kv_heads=2, layers=2, head_dim=16),
    "tiny-qwen2-hd64": BuiltinShape(attention_heads=2, kv_heads=1, layers=2, head_dim=64),
    "tiny-qwen2-tools": BuiltinShape(attention_heads=4, kv_heads=2, layers=2, head_dim=16),
    "tiny-qwen3-moe": BuiltinShape(attention_heads=4, kv_heads=2, layers=2, head_dim=16, experts=4),
}
BUILTIN_MODEL_NAMES = tuple(BUILTIN_MODEL_SHAPES)
# the ones whose tokenizer has the tool-call tags as single tokens (rollout.agent: the engines stop a turn on
# </tool_call>); the same test keeps this equal to the worker's tokenizers
BUILTIN_TOOL_MODEL_NAMES = ("tiny-qwen2-tools",)
# the mixture-of-experts ones (algorithm.routingReplay)
BUILTIN_MOE_MODEL_NAMES = tuple(name for name, shape in BUILTIN_MODEL_SHAPES.items() if shape.experts)
# The narrowest attention head vLLM runs at rollout tensor-parallel > 1 (rljob_worker.rollout.vllm_engine's
# MIN_TP_HEAD_DIM, which the same test keeps equal).
VLLM_MIN_TP_HEAD_DIM = 64
# The built-in spec.reward.function names (rljob_worker.rewards.registry.BUILTIN_REWARDS holds the functions; a test
# keeps the two equal), here so that validation refuses an unknown name without the worker's dependencies.
BUILTIN_REWARD_NAMES = ("gsm8k", "math-boxed", "format", "target-token", "digit-sum", "tool-secret")
# module.path:function
REWARD_FUNCTION_PATTERN = r"^([a-z0-9][a-z0-9\-]*|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$"
S3_ENDPOINT_PATTERN = r"^https?://[^\s]+$"
SHM_SIZE_PATTERN = r"^[0-9]+(Ki|Mi|Gi|Ti)?$"
# The extended resource the operator sets from spec.gpusPerNode on every training pod of a device gpu job.
GPU_RESOURCE = "nvidia.com/gpu"
TOOL_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_\-]*$"
TOOL_FUNCTION_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
# An http(s) endpoint without credentials in it (those come from headersSecretRef).
REMOTE_URL_PATTERN = r"^https?://[^\s/@]+(/[^\s]*)?$"


def _quantity(value: Any) -> Any:
    """A resource quantity as Kubernetes accepts it in a manifest: a string ("500m", "64Gi") or an integer.

    Integers are kept as strings so consumers see one type; floats and booleans are refused, as the
    CRD (x-kubernetes-int-or-string) refuses them."""
    if isinstance(value, (bool, float)):
        # a pydantic validator: pydantic reports a ValueError as a ValidationError, a TypeError it does not
        raise ValueError(  # noqa: TRY004 - pydantic validator
            "a resource quantity must be a string such as '500m' or '64Gi', or an integer")
    if isinstance(value, int):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True}),
]


class ApiModel(BaseModel):
    """Base: camelCase aliases, unknown fields rejected, assignment validated."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_enum_values=False,
    )


def _f(default: Any = ..., description: str = "", **kw: Any) -> Any:
    """Field with a mandatory description (the CRD and README reference show it)."""
    assert description, "every field needs a description"
    return Field(default, description=description, **kw)


# --------------------------------------------------------------------------- model and data


class ModelSpec(ApiModel):
    path: str = _f(
        description=(
            "Hugging Face checkpoint folder of the policy (config.json, tokenizer, safetensors): "
            "s3://bucket/prefix (downloaded once per node), file:///path or /path on a mounted volume, "
            "or builtin://tiny-qwen2 (a tiny random-init Qwen2 model with a character tokenizer, for "
            "smoke tests and the quickstart; builtin://tiny-qwen2-hd64 is the same at head_dim 64, the shape vLLM "
            "runs at rollout tensor-parallel 2; builtin://tiny-qwen2-tools adds the tool-call tags and a chat template for "
            "spec.tools). (verl: actor_rollout_ref.model.path)"
        ),
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
    )
    dtype: ModelDType = _f(ModelDType.BFLOAT16, "Parameter dtype for training and rollout; optimizer master weights stay fp32.")
    gradient_checkpointing: bool = _f(
        False,
        "Shorthand for megatron full uniform recompute of 1 layer per chunk when megatron.recomputeGranularity "
        "is none. (verl: actor_rollout_ref.model.enable_gradient_checkpointing)",
    )
    trust_remote_code: bool = _f(False, "Allow custom modelling code from the checkpoint folder (tokenizer only).")
    tokenizer_path: str | None = _f(
        None, "Tokenizer folder if it differs from model.path.", pattern=MODEL_URI_PATTERN, max_length=1024
    )


class SyntheticDataSpec(ApiModel):
    task: Literal["target-token", "digit-sum", "tool-secret"] = _f(
        description=(
            "Generated task: target-token (reward = fraction of generated tokens equal to a target character), "
            "digit-sum ('a+b=' answered by (a+b) mod 10 as the first generated token), or tool-secret (the answer "
            "is a per-prompt secret digit only the tool rljob_worker.data.synthetic:secret_tool returns; with "
            "builtin://tiny-qwen2-tools, rollout.agent and spec.tools, examples/secret-tool.yaml)."
        )
    )
    num_prompts: int = _f(256, "Number of distinct prompts generated for the training set.", ge=1, le=1_000_000)
    num_val_prompts: int = _f(64, "Number of prompts generated for validation.", ge=0, le=1_000_000)


class DataSpec(ApiModel):
    train_files: list[str] = _f(
        default_factory=list,
        description="Training parquet files (verl format: prompt, data_source, reward_model.ground_truth, "
        "extra_info), as s3:// or file:// URIs or absolute paths. (verl: data.train_files)",
        max_length=1024,
    )
    val_files: list[str] = _f(
        default_factory=list, description="Validation parquet files, same format. (verl: data.val_files)", max_length=1024
    )
    synthetic: SyntheticDataSpec | None = _f(
        None, "Generate a synthetic task instead of reading parquet files (quickstart, tests)."
    )
    prompt_key: str = _f("prompt", "Column holding the prompt (chat message list or string). (verl: data.prompt_key)", min_length=1)
    max_prompt_length: int = _f(1024, "Maximum prompt tokens. (verl: data.max_prompt_length)", ge=1, le=1_048_576)
    max_response_length: int = _f(2048, "Maximum generated tokens. (verl: data.max_response_length)", ge=1, le=1_048_576)
    prompt_overflow: PromptOverflow = _f(
        PromptOverflow.FILTER,
        "What to do with prompts longer than maxPromptLength: filter (dropped and counted), truncate-left, "
        "truncate-right, or error. (verl: data.filter_overlong_prompts / data.truncation)",
    )
    apply_chat_template: bool = _f(True, "Render chat-message prompts with the tokenizer's chat template when it has one.")
    shuffle: bool = _f(True, "Shuffle the training set each epoch (deterministically from training.seed).")


# --------------------------------------------------------------------------- algorithm


class OverlongBufferSpec(ApiModel):
    enable: bool = _f(False, "Penalise responses that reach into the last `length` tokens before maxResponseLength (DAPO).")
    length: int = _f(256, "Size of the soft-penalty zone in tokens.", ge=1)
    penalty_factor: float = _f(1.0, "Penalty at maxResponseLength; grows linearly from 0 over the zone.", ge=0)


class RolloutCorrectionSpec(ApiModel):
    token_truncation: bool | None = _f(
        None,
        "Truncated importance sampling: weight each token's policy-gradient loss by min(pi_train / pi_rollout, "
        "threshold), pi_rollout being the rollout engine's own log-prob of the token (Yao et al. 2025; verl: "
        "algorithm.rollout_correction.rollout_is token; TRL: vllm_importance_sampling_mode token_truncate). Unset: "
        "on when rollout.mode is one-step or async (the samples come from an older policy than the one trained), "
        "off with sync.",
    )
    sequence_masking: bool = _f(
        False,
        "Drop from the policy-gradient loss every response whose sequence ratio, the geometric mean of its "
        "token ratios pi_train / pi_rollout (exp of the mean token log-ratio), lies outside "
        "[1 / sequenceMaskingThreshold, sequenceMaskingThreshold]; the response still counts in the loss "
        "normaliser. This is verl's geometric rejection sampling (algorithm.rollout_correction.rollout_rs "
        "geometric, rollout_rs_threshold, lower bound 1/threshold by default). TRL's sequence_mask is another rule: "
        "it masks when the product of the token ratios exceeds its cap (upper side only), which on long "
        "responses follows the length more than the mismatch.",
    )
    threshold: float = _f(
        2.0, "C: the truncation cap of tokenTruncation (verl's rollout_is_threshold defaults to 2; TRL's "
        "vllm_importance_sampling_cap to 3).", gt=1, le=100,
    )
    sequence_masking_threshold: float = _f(
        1.01, "The band [1/D, D] of sequenceMasking's geometric-mean ratio. 1.01 masks a response whose tokens are "
        "on average 1% more (or less) likely under the trainer than under the engine: a systematic mismatch, "
        "whose product ratio is e^(0.01 T) (e^10 at 1,000 tokens). Per-token differences of random sign, of the "
        "order of 1e-2 nats for bf16 kernels, average out to about 1e-2 / sqrt(T) (3e-3 at 10 tokens, 3e-4 at "
        "1,000), inside the band. A band as wide as the truncation cap 2 would need a drift of ln 2 = 0.69 nats "
        "per token and practically never fire. verl suggests 1.0002-1.001 for its geometric rejection, which "
        "also masks noise on short responses.", gt=1, le=100,
    )


class AlgorithmSpec(ApiModel):
    name: AlgorithmName = _f(
        AlgorithmName.GRPO,
        "Training algorithm: grpo (RL with rollouts and rewards), or sft (supervised fine-tuning on spec.sft data; "
        "the rollout, reward and GRPO loss settings are then unused).",
    )
    advantage_estimator: AdvantageEstimator = _f(
        AdvantageEstimator.GRPO,
        "Advantage estimator: grpo (group mean), rloo (leave-one-out), reinforce_plus_plus (outcome advantages), or "
        "gae (PPO: generalised advantage estimation against the value model of spec.critic, which it requires). "
        "(verl: algorithm.adv_estimator)",
    )
    gamma: float = _f(
        1.0, "gae: discount per response token; 1.0 (as verl) suits outcome rewards on the last token. "
        "(verl: algorithm.gamma)", ge=0, le=1,
    )
    # YAML key `lambda` (Python keyword, hence the field name).
    gae_lambda: float = _f(
        1.0, "gae: GAE lambda, the bias/variance trade-off between TD(0) (0) and Monte-Carlo returns (1). "
        "(verl: algorithm.lam)", ge=0, le=1, alias="lambda",
    )
    norm_adv_by_std: bool = _f(
        True, "Divide group-centred rewards by the group std; false gives Dr.GRPO. The std is the population std "
        "(divisor G for a group of G), not Bessel's (G - 1) that verl's GRPO uses, so verl's advantages are these "
        "times sqrt((G - 1) / G). reinforce_plus_plus whitens over all response tokens of the batch (a response "
        "weighs its length), as the paper and verl. (verl: algorithm.norm_adv_by_std_in_grpo)"
    )
    whiten_scope: WhitenScope = _f(
        WhitenScope.MINI_BATCH, "gae: which response tokens one whitening of the advantages (subtract the mean, "
        "divide by the std) runs over: mini-batch (the default: each mini-batch's tokens, on every data-parallel "
        "rank, just before its update) or batch (all of the step's tokens at once, as verl's compute_advantage "
        "does). With one mini-batch per step the two are the same."
    )
    clip_ratio_low: float = _f(0.2, "PPO clip range below 1. (verl: actor.clip_ratio_low)", ge=0, le=1)
    clip_ratio_high: float = _f(0.2, "PPO clip range above 1; DAPO's clip-higher uses 0.28. (verl: actor.clip_ratio_high)", ge=0, le=10)
    dual_clip_c: float | None = _f(
        None, "Dual-clip bound for negative advantages (> 1, typically 3); unset disables. (verl: actor.clip_ratio_c)", gt=1
    )
    importance_level: ImportanceLevel = _f(
        ImportanceLevel.TOKEN, "Importance ratio per token (PPO/GRPO) or per sequence (GSPO). sequence needs a "
        "sequence-level lossAggregation (seq-mean-token-mean, as verl forces for GSPO): every token of a row carries "
        "the row's shared ratio, so token-mean and the token sums (seq-mean-token-sum-norm) weight rows by length. "
        "(verl: actor.policy_loss.loss_mode gspo)"
    )
    kl_coef: float = _f(
        0.001, "KL coefficient; 0 disables the reference model. (verl: actor.kl_loss_coef / algorithm.kl_ctrl.kl_coef)", ge=0
    )
    kl_estimator: KLEstimator = _f(
        KLEstimator.LOW_VAR_KL, "KL estimator: k1, k2, k3, low_var_kl (clamped k3). (verl: actor.kl_loss_type)"
    )
    kl_placement: KLPlacement = _f(
        KLPlacement.LOSS, "Add the KL term to the loss (GRPO) or subtract it from the reward. With reward, coef x KL "
        "(of the rollout policy to the reference) is subtracted from the token rewards before the advantage "
        "estimator runs: for grpo and rloo each response's score becomes reward - coef x sum of its token KL "
        "before group normalisation; reinforce_plus_plus whitens the KL-shaped returns. (verl: actor.use_kl_loss / "
        "algorithm.use_kl_in_reward)"
    )
    entropy_coeff: float = _f(0.0, "Entropy bonus coefficient. (verl: actor.entropy_coeff)", ge=0)
    loss_aggregation: LossAggregation = _f(
        LossAggregation.TOKEN_MEAN,
        "How token losses become one number: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm (Dr.GRPO). "
        "The mean runs over the whole mini-batch of one optimizer step (tokens or sequences counted over every "
        "micro-batch and data-parallel rank), so microBatchSizePerGpu and the parallel layout do not change the "
        "loss; the KL-in-loss and entropy terms are aggregated alike. (verl: actor.loss_agg_mode)",
    )
    dynamic_sampling: bool = _f(
        False, "DAPO dynamic sampling: drop prompt groups whose rewards are all equal and refill from the next prompts."
    )
    max_refill_batches: int = _f(4, "With dynamicSampling, how many extra rollout batches may be drawn per step.", ge=0, le=64)
    overlong_buffer: OverlongBufferSpec = _f(default_factory=OverlongBufferSpec, description="DAPO overlong reward shaping.")
    routing_replay: bool = _f(
        False, "Mixture-of-experts models: the trainer's forward passes (old and current policy) route every token to "
        "the experts the rollout engine chose for it, recorded per token and layer during the rollout, so the "
        "importance ratio compares the same experts (large MoE RL runs collapse on routing mismatch without it). The "
        "reference model routes on its own. Needs an MoE model (qwen3_moe, qwen2_moe); not with rollout.agent, "
        "rollout.partial or sft in this release.",
    )
    rollout_correction: RolloutCorrectionSpec = _f(
        default_factory=RolloutCorrectionSpec,
        description="Correct the policy gradient for the gap between the rollout engine's sampling distribution and "
        "the trainer's (kernels, precision, sampling settings); off by default. The gap is always reported "
        "(rljob_rollout_logprob_mismatch_*), the correction's effect too (rljob_rollout_correction_*).",
    )


class SFTSpec(ApiModel):
    format: SFTDataFormat = _f(
        SFTDataFormat.PROMPT_RESPONSE,
        "How data.trainFiles/valFiles rows become training sequences: tokenized (columns input_ids, attention_mask, "
        "labels; labels equal input_ids where the loss counts and -100 where it does not), prompt-response (text "
        "columns data.promptKey and responseKey; the job tokenises, appends EOS to the response and trains on the "
        "response tokens) or messages (a chat message list under messagesKey, rendered turn by turn with the "
        "tokenizer's chat template; loss on assistant turns). data.synthetic generates prompt-response rows.",
    )
    response_key: str = _f(
        "response", "prompt-response: column holding the target text. (verl: data.response_key)", min_length=1
    )
    messages_key: str = _f(
        "messages",
        "messages: column holding the conversation, a list of {role, content}. (verl: data.multiturn.messages_key)",
        min_length=1,
    )
    max_length: int = _f(
        2048, "Maximum tokens of one training sequence (prompt and response, or the whole conversation). "
        "(verl: data.max_length)", ge=2, le=1_048_576,
    )
    overflow: PromptOverflow = _f(
        PromptOverflow.FILTER,
        "Sequences longer than maxLength: filter (dropped and counted), truncate-left, truncate-right, or error. "
        "(verl: data.truncation)",
    )
    loss_on_prompt_tokens: bool = _f(
        False,
        "Also train on the prompt (prompt-response) or on system and user turns (messages). Tokenized rows keep "
        "their labels as given.",
    )
    packing: bool = _f(
        True,
        "Length-grouped micro-batches: sort each rank's share of the global batch by length before cutting it into "
        "micro-batches, so each runs at about its own length. Padding never reaches the model either way (verl's "
        "use_remove_padding is always on: the megatron actor packs each row's real tokens and cuts a micro-batch "
        "to its longest row), and the loss is a token mean over the global batch, so this changes speed, not the "
        "loss.",
    )
    lr_schedule: LRSchedule = _f(
        LRSchedule.COSINE,
        "Learning-rate schedule after training.lrWarmupSteps of linear warm-up to training.lr: constant, or cosine "
        "decay to lr x minLrRatio over the remaining planned steps. (verl: optim.lr_scheduler)",
    )
    min_lr_ratio: float = _f(0.0, "cosine: the final learning rate as a fraction of training.lr. (verl: optim.min_lr_ratio)",
                             ge=0, le=1)


# --------------------------------------------------------------------------- rollout


class AgentSpec(ApiModel):
    max_turns: int = _f(4, "Model turns per trajectory at most; a turn that calls a tool at the last turn ends the "
                        "trajectory without running the call.", ge=1, le=64)
    max_tool_calls_per_turn: int = _f(
        1, "Tool calls run per turn; further calls of the turn are answered with an error observation.", ge=1, le=16)
    tool_call_format: ToolCallFormat = _f(
        ToolCallFormat.HERMES,
        "How the model writes a call: hermes, <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Hermes, "
        "Qwen2.5, Qwen3), or bare, <tool_call>TEXT</tool_call> with TEXT the input of the job's only tool "
        "(models too small to write JSON). </tool_call> must be one token of the tokenizer: the engines stop a turn "
        "on it.")


class RolloutSpec(ApiModel):
    engine: RolloutEngine = _f(
        RolloutEngine.AUTO, "Rollout engine: vllm (vLLM 0.26, colocated, sleeps while the actor trains), hf (transformers; on a GPU a "
        "static KV cache and a CUDA-graphed decode step), or auto, which picks by measurement: hf without a GPU or "
        "without vLLM; vllm for rollout TP > 1, more than one GPU process, or a model above 3B active parameters; "
        "else hf (rollout alone on an H100: the static hf engine is 1.7x vLLM at 0.5B and 1.2x at 1.5B, vLLM is "
        "1.7x the static engine at 7B; bench/NOTES.md)."
    )
    # Not `n`: YAML 1.1 parsers (kubectl's among them) read a bare `n` key as the boolean false.
    ranks: RolloutRanks = _f(
        RolloutRanks.AUTO,
        "Which ranks sample with the hf engines: every-rank (each GPU holds the whole model and samples its "
        "share of whole prompt groups; the pieces are gathered in prompt order), rank0 (global rank 0 samples the "
        "whole batch and broadcasts it; the samples then do not depend on the parallel layout), or auto "
        "(every-rank on GPUs, rank0 on CPU). The vllm engine always samples on every rollout tensor-parallel group.",
    )
    samples_per_prompt: int = _f(
        8, "Samples per prompt, i.e. the GRPO group size. (verl: actor_rollout_ref.rollout.n)", ge=2, le=1024)
    temperature: float = _f(1.0, "Sampling temperature. The trainer's log-probs and entropy are of the same tempered "
                            "distribution, softmax(logits / temperature), as verl's (0 samples greedily and trains on "
                            "the raw distribution). (verl: rollout.temperature)", ge=0, le=10)
    top_p: float = _f(1.0, "Nucleus sampling probability mass. (verl: rollout.top_p)", gt=0, le=1)
    top_k: int = _f(-1, "Top-k sampling; -1 disables. (verl: rollout.top_k)", ge=-1)
    tensor_model_parallel_size: int = _f(
        1, "Rollout tensor parallel size; must divide gpusPerNode. (verl: rollout.tensor_model_parallel_size)", ge=1, le=64
    )
    gpu_memory_utilization: float = _f(
        0.6, "Fraction of GPU memory the colocated engine may take for weights and KV cache. (verl: rollout.gpu_memory_utilization)", gt=0, le=0.95
    )
    free_cache_engine: bool = _f(
        True, "Free the colocated engine's GPU memory while the actor trains: vLLM sleeps (KV cache and weights); the "
        "static hf engine frees its KV cache and CUDA graphs, unless the first step's measured memory shows they fit "
        "beside training with 25% of the GPU to spare (then they stay and the graphs are not captured again each "
        "rollout; logged; env RLJOB_ROLLOUT_CACHE=release frees them every step). (verl: rollout.free_cache_engine)"
    )
    enforce_eager: bool = _f(False, "Disable CUDA graphs in the engine (debugging). (verl: rollout.enforce_eager)")
    compile: RolloutCompile = _f(
        RolloutCompile.AUTO,
        "Compile the static hf engine's decode step and sampler with torch.compile: auto (on GPUs; not on CPU), "
        "enabled or disabled. Compiled decoding is ~1.8x faster at 0.5B (bench/NOTES.md); the first rollout pays "
        "the compile (by layer: a cold pod's first step 25-33 s at 0.5B on an H200, 8-12 s with the cache restored "
        "from checkpoint.compileCache), later processes of the pod load it from the compile cache the operator "
        "mounts (an emptyDir); a compile that fails leaves decoding uncompiled. The worker env "
        "RLJOB_HF_STATIC_COMPILE=1 or 0 (podTemplate.env) overrides this field.",
    )
    max_num_batched_tokens: int | None = _f(None, "Engine scheduler token budget per iteration. (verl: rollout.max_num_batched_tokens)", ge=1)
    log_prob_micro_batch_size_per_gpu: int = _f(
        8, "Micro batch for recomputing old/reference log-probs with the trainer. (verl: rollout.log_prob_micro_batch_size_per_gpu)", ge=1
    )
    val_temperature: float = _f(0.0, "Sampling temperature for validation (0 = greedy). (verl: rollout.val_kwargs.temperature)", ge=0, le=10)
    val_n: int = _f(1, "Samples per validation prompt. (verl: rollout.val_kwargs.n)", ge=1, le=64)
    placement: RolloutPlacement = _f(
        RolloutPlacement.COLOCATED,
        "colocated: the engines run on the trainer's GPUs and take turns with training; separate: they run on "
        "rollout.gpus GPUs of each node that never train (the trainer gets gpusPerNode - rollout.gpus, less a split "
        "critic's), the new weights go to them over NCCL after every optimizer step, and rollout.mode may let "
        "generation overlap training. (slime, prime-rl: a rollout pool; verl: one-step off-policy)")
    gpus: int | None = _f(
        None, "With placement separate: GPUs of each node that run the rollout engines (one hf engine per GPU, "
        "each sampling a share of the prompt groups).", ge=1, le=63)
    mode: RolloutMode = _f(
        RolloutMode.SYNC,
        "sync: batch k is generated with the policy trained through step k-1; one-step: batch k+1 is generated "
        "while batch k trains (every sample one policy version behind); async: the rollout pool works up to "
        "maxStaleness batches ahead of the trainer, each sample tagged with the version that generated it, and a "
        "batch older than maxStaleness versions is dropped and counted. one-step and async need placement "
        "separate, and turn on algorithm.rolloutCorrection.tokenTruncation unless it is set.")
    max_staleness: int = _f(
        1, "With mode async: batches the rollout pool may generate ahead of the trainer, so the most policy "
        "versions any trained sample lags behind (one-step is async with 1).", ge=1, le=16)
    partial: bool = _f(
        False, "Partial rollouts (with mode one-step or async): a weight update does not wait for long responses. "
        "Every data.maxResponseLength / 4 decode steps (64 at most) the rollout pool loads any newer weights the "
        "trainer pushed; unfinished responses continue from their tokens so far under the new weights, each token "
        "tagged with the version that sampled it. A batch's staleness is that of its oldest token, and truncated "
        "importance sampling weighs each token against the log-prob of the version that sampled it. On the static hf "
        "engine (the GPU default) the pool also refills: a row whose response ended takes the next queued response at "
        "once, also of the next batches the trainer asked for (up to maxStaleness ahead), so a batch's longest "
        "response no longer idles the other rows; responses keep their KV cache across a weight load. Other engines "
        "generate one batch at a time in 4 chunks, re-reading the prompt and the tokens so far at each.")
    agent: AgentSpec | None = _f(
        None, "Multi-turn rollouts with spec.tools: the model calls tools and reads their output over several turns; "
        "data.maxResponseLength bounds all turns and tool outputs together, and a trajectory that reaches it is cut "
        "there and scored as it stands (the reward sees extra['trajectory']['cut']). Tool outputs carry no loss.")


# --------------------------------------------------------------------------- training and megatron


class TrainingSpec(ApiModel):
    train_batch_size_per_node: int = _f(
        64, "Prompts per training step on each node; the global batch is this x nnodes. With algorithm sft: "
        "sequences per optimizer step on each node (global batch = this x nnodes; gradient accumulation = global "
        "batch / (data-parallel ranks x microBatchSizePerGpu)). (verl: data.train_batch_size / nnodes)", ge=1
    )
    ppo_mini_batch_size_per_node: int = _f(
        16, "Prompts per optimizer step on each node (x n samples each). (verl: actor.ppo_mini_batch_size / nnodes)", ge=1
    )
    micro_batch_size_per_gpu: int = _f(
        4, "Sequences per forward/backward on one GPU. (verl: actor.ppo_micro_batch_size_per_gpu; "
        "SFT: data.micro_batch_size_per_gpu)", ge=1
    )
    max_tokens_per_micro_batch: int | None = _f(
        None, "Token budget of one actor-update forward/backward on one GPU. On a GPU in bf16/fp16 with the "
        "local layer spec (no transformer_engine) and without context parallelism, a micro-batch "
        "runs as one concatenated "
        "sequence of its rows (attention and positions per row, no padding) and the budget bounds the rows' "
        "total; elsewhere rows sorted by length are grouped so that rows x longest row <= this (the packed "
        "tensor the model runs). Rows are assigned to data-parallel ranks balancing tokens (except with "
        "algorithm.klPlacement reward). Replaces microBatchSizePerGpu for the GRPO actor update; at least "
        "data.maxPromptLength + data.maxResponseLength. Unset: on a GPU without pipeline stages, "
        "microBatchSizePerGpu x (data.maxPromptLength + data.maxResponseLength), the same memory bound as "
        "microBatchSizePerGpu rows with less padding (at 1.5B on an H200 the actor update's tokens/s: rows "
        "grouped by length 1.20x microBatchSizePerGpu rows, concatenated 1.22x more); otherwise microBatchSizePerGpu rows per micro-batch (a pipeline pads "
        "every micro-batch of a step to the most rows x the longest row among them). 0: microBatchSizePerGpu "
        "rows per micro-batch everywhere. "
        "(verl: actor.use_dynamic_bsz + actor.ppo_max_token_len_per_gpu)", ge=0
    )
    ppo_epochs: int = _f(1, "Passes over each rollout batch. (verl: actor.ppo_epochs)", ge=1, le=64)
    lr: float = _f(1e-6, "Peak learning rate. (verl: actor.optim.lr)", gt=0, le=1)
    lr_warmup_steps: int = _f(0, "Linear warm-up optimizer steps. (verl: actor.optim.lr_warmup_steps)", ge=0)
    weight_decay: float = _f(0.01, "AdamW weight decay. (verl: actor.optim.weight_decay)", ge=0)
    grad_clip: float = _f(1.0, "Global gradient-norm clip; 0 disables. (verl: actor.grad_clip)", ge=0)
    total_epochs: int = _f(30, "Passes over the training set. (verl: trainer.total_epochs)", ge=1)
    total_training_steps: int | None = _f(
        None, "Stop after this many steps (overrides totalEpochs; the data wraps into further epochs). (verl: trainer.total_training_steps)", ge=1
    )
    test_freq: int = _f(10, "Validate every this many steps; -1 disables. (verl: trainer.test_freq)", ge=-1)
    val_before_train: bool = _f(True, "Validate once before the first step. (verl: trainer.val_before_train)")
    seed: int = _f(1, "Seed for data order, sampling and initialisation.", ge=0)


class MegatronSpec(ApiModel):
    tensor_model_parallel_size: int = _f(1, "Tensor parallel size. (verl: actor.megatron.tensor_model_parallel_size)", ge=1, le=64)
    pipeline_model_parallel_size: int = _f(1, "Pipeline parallel size. (verl: actor.megatron.pipeline_model_parallel_size)", ge=1, le=128)
    virtual_pipeline_model_parallel_size: int | None = _f(
        None, "Interleaved (virtual) pipeline chunks per stage; needs pipelineModelParallelSize > 1. (verl: virtual_pipeline_model_parallel_size)", ge=2
    )
    context_parallel_size: int = _f(1, "Context parallel size. (verl: actor.megatron.context_parallel_size)", ge=1, le=64)
    expert_model_parallel_size: int = _f(1, "Expert parallel size (MoE). (verl: actor.megatron.expert_model_parallel_size)", ge=1, le=512)
    expert_tensor_parallel_size: int | None = _f(None, "Tensor parallel size inside experts; defaults to tensorModelParallelSize.", ge=1)
    sequence_parallel: bool = _f(False, "Megatron sequence parallelism; needs tensorModelParallelSize > 1. (verl: actor.megatron.sequence_parallel)")
    use_distributed_optimizer: bool = _f(True, "Shard optimizer state over data parallel ranks. (verl: actor.megatron.use_distributed_optimizer)")
    param_offload: bool = _f(False, "Move parameters to CPU while the rollout engine runs. (verl: actor.megatron.param_offload)")
    grad_offload: bool = _f(False, "Move gradient buffers to CPU while the rollout engine runs. (verl: actor.megatron.grad_offload)")
    optimizer_offload: bool = _f(False, "Move optimizer state to CPU while the rollout engine runs. (verl: actor.megatron.optimizer_offload)")
    recompute_granularity: RecomputeGranularity = _f(
        RecomputeGranularity.NONE, "Activation recompute: none, selective (attention core), full (whole layers)."
    )
    recompute_method: RecomputeMethod = _f(RecomputeMethod.UNIFORM, "With full recompute: uniform or block.")
    recompute_num_layers: int = _f(1, "With full recompute: layers per recompute group (uniform) or recomputed layers per stage (block).", ge=1)
    override_transformer_config: dict[str, Any] = _f(
        default_factory=dict,
        description="Extra megatron TransformerConfig fields, passed through as in the seeds "
        "(verl: actor.megatron.override_transformer_config).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


# --------------------------------------------------------------------------- critic (PPO value model)


class LoraSpec(ApiModel):
    """Low-rank adapters on megatron-core's linear layers: the base weights stay frozen (no gradient, no
    optimizer state); W x + (alpha / rank) B A x is trained, A (rank x in) and B (out x rank, zero at the start)."""

    rank: int = _f(32, "Adapter rank r. RL's reward carries few bits per episode, so even low ranks match full "
                   "fine-tuning there (Thinking Machines, LoRA Without Regret, 2025). (PEFT: r)", ge=1, le=1024)
    alpha: float = _f(32.0, "Scale numerator: the adapter's output is multiplied by alpha / rank. Kept fixed while "
                      "trying ranks, the best learning rate barely moves with the rank. (PEFT: lora_alpha)",
                      gt=0, le=65536)
    dropout: float = _f(0.0, "Dropout on the adapter's input while training (not on the frozen path); 0 keeps the "
                        "trainer's log-probs those of the policy that sampled. (PEFT: lora_dropout)", ge=0, lt=1)
    target_modules: list[LoraTarget] = _f(
        default_factory=lambda: list(LoraTarget),
        description="megatron-core linears that get an adapter: linear_qkv (HF q_proj, k_proj and v_proj: one "
        "shared input), linear_proj (o_proj), linear_fc1 (gate_proj and up_proj), linear_fc2 (down_proj). "
        "Embeddings, norms, the output layer and MoE routers and experts never get one. (PEFT: target_modules)",
        min_length=1, max_length=4, json_schema_extra={"x-kubernetes-list-type": "set"})
    export_merged: bool = _f(
        False, "With checkpoint.exportHf: also write the merged model (W + (alpha / rank) B A) as a full Hugging "
        "Face checkpoint under <job prefix>/hf-merged/, beside the PEFT adapter under <job prefix>/hf/.")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _hf_names_point_to_megatron_ones(cls, value: Any) -> Any:
        if isinstance(value, list):
            for name in value:
                if name in _HF_LORA_TARGETS:
                    raise ValueError(f"{name!r} is fused into megatron-core's {_HF_LORA_TARGETS[name]!r} here (one "
                                     f"adapter over the fused weight); write {_HF_LORA_TARGETS[name]}")
        return value

    @field_validator("target_modules")
    @classmethod
    def _unique_targets(cls, value: list[LoraTarget]) -> list[LoraTarget]:
        if len(set(value)) != len(value):
            raise ValueError("lists a module twice; name each once")
        return value


_HF_LORA_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


class CriticModelSpec(ApiModel):
    path: str | None = _f(
        None,
        "Hugging Face checkpoint folder the critic starts from (its transformer layers; the value head is new); "
        "unset uses spec.model.path. It must use the actor's tokenizer. (verl: critic.model.path)",
        pattern=MODEL_URI_PATTERN,
        max_length=1024,
    )


class CriticSpec(ApiModel):
    """The value model of PPO (algorithm.advantageEstimator gae): a megatron-core GPT with a scalar head."""

    model: CriticModelSpec = _f(default_factory=CriticModelSpec, description="Where the critic's weights come from.")
    megatron: MegatronSpec = _f(
        default_factory=MegatronSpec,
        description="The critic's own megatron-core parallelism, offload and recompute; the same fields and rules "
        "as spec.megatron. (verl: critic.megatron.*; Trinity: the critic block's tensor/pipeline/expert sizes, "
        "offload flags and override_transformer_config)",
    )
    lr: float = _f(1e-5, "Peak learning rate of the critic. (verl: critic.optim.lr)", gt=0, le=1)
    lr_warmup_steps: int = _f(0, "Linear warm-up optimizer steps of the critic. (verl: critic.optim.lr_warmup_steps)", ge=0)
    weight_decay: float = _f(0.01, "AdamW weight decay of the critic. (verl: critic.optim.weight_decay)", ge=0)
    grad_clip: float = _f(1.0, "Global gradient-norm clip of the critic; 0 disables. (verl: critic.grad_clip)", ge=0)
    ppo_epochs: int = _f(1, "Critic passes over each rollout batch. (verl: critic.ppo_epochs)", ge=1, le=64)
    micro_batch_size_per_gpu: int = _f(
        4, "Sequences per critic forward/backward on one GPU. (verl: critic.ppo_micro_batch_size_per_gpu)", ge=1
    )
    cliprange_value: float = _f(
        0.5, "Value clipping: new values are clipped to old values +- this before the squared error, and the larger "
        "of the clipped and unclipped errors counts. (verl: critic.cliprange_value)", gt=0,
    )
    warmup_steps: int = _f(
        0, "Steps that update only the critic before the actor starts training. (verl: trainer.critic_warmup)", ge=0
    )
    output_layer_index: int | None = _f(
        None,
        "Number of decoder layers the critic runs: the value head reads the hidden state after this layer (HF's "
        "hidden_states[outputLayerIndex]) through the final norm; layers above it are not built. Unset reads the "
        "last layer. Needs critic megatron.pipelineModelParallelSize 1. (seeds: critic.output_layer_index)",
        ge=1,
        le=4096,
    )
    placement: CriticPlacement = _f(
        CriticPlacement.SHARED,
        "shared: actor and critic take turns on all GPUs (the idle one offloaded when its offload flags are set; "
        "also the translation of sequential FSDP-style placement); a shared critic whose megatron layout differs "
        "from the actor's (critic.megatron) runs in processes of its own, two per GPU; split: the critic trains on its own critic.gpus "
        "GPUs of each node while the actor and rollout use the rest, and the two updates overlap. (verl: "
        "resource_pool / critic placement)",
    )
    gpus: int | None = _f(
        None,
        "With placement split: GPUs of each node that run the critic; the actor and rollout get gpusPerNode - gpus. "
        "(verl: the critic's resource pool size per node)",
        ge=1,
        le=63,
    )
    lora: LoraSpec | None = _f(
        None, "Train the critic as LoRA adapters on its transformer (the value head stays fully trained); unset "
        "trains all its weights. Independent of spec.lora.")


# --------------------------------------------------------------------------- reward, checkpoint, storage, metrics


class ToolSpec(ApiModel):
    name: str = _f(description="The name the model calls the tool by.", pattern=TOOL_NAME_PATTERN, max_length=64)
    function: str | None = _f(
        None, "module.path:function importable in the worker image, called as f(arguments: dict, context: dict) -> "
        "str or JSON-serialisable, context holding the trajectory's prompt, ground_truth and extra; runs in the "
        "worker process (trusted code, like rewards). Exactly one of function and builtin.",
        pattern=TOOL_FUNCTION_PATTERN, max_length=256)
    builtin: Literal["python"] | None = _f(
        None, "python: runs the model's code ({\"code\": ...}) in a fresh subprocess with CPU, memory, wall-clock and "
        "output limits, a clean environment and an empty working directory (see the README's tools section).")
    timeout_seconds: float = _f(10.0, "Wall-clock limit of one call (and the python tool's CPU seconds); past it the "
                                "model gets a timeout observation.", gt=0, le=600)
    max_output_tokens: int = _f(256, "Tokens of a call's output the model sees; longer output is cut.", ge=1, le=65536)
    memory_mb: int = _f(1024, "Address-space limit of a python tool call in MiB.", ge=64, le=65536)
class HeadersSecretRef(ApiModel):
    name: str = _f(description="Secret name in the RLJob's namespace.", min_length=1, max_length=253)
    headers: dict[str, str] = _f(
        description="HTTP header name -> key in the Secret, e.g. {Authorization: token} (the value is sent as it "
        "is, so store 'Bearer sk-...' for a bearer token). The operator injects each key as a worker env "
        "variable (RLJOB_REWARD_HEADER_<secret>_<key>_<hash>) from the Secret, never copying its value; the worker "
        "sends it only in request headers, never in logs, metrics, errors or checkpoints.",
        min_length=1,
    )

    def env_names(self) -> dict[str, str]:
        """HTTP header -> the worker env variable holding its value (the operator and the worker agree on it)."""
        return {header: secret_header_env(self.name, key) for header, key in self.headers.items()}


def secret_header_env(secret: str, key: str) -> str:
    """The env variable a Secret key is injected as: readable, and distinct for distinct (secret, key) pairs."""
    import hashlib
    import re

    tag = hashlib.sha256(f"{secret}\0{key}".encode()).hexdigest()[:8].upper()
    return f"RLJOB_REWARD_HEADER_{re.sub(r'[^A-Za-z0-9]', '_', f'{secret}_{key}').upper()}_{tag}"


class JudgeSpec(ApiModel):
    model: str = _f(description="Model name sent in each chat completion request (the name the server serves).",
                    min_length=1, max_length=256)
    prompt_template: str = _f(
        description="The judge's user message, rendered per sample: {prompt}, {completion}, {ground_truth} and "
        "{data_source} are replaced by the sample's values; any other braces are kept as written.",
        min_length=1, max_length=65536,
    )
    system_prompt: str | None = _f(None, "Optional system message sent before the rendered template.",
                                   max_length=65536)
    score_rule: JudgeScoreRule = _f(
        JudgeScoreRule.SCORE_TAG,
        "How the reply becomes a score: score-tag takes the number inside the last <score>x</score>, "
        "last-number the last number anywhere in the reply (e.g. 'so the answer is correct: 1'). The number must "
        "lie in [0, 1]; a reply without one, or with one outside [0, 1], is a failed sample (onFailure applies).",
    )
    max_tokens: int = _f(256, "max_tokens of each judge request.", ge=1, le=131072)
    temperature: float = _f(0.0, "Sampling temperature of the judge (0: deterministic where the server allows).",
                            ge=0, le=10)


JUDGE_PORT = 8000


def judge_service_name(job_name: str) -> str:
    """The Service (and Deployment) of the judge the operator runs for spec.reward.server."""
    return f"{job_name[:57]}-judge"


def judge_url(job_name: str, namespace: str) -> str:
    """Where the worker reaches the operator-run judge (spec.reward.server) when remote.url is unset."""
    return f"http://{judge_service_name(job_name)}.{namespace}.svc:{JUDGE_PORT}"


class RemoteRewardSpec(ApiModel):
    url: str | None = _f(
        None,
        "Endpoint: for http-json the URL batches are POSTed to (e.g. http://verifier.ml.svc:8000/score); "
        "for openai-chat the server's base URL (e.g. http://judge:8000; /v1/chat/completions is appended, a "
        "trailing /v1 is accepted). Credentials go in headersSecretRef, never in the URL. Required, except on "
        "spec.reward.remote with spec.reward.server, whose Service it then points at "
        "(http://<job>-judge.<namespace>.svc:8000).",
        pattern=REMOTE_URL_PATTERN, max_length=2048,
    )
    protocol: RemoteProtocol = _f(
        RemoteProtocol.HTTP_JSON,
        "http-json: POST {\"samples\": [{\"prompt\", \"completion\", \"ground_truth\", \"data_source\", "
        "\"extra_info\"}, ...]} and read {\"scores\": [float, ...]} in the same order, batchSize samples per "
        "request. openai-chat: one /v1/chat/completions request per sample with judge.promptTemplate, scored by "
        "judge.scoreRule.",
    )
    headers_secret_ref: HeadersSecretRef | None = _f(
        None, "HTTP headers (API keys, bearer tokens) taken from a Secret through the worker's environment.")
    concurrency: int = _f(8, "Requests in flight at once, at most.", ge=1, le=1024)
    batch_size: int = _f(32, "http-json: samples per request (openai-chat sends one sample per request).",
                         ge=1, le=65536)
    timeout_seconds: float = _f(60.0, "Timeout of one request (connect and read); a timed-out request is retried.",
                                gt=0, le=3600)
    retries: int = _f(
        3, "Retries of a request that failed (connection error, timeout, HTTP 408/429/5xx, a malformed answer) "
        "before its samples count as failed; HTTP 4xx other than 408/429 is not retried.", ge=0, le=100)
    backoff_seconds: float = _f(
        1.0, "Wait before the first retry; doubled for each further retry of the same request (at most 60 s).",
        ge=0, le=600)
    rate_limit: float | None = _f(
        None, "Requests started per second, at most, over all of the job's requests to this endpoint; unset: no "
        "limit beyond concurrency.", gt=0, le=100000)
    on_failure: RemoteFailurePolicy = _f(
        RemoteFailurePolicy.FAIL,
        "A sample whose request failed after every retry: fail (the step fails with an error naming the endpoint), "
        "zero (scored 0), or drop-group (its prompt group gets zero advantages, so it adds no gradient, and is left "
        "out of the reward metrics; not with algorithm.dynamicSampling, klPlacement reward or the gae estimator). Each is "
        "counted (reward/remote_failures, rljob_reward_remote_failures_total). In validation a failed sample counts 0.",
    )
    overlap: bool = _f(
        True, "Score while the trainer computes the old/reference log-probs (joined before the advantages), so the "
        "endpoint's latency hides behind work the step does anyway. Off: scoring blocks after the rollout. With "
        "algorithm.dynamicSampling or klPlacement reward the scores are needed first, and scoring always blocks.",
    )
    judge: JudgeSpec | None = _f(None, "The LLM judge of protocol openai-chat (required there, refused with http-json).")


class JudgeServerSpec(ApiModel):
    model: str = _f(description="The judge model vLLM serves: a Hugging Face id or a path in the image or on a "
                    "podTemplate volume (vllm serve MODEL).", min_length=1, max_length=1024)
    image: str = _f("vllm/vllm-openai:v0.26.0", "Image of the judge server (an OpenAI-compatible vLLM image).",
                    max_length=1024)
    gpus: int = _f(1, "GPUs of the judge's pod (nvidia.com/gpu); its vLLM tensor parallel size unless vllmArgs "
                   "says otherwise.", ge=0, le=64)
    vllm_args: list[str] = _f(default_factory=list, description="Extra `vllm serve` arguments, e.g. "
                              "[--max-model-len, '8192', --gpu-memory-utilization, '0.9'].", max_length=256)
    ready_timeout_seconds: int = _f(
        1800, "How long the worker waits at start-up for the judge to answer (model download and load) before it "
        "stops with an error naming spec.reward.server.", ge=1, le=86400)


class RewardRouteSpec(ApiModel):
    function: str | None = _f(
        None, "A built-in reward or module.path:function for this data source (as spec.reward.function).",
        pattern=REWARD_FUNCTION_PATTERN, max_length=256,
    )
    remote: RemoteRewardSpec | None = _f(None, "A remote verifier or judge for this data source (as spec.reward.remote).")


class RewardSpec(ApiModel):
    function: str = _f(
        "gsm8k",
        f"Reward function: a built-in name ({', '.join(BUILTIN_REWARD_NAMES)}) or "
        "module.path:function importable in the worker image, called as f(prompt, completion, ground_truth, extra) -> "
        "float. With rollout.agent, completion is the last turn's text and extra['trajectory'] the whole trajectory "
        "(turns, tool calls and outputs). Unused when remote is set.",
        pattern=REWARD_FUNCTION_PATTERN,
        max_length=256,
    )
    num_workers: int = _f(0, "Processes scoring rewards off the training loop; 0 scores inline.", ge=0, le=256)
    timeout_seconds: float = _f(
        30.0, "Per-sample reward timeout; a timed-out sample fails the step with its index. Only numWorkers > 0 "
        "bounds every reward. With numWorkers 0 an alarm interrupts Python code, but a reward stuck inside C code "
        "(such as a pathological regex), one that catches the alarm (a bare except) or one that sets its own SIGALRM "
        "runs on; when it returns after the limit, the sample fails as timed out.", gt=0)
    remote: RemoteRewardSpec | None = _f(
        None, "Score over HTTP instead of with function: a verifier service (http-json) or an OpenAI-compatible LLM "
        "judge (openai-chat). The worker probes the endpoint at start-up.")
    server: JudgeServerSpec | None = _f(
        None, "Run the judge for this job: the operator creates a vLLM OpenAI-compatible server (a Deployment "
        "and a Service <job>-judge on port 8000, owned by the RLJob, deleted with it) and spec.reward.remote "
        "(protocol openai-chat) reaches it when its url is unset; the worker waits for it to answer before "
        "training.")
    by_source: dict[str, RewardRouteSpec] = _f(
        default_factory=dict,
        description="Rewards by data source (the data_source column; synthetic tasks use the task name): "
        "{<data_source>: {function} or {remote}}; samples of other sources use function / remote above. Metrics "
        "are reported per source (reward/<source>/mean, reward/<source>/count, val/<source>/...).",
        max_length=64,
    )


class CheckpointSpec(ApiModel):
    uri: str = _f(
        "file:///tmp/rljob-checkpoints",
        "Where checkpoints go: s3://bucket/prefix or a path on a mounted volume; the job writes under "
        "<uri>/<namespace>/<name>/step_NNNNNN/. (verl: trainer.default_local_dir)",
        pattern=STORAGE_URI_PATTERN,
        max_length=1024,
    )
    save_freq: int = _f(30, "Save every this many steps (and at the end); -1 saves only at the end; 0 never saves (benchmarks: "
        "nothing to resume from). (verl: trainer.save_freq)", ge=-1)
    max_to_keep: int = _f(5, "Committed checkpoints kept; older ones are deleted after a newer one commits; 0 keeps all. (verl: trainer.max_actor_ckpt_to_keep)", ge=0)
    resume_mode: ResumeMode = _f(ResumeMode.AUTO, "auto (newest committed step), disable, or uri (checkpoint.resumeFrom, "
                                 "until the job has a step of its own). disable means not from an earlier job's "
                                 "steps: they move to <job prefix>/superseded/<time>/ (the newest 2 such folders are "
                                 "kept, all with maxToKeep 0), while a restart of the same RLJob (uid) continues its "
                                 "own steps. (verl: trainer.resume_mode)")
    resume_from: str | None = _f(
        None, "Checkpoint step folder to resume from when resumeMode is uri. (verl: trainer.resume_from_path)", pattern=STORAGE_URI_PATTERN, max_length=1024
    )
    export_hf: bool = _f(True, "Write a Hugging Face safetensors export of the final policy under <job prefix>/hf/.")
    export_critic: bool = _f(
        False, "PPO: also write the final critic under <job prefix>/hf-critic/ as a Hugging Face token-classification "
        "model with one label (<Model>ForTokenClassification: the critic's layers, its value head as the classifier "
        "`score`); its logit after token t is the value of the next state. (verl: the critic's HF checkpoint)")
    save_on_preemption: bool = _f(True, "On SIGTERM (eviction, suspend) save a checkpoint before exiting when the grace period allows.")
    compile_cache: bool = _f(
        True, "Keep the compiled kernels (inductor, Triton and vLLM compile caches) in this storage under "
        "<job prefix>/compile-cache/, saved after the first step that compiled and restored by every new pod "
        "before its model is built, so a preempted or moved job does not compile again (minutes at 0.5B-7B). "
        "One archive per model shape, dtype, GPU, library versions and engine settings; a missing or bad "
        "archive only means a compile.")


class SecretKeyRef(ApiModel):
    name: str = _f(description="Secret name in the RLJob's namespace.", min_length=1, max_length=253)
    access_key_id_key: str = _f("AWS_ACCESS_KEY_ID", "Key of the access key id in the Secret.")
    secret_access_key_key: str = _f("AWS_SECRET_ACCESS_KEY", "Key of the secret access key in the Secret.")


class S3Spec(ApiModel):
    endpoint: str | None = _f(
        None, "S3-compatible endpoint URL (MinIO, SeaweedFS, Ceph); unset uses AWS.", pattern=S3_ENDPOINT_PATTERN, max_length=1024
    )
    region: str = _f("us-east-1", "Region name passed to the client.", max_length=64)
    credentials_secret_ref: SecretKeyRef | None = _f(
        None, "Secret with the access key pair; injected into the worker as env references, never copied."
    )
    addressing_style: Literal["path", "virtual"] = _f("path", "Bucket addressing; S3-compatible servers usually need path.")


class MetricsSpec(ApiModel):
    enabled: bool = _f(True, "Serve Prometheus metrics from the worker.")
    port: int = _f(9400, "Port of the worker's /metrics endpoint in its pod.", ge=1024, le=65535)
    pod_monitor: bool = _f(False, "Create a PodMonitor (needs the Prometheus operator CRDs).")
    tensorboard_dir: str | None = _f(None, "Also write TensorBoard scalars here (a path on a mounted volume).", max_length=1024)


class TrackerSecretRef(ApiModel):
    name: str = _f(description="Secret name in the RLJob's namespace.", min_length=1, max_length=253)
    key: str = _f(description="Key of the credential in the Secret.", min_length=1, max_length=253)


class MlflowSpec(ApiModel):
    tracking_uri: str = _f(
        description="MLflow tracking server, http(s)://host[:port][/path]. The token (if the server needs one) comes "
        "from tokenSecretRef as MLFLOW_TRACKING_TOKEN.",
        pattern=r"^https?://[^\s]+$",
        max_length=1024,
    )
    experiment: str = _f("rljob", "Experiment the run is logged under (created when missing).", min_length=1, max_length=500)
    run_name: str | None = _f(None, "Run name; unset uses <namespace>/<RLJob name>.", max_length=250)
    token_secret_ref: TrackerSecretRef | None = _f(
        None, "Secret key holding the server's bearer token; injected as the env MLFLOW_TRACKING_TOKEN, never copied "
        "or logged.")


class WandbSpec(ApiModel):
    project: str = _f(description="Weights & Biases project.", min_length=1, max_length=128)
    entity: str | None = _f(None, "Team or user owning the project; unset uses the API key's default entity.", max_length=128)
    mode: Literal["online", "offline"] = _f(
        "online", "online sends to W&B as the run goes; offline writes the run under <workdir>/wandb for a later "
        "`wandb sync` (air-gapped clusters, tests).")
    run_name: str | None = _f(None, "Display name of the run; unset uses <namespace>/<RLJob name>.", max_length=128)
    api_key_secret_ref: TrackerSecretRef | None = _f(
        None, "Secret key holding the W&B API key; injected as the env WANDB_API_KEY, never copied or logged. Needed "
        "in online mode.")


class TrackingSpec(ApiModel):
    mlflow: MlflowSpec | None = _f(None, "Log the run to an MLflow tracking server.")
    wandb: WandbSpec | None = _f(None, "Log the run to Weights & Biases.")
    required: bool = _f(
        False, "A tracker that cannot be reached or authenticated at start fails the job (exit 2) instead of a "
        "one-line warning; an outage later never stops training either way.")


class RunPolicySpec(ApiModel):
    backoff_limit: int = _f(
        3, "Restart budget: pod restarts before the PyTorchJob is failed; with childKind JobSet, whole-JobSet "
        "restarts (failurePolicy.maxRestarts).", ge=0, le=1000)
    active_deadline_seconds: int | None = _f(None, "Wall-clock limit of the whole job.", ge=1)
    ttl_seconds_after_finished: int | None = _f(None, "Delete the PyTorchJob's pods this long after it finishes.", ge=0)


class PodTemplateSpec(ApiModel):
    resources: dict[str, dict[str, Quantity]] = _f(
        default_factory=dict,
        description="Container resources (requests/limits). GPUs are set from gpusPerNode; give cpu/memory here.",
    )
    node_selector: dict[str, str] = _f(default_factory=dict, description="Node selector for the training pods.")
    tolerations: list[dict[str, Any]] = _f(
        default_factory=list,
        description="Tolerations for the training pods (core/v1 Toleration).",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    volumes: list[dict[str, Any]] = _f(
        default_factory=list,
        description="Extra pod volumes (core/v1 Volume), e.g. a PVC with model weights. The names rljob-spec, dshm "
                    "and (GPU pods) compile-cache are the operator's own.",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    volume_mounts: list[dict[str, Any]] = _f(
        default_factory=list,
        description="Extra container volume mounts (core/v1 VolumeMount), each naming a volume; /etc/rljob, /dev/shm "
                    "and (GPU pods) /var/cache/rljob/compile are the operator's mount paths.",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    env: list[dict[str, Any]] = _f(
        default_factory=list,
        description="Extra container environment variables (core/v1 EnvVar).",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    labels: dict[str, str] = _f(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = _f(default_factory=dict, description="Extra pod annotations.")
    service_account_name: str | None = _f(None, "Service account of the training pods.", max_length=253)
    image_pull_secrets: list[str] = _f(default_factory=list, description="Names of image pull secrets.")
    priority_class_name: str | None = _f(None, "Priority class of the training pods.", max_length=253)
    scheduler_name: str | None = _f(None, "Scheduler of the training pods (e.g. volcano, kueue-aware schedulers).", max_length=253)
    termination_grace_period_seconds: int = _f(
        300, "Time a pod gets after SIGTERM; the worker spends it saving a checkpoint.", ge=0, le=86400
    )
    shm_size: str = _f("16Gi", "Size limit of the in-memory /dev/shm (NCCL and the rollout engine need more than 64Mi).", pattern=SHM_SIZE_PATTERN)


class RLJobSpec(ApiModel):
    image: str | None = _f(
        None, "Worker image; unset uses the operator's default (chart value worker.image).", max_length=1024
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = _f("IfNotPresent", "Image pull policy of the worker container.")
    nnodes: int = _f(1, "Pods (nodes); one Master plus nnodes-1 Workers. (verl: trainer.nnodes)", ge=1, le=4096)
    gpus_per_node: int = _f(8, "GPUs per pod, one training process each; with device cpu, processes per pod. (verl: trainer.n_gpus_per_node)", ge=1, le=64)
    device: Literal["gpu", "cpu"] = _f("gpu", "gpu requests gpusPerNode GPUs per pod; cpu runs gloo processes (tests, quickstart).")
    suspend: bool = _f(False, "Suspend the job: a checkpoint is saved, pods are deleted; false resumes from it.")
    child_kind: ChildKind = _f(
        ChildKind.PYTORCHJOB,
        "The workload the operator creates: PyTorchJob (Kubeflow training-operator v1; one Master, nnodes-1 "
        "Workers) or JobSet (jobset.x-k8s.io/v1alpha2; one `trainer` replicatedJob, an Indexed Job of nnodes "
        "pods). Kueue >= 0.19 manages JobSets by default but no longer PyTorchJobs. A launch-time field: "
        "change it while suspended.")
    model: ModelSpec = _f(description="The policy model.")
    data: DataSpec = _f(default_factory=DataSpec, description="Training and validation data.")
    algorithm: AlgorithmSpec = _f(default_factory=AlgorithmSpec, description="RL algorithm and loss.")
    sft: SFTSpec | None = _f(None, "Supervised fine-tuning data and schedule; required by (and only allowed with) "
                             "algorithm.name sft.")
    rollout: RolloutSpec = _f(default_factory=RolloutSpec, description="Generation engine and sampling.")
    training: TrainingSpec = _f(default_factory=TrainingSpec, description="Batch sizes, optimizer and schedule.")
    megatron: MegatronSpec = _f(default_factory=MegatronSpec, description="megatron-core parallelism, memory and recompute.")
    lora: LoraSpec | None = _f(
        None, "Train the policy as low-rank adapters on frozen base weights: checkpoints hold the adapters only "
        "(megabytes for a 7B model), the reference model is the base with the adapters off (no second copy), the "
        "rollout engine gets merged weights. Unset trains every weight. Use about 10x the full fine-tuning "
        "learning rate (`rljob explain spec.lora`).")
    critic: CriticSpec | None = _f(
        None, "The value model of PPO; required by (and only allowed with) algorithm.advantageEstimator gae. "
        "(verl: critic.*)",
    )
    reward: RewardSpec = _f(default_factory=RewardSpec, description="Reward function.")
    tools: list[ToolSpec] = _f(default_factory=list, description="Tools the model may call in multi-turn rollouts "
                               "(rollout.agent).", max_length=32)
    checkpoint: CheckpointSpec = _f(default_factory=CheckpointSpec, description="Checkpointing and resume.")
    s3: S3Spec = _f(default_factory=S3Spec, description="Object storage connection for s3:// URIs.")
    metrics: MetricsSpec = _f(default_factory=MetricsSpec, description="Prometheus metrics.")
    tracking: TrackingSpec = _f(
        default_factory=TrackingSpec, description="Experiment trackers (MLflow, Weights & Biases) beside Prometheus; "
        "rank 0 logs every step's metrics, the spec and the validation samples.")
    run_policy: RunPolicySpec = _f(default_factory=RunPolicySpec, description="Retries and deadlines of the child (PyTorchJob or JobSet).")
    pod_template: PodTemplateSpec = _f(default_factory=PodTemplateSpec, description="Overrides of the training pods.")


# --------------------------------------------------------------------------- status


class Condition(ApiModel):
    type: str = _f(description="Accepted, Running, Succeeded, Failed or Suspended; Admitted (a job in a Kueue queue), "
                   "RewardsHealthy (non-finite rewards), JudgeReady (spec.reward.server).")
    status: Literal["True", "False", "Unknown"] = _f(description="Condition status.")
    reason: str = _f(description="One CamelCase word saying why.")
    message: str = _f("", "A sentence for humans.")
    last_transition_time: str | None = _f(None, "When status last changed (RFC 3339).")
    observed_generation: int | None = _f(None, "metadata.generation this condition was computed from.")


class CheckpointRefStatus(ApiModel):
    step: int = _f(description="Training step of the checkpoint.")
    uri: str = _f(description="Committed checkpoint folder.")
    time: str | None = _f(None, "When it was committed (RFC 3339).")


class QuarantinedCheckpointStatus(ApiModel):
    step: int = _f(description="Training step whose checkpoint failed its checksums.")
    uri: str = _f(description="Where it was moved (under quarantine/), kept for inspection.")
    reason: str | None = _f(None, "What failed.")


class TrackerRunStatus(ApiModel):
    tracker: Literal["mlflow", "wandb"] = _f(description="mlflow or wandb.")
    run_id: str = _f(description="The tracker's run id.")
    url: str | None = _f(None, "Where the run is shown (none for a W&B offline run).")


class TrainerStatus(ApiModel):
    step: int = _f(0, "Last finished training step.")
    total_steps: int | None = _f(None, "Steps the run will take.")
    progress_percentage: int | None = _f(None, "step / totalSteps in percent.")
    reward_mean: float | None = _f(None, "Mean training reward of the last step.")
    val_reward_mean: float | None = _f(None, "Mean validation reward of the last validation.")
    val_pass_at_k: dict[str, float] | None = _f(
        None, "The last validation over all data sources, by key pass@k (k = 1, 2, 4, ... and rollout.valN; "
        "unbiased estimator, a sample correct when its reward is >= 1) and mean@n (mean reward of the n samples).")
    nonfinite_rewards: int | None = _f(
        None, "Samples whose reward came back NaN or +-Inf so far (scored 0); above 0 the reward function has a bug.")
    last_checkpoint: CheckpointRefStatus | None = _f(None, "Newest committed checkpoint.")
    quarantined_checkpoints: list[QuarantinedCheckpointStatus] | None = _f(
        None, "Corrupt checkpoint steps moved to quarantine/ at start-up; the previous committed step loaded. "
        "The newest ones that fit the worker's 4 KiB progress report, oldest first.")
    quarantined_checkpoints_omitted: int | None = _f(
        None, "Older quarantined steps not listed in quarantinedCheckpoints (see the job prefix's quarantine/).")
    tracker_runs: list[TrackerRunStatus] | None = _f(
        None, "The experiment-tracker runs this job logs to (one per tracker; the same run across restarts).")
    last_updated_time: str | None = _f(None, "When the worker last reported (RFC 3339).")


class RLJobStatus(ApiModel):
    observed_generation: int | None = _f(None, "metadata.generation the operator last acted on.")
    conditions: list[Condition] = _f(default_factory=list, description="Current conditions, one per type.")
    pytorch_job_name: str | None = _f(None, "Name of the PyTorchJob running this RLJob (childKind PyTorchJob).")
    job_set_name: str | None = _f(None, "Name of the JobSet running this RLJob (childKind JobSet).")
    start_time: str | None = _f(None, "When training pods first ran (RFC 3339).")
    completion_time: str | None = _f(None, "When the job succeeded or failed (RFC 3339).")
    trainer: TrainerStatus | None = _f(None, "Progress reported by the worker.")


class ObjectMeta(BaseModel):
    """The subset of metadata the operator and worker read; everything else passes through."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("rljob", description="Object name.", max_length=63)
    namespace: str = Field("default", description="Namespace.")
    generation: int | None = Field(None, description="Spec generation.")
    uid: str | None = Field(None, description="Object uid.")
    labels: dict[str, str] = Field(default_factory=dict, description=(
        "Object labels. kueue.x-k8s.io/queue-name and kueue.x-k8s.io/priority-class are copied to the PyTorchJob "
        "when it is created (the job then waits for Kueue's admission)."))


class RLJob(ApiModel):
    api_version: Literal["rljob.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion", description="rljob.dev/v1alpha1")
    kind: Literal["RLJob"] = Field(KIND, description="RLJob")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Standard object metadata.")
    spec: RLJobSpec = Field(description="What to train and how.")
    status: RLJobStatus | None = Field(None, description="Observed state, written by the operator.")
