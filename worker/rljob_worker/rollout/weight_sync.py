"""Weight sync from the megatron actor into a rollout engine: pure helpers, no vLLM import.

The actor exports ``(HF name, full tensor)`` pairs one at a time (`MegatronActor.export_hf_weights`,
a collective over the training TP group: every TP rank all-gathers and receives every FULL tensor).
An engine consumes that stream in **size-bounded buckets** so that at most one bucket of gathered
tensors (plus the one being produced) is alive at a time — never a full gathered copy of the
model on one GPU.

Resharding when rollout TP != training TP
------------------------------------------
Because every training rank ends up holding each *full* tensor, no tensor has to move between
ranks: each rollout rank hands the full tensors to its own vLLM engine, and vLLM's per-layer
``weight_loader`` slices out that rank's shard (``ColumnParallelLinear.weight_loader`` narrows
``output_dim`` at ``tp_rank * shard_size``; ``RowParallelLinear`` the input dim;
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` fuse q/k/v and gate/up while narrowing
each part — vllm/model_executor/layers/linear.py). So any (training TP, rollout TP) pair works
with the same stream; `RolloutLayout` only says which ranks form one rollout engine, how many
engine replicas there are, and which prompts each replica samples. The price is that each rank
materialises every full tensor once per sync (bounded by the bucket size); a shard-to-shard
fast path for rollout TP == training TP is a possible optimisation, not implemented.

Names
-----
vLLM's ``load_weights`` takes HF checkpoint names and does the q/k/v -> ``qkv_proj`` and
gate/up -> ``gate_up_proj`` fusion itself (``stacked_params_mapping`` in e.g.
vllm/model_executor/models/qwen2.py), and skips ``lm_head.*`` for tied embeddings. So the stream
goes in unchanged except for `to_vllm_names` dropping what vLLM would ignore anyway (tied
``lm_head.weight``, rotary ``inv_freq`` buffers) so that it is not gathered and copied for nothing.
`vllm_param_name` mirrors vLLM's fused naming for diagnostics and tests.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

NamedTensor = tuple[str, torch.Tensor]

DEFAULT_BUCKET_BYTES = 512 * 1024**2

# HF projection name -> (vLLM fused parameter, shard id), as vLLM's stacked_params_mapping.
VLLM_FUSED_PROJECTIONS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_named_tensors(stream: Iterable[NamedTensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[NamedTensor]]:
    """Group a stream of named tensors into consecutive buckets of at most ``bucket_bytes`` bytes.

    Order is preserved and every tensor appears exactly once. A tensor larger than
    ``bucket_bytes`` is yielded alone (the current partial bucket is flushed first). An empty
    stream yields nothing. The stream is pulled lazily: the next tensor is only requested once
    the current bucket has room or has been handed out.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in stream:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        if size >= bucket_bytes:  # full (or a single oversize tensor): hand it out now
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def to_vllm_names(stream: Iterable[NamedTensor], *, tie_word_embeddings: bool) -> Iterator[NamedTensor]:
    """HF-named stream -> what vLLM's ``load_weights`` should receive.

    Names pass unchanged (vLLM fuses q/k/v and gate/up itself); dropped: ``lm_head.weight`` when the
    embeddings are tied (vLLM shares ``embed_tokens`` and skips it) and rotary ``inv_freq``
    buffers (recomputed by vLLM, never loaded).
    """
    for name, tensor in stream:
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        yield name, tensor


def vllm_param_name(hf_name: str) -> tuple[str, str | int | None]:
    """The vLLM parameter an HF tensor lands in, and the shard id within a fused parameter.

    ``model.layers.0.self_attn.k_proj.weight`` -> (``model.layers.0.self_attn.qkv_proj.weight``, "k");
    unfused names map to themselves with shard ``None``.
    """
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in VLLM_FUSED_PROJECTIONS:
            fused, shard = VLLM_FUSED_PROJECTIONS[part]
            return ".".join([*parts[:i], fused, *parts[i + 1:]]), shard
    return hf_name, None


def incomplete_fused(hf_names: Iterable[str]) -> dict[str, list[str | int]]:
    """Fused vLLM parameters that received some but not all of their parts: {vLLM name: missing shard ids}.

    vLLM reports a fused parameter (``qkv_proj``, ``gate_up_proj``) as loaded as soon as one part
    arrives, so a sync that lost, say, ``up_proj`` is only visible on the HF side.
    """
    parts: dict[str, set] = {}
    for name in hf_names:
        fused, shard = vllm_param_name(name)
        if shard is not None:
            parts.setdefault(fused, set()).add(shard)
    expected = {".qkv_proj.": ["q", "k", "v"], ".gate_up_proj.": [0, 1]}
    out = {}
    for fused, got in parts.items():
        for marker, shards in expected.items():
            if marker in fused and set(shards) - got:
                out[fused] = [s for s in shards if s not in got]
    return out


@dataclass
class SyncStats:
    """One weight sync: bytes and tensors moved, and where the time went.

    ``seconds`` is wall time of the whole sync, including waiting on the producer (the megatron
    all-gathers); ``load_seconds`` is the part spent inside the engine's weight loading.
    """

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    load_seconds: float = 0.0

    @property
    def gb(self) -> float:
        return self.bytes / 1e9

    @property
    def gb_per_s(self) -> float:
        return self.gb / self.seconds if self.seconds > 0 else 0.0

    @property
    def s_per_gb(self) -> float:
        return self.seconds / self.gb if self.bytes else 0.0

    def add_bucket(self, bucket: list[NamedTensor], load_seconds: float) -> None:
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += sum(tensor_nbytes(t) for _, t in bucket)
        self.load_seconds += load_seconds

    def metrics(self, prefix: str = "rollout/weight_sync") -> dict[str, float]:
        return {f"{prefix}_s": self.seconds, f"{prefix}_load_s": self.load_seconds, f"{prefix}_gb": self.gb,
                f"{prefix}_gbps": self.gb_per_s, f"{prefix}_s_per_gb": self.s_per_gb}


@dataclass(frozen=True)
class RolloutLayout:
    """Which global ranks form one rollout engine (a rollout-TP group) and what each replica samples.

    Rollout groups are blocks of ``rollout_tp`` consecutive global ranks — the grouping vLLM's
    ``initialize_model_parallel`` builds over an existing torch.distributed world (TP innermost)
    when the engine runs with ``distributed_executor_backend="external_launcher"``. Each group is
    one engine replica; all ranks of a group must call ``generate`` with the same prompts and seeds.
    Every rank receives full tensors from the actor's export and vLLM keeps ``1 / rollout_tp`` of
    each sharded tensor, whatever the training TP size.
    """

    world_size: int
    train_tp: int
    rollout_tp: int

    @property
    def replicas(self) -> int:
        return self.world_size // self.rollout_tp

    def replica_of(self, rank: int) -> int:
        return rank // self.rollout_tp

    def rollout_rank_of(self, rank: int) -> int:
        return rank % self.rollout_tp

    def group(self, replica: int) -> list[int]:
        return list(range(replica * self.rollout_tp, (replica + 1) * self.rollout_tp))

    def prompt_slice(self, num_prompts: int, replica: int) -> slice:
        """Contiguous share of ``num_prompts`` prompts for ``replica`` (sizes differ by at most one)."""
        base, extra = divmod(num_prompts, self.replicas)
        start = replica * base + min(replica, extra)
        return slice(start, start + base + (1 if replica < extra else 0))


def plan_rollout_layout(world_size: int, gpus_per_node: int, train_tp: int, rollout_tp: int) -> RolloutLayout:
    """Validate the rollout TP size against the cluster and return the layout (clear errors name the setting)."""
    if rollout_tp < 1:
        raise ValueError(f"spec.rollout.tensorModelParallelSize must be >= 1, got {rollout_tp}")
    if gpus_per_node % rollout_tp:
        raise ValueError(f"spec.rollout.tensorModelParallelSize={rollout_tp} must divide the GPUs per node "
                         f"({gpus_per_node}): a rollout engine may not span nodes")
    if world_size % rollout_tp:
        raise ValueError(f"spec.rollout.tensorModelParallelSize={rollout_tp} must divide the world size ({world_size})")
    if world_size % train_tp:
        raise ValueError(f"training tensor parallel size {train_tp} must divide the world size ({world_size})")
    return RolloutLayout(world_size=world_size, train_tp=train_tp, rollout_tp=rollout_tp)
