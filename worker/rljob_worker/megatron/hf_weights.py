"""HF safetensors <-> megatron-core GPTModel weights, sliced per tensor-parallel rank.

One mapping table per architecture (plain data): ``(megatron name, HF names, kind)`` with ``{i}``
standing for the layer index. Kinds say how the HF tensors become this rank's megatron shard:

- ``replicated``: copied whole (norms).
- ``column`` / ``row``: split along dim 0 / dim 1 (ColumnParallelLinear / RowParallelLinear).
- ``vocab``: padded to the padded vocab size, then split along dim 0 (VocabParallelEmbedding and the
  output layer).
- ``qkv``: q, k, v projections fused into megatron's ``linear_qkv``; per query group ``g`` the rows
  are ``[q heads of g | k_g | v_g]`` and each TP rank holds a contiguous run of groups.
- ``gate_up``: ``[gate shard ; up shard]`` per TP rank (megatron's SwiGLU ``linear_fc1``).

Pipeline parallelism: a rank holds one or more model chunks (``GPTModel`` with ``pre_process`` /
``post_process``; several with virtual pipeline stages). Each chunk's layers are numbered locally
from 0; the HF index is the layer's global one (megatron's ``layer_number - 1``). The embedding lives
on the first chunk of the first stage, the final norm and output layer on the last chunk of the last
stage; with tied embeddings the last stage's output layer is a copy of the embedding (loaded from
``model.embed_tokens.weight`` too).

Loading reads only this rank's slice of each tensor (``safe_open(...).get_slice``), so no rank
materialises the full model. Export all-gathers each parameter over the TP group, broadcasts it from
the pipeline stage that owns it, and yields full HF-named tensors one at a time on every rank; every
rank of a model-parallel group must iterate the generator to the end (the gathers are collective).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from . import moe

Entry = tuple[str, tuple[str, ...], str]

_LAYER_NORMS: list[Entry] = [
    ("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
    (
        "decoder.layers.{i}.pre_mlp_layernorm.weight",
        ("model.layers.{i}.post_attention_layernorm.weight",),
        "replicated",
    ),
]

LLAMA_TABLE: list[Entry] = [
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    *_LAYER_NORMS,
    (
        "decoder.layers.{i}.self_attention.linear_qkv.weight",
        (
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ),
        "qkv",
    ),
    (
        "decoder.layers.{i}.self_attention.linear_proj.weight",
        ("model.layers.{i}.self_attn.o_proj.weight",),
        "row",
    ),
    (
        "decoder.layers.{i}.mlp.linear_fc1.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "gate_up",
    ),
    ("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "row"),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
]

QWEN2_TABLE: list[Entry] = [
    *LLAMA_TABLE,
    (
        "decoder.layers.{i}.self_attention.linear_qkv.bias",
        (
            "model.layers.{i}.self_attn.q_proj.bias",
            "model.layers.{i}.self_attn.k_proj.bias",
            "model.layers.{i}.self_attn.v_proj.bias",
        ),
        "qkv",
    ),
]

QWEN3_TABLE: list[Entry] = [
    *LLAMA_TABLE,
    (
        "decoder.layers.{i}.self_attention.q_layernorm.weight",
        ("model.layers.{i}.self_attn.q_norm.weight",),
        "replicated",
    ),
    (
        "decoder.layers.{i}.self_attention.k_layernorm.weight",
        ("model.layers.{i}.self_attn.k_norm.weight",),
        "replicated",
    ),
]

# MoE: the router and shared experts are per-layer entries; the experts themselves are mapped by
# moe.load_expert_weights / moe.export_expert_weights (EP slice, global expert index).
QWEN3_MOE_TABLE: list[Entry] = [*QWEN3_TABLE, *moe.MOE_LAYER_ENTRIES]
QWEN2_MOE_TABLE: list[Entry] = [*QWEN2_TABLE, *moe.MOE_LAYER_ENTRIES]

TABLES: dict[str, list[Entry]] = {
    "llama": LLAMA_TABLE,
    "qwen2": QWEN2_TABLE,
    "qwen3": QWEN3_TABLE,
    "qwen3_moe": QWEN3_MOE_TABLE,
    "qwen2_moe": QWEN2_MOE_TABLE,
}

# The TE layer spec fuses the pre-attention / pre-MLP norms into the following linear layer.
_TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


# --------------------------------------------------------------------------------------------------
# helpers


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def _pp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    return (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_group(),
    )


def _expanded(table: list[Entry], num_layers: int, tied: bool) -> list[tuple[str, tuple[str, ...], str]]:
    """The whole model's ``(megatron name, HF names, kind)`` with global layer indices."""
    out = []
    for mname, hf_names, kind in table:
        if tied and mname == "output_layer.weight":
            continue
        layers = range(num_layers) if "{i}" in mname else [0]  # format() ignores i without {i}
        for i in layers:
            out.append((mname.format(i=i), tuple(h.format(i=i) for h in hf_names), kind))
    return out


_OUTPUT_LAYER = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"
_FINAL_NORM = "decoder.final_layernorm.weight"


def _chunk_entries(
    chunk: torch.nn.Module, table: list[Entry], tied: bool
) -> list[tuple[str, str, tuple[str, ...], str]]:
    """``(local megatron name, global megatron name, HF names, kind)`` for what ``chunk`` holds: its
    layers (local index -> global index), the embedding if it pre-processes, the final norm and
    output layer if it post-processes. A tied output layer on a stage without the embedding is the
    embedding's copy: it maps to ``model.embed_tokens.weight`` (global name ``output_layer.weight``,
    which HF export skips)."""
    layers = [layer.layer_number - 1 for layer in chunk.decoder.layers]
    out = []
    for mname, hf_names, kind in table:
        if "{i}" in mname:
            for local, i in enumerate(layers):
                out.append(
                    (mname.format(i=local), mname.format(i=i), tuple(h.format(i=i) for h in hf_names), kind)
                )
        elif mname == _EMBEDDING:
            if chunk.pre_process:
                out.append((mname, mname, hf_names, kind))
        elif mname == _OUTPUT_LAYER:  # tied on one stage: the embedding itself, no parameter
            if chunk.post_process and not tied:
                out.append((mname, mname, hf_names, kind))
            elif chunk.post_process and tied and not chunk.pre_process:
                embed = next(h for m, h, _ in table if m == _EMBEDDING)
                out.append((mname, mname, embed, "vocab"))
        elif chunk.post_process:  # the final norm
            out.append((mname, mname, hf_names, kind))
    return out


def _chunks(model) -> list[torch.nn.Module]:
    """The GPTModel chunks of ``model``: a module, or a list / ModuleList of model chunks."""
    items = list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]
    return [unwrap_model(m) for m in items]


def _resolve(params: dict[str, torch.nn.Parameter], name: str) -> str | None:
    if name in params:
        return name
    for local, te in _TE_ALIASES.items():
        if name.endswith(local):
            alias = name[: -len(local)] + te
            if alias in params:
                return alias
    return None


def _table_for(model_type: str) -> list[Entry]:
    try:
        return TABLES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type={model_type!r} has no HF weight mapping (supported: {sorted(TABLES)})"
        ) from None


class _Geometry:
    """Shapes the slicing needs, from megatron's TransformerConfig."""

    def __init__(self, model: torch.nn.Module, hf_vocab_size: int):
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.groups = cfg.num_query_groups or cfg.num_attention_heads
        self.head_dim = cfg.kv_channels
        self.q_per_group = self.heads // self.groups
        self.hf_vocab = hf_vocab_size
        self.padded_vocab = model.vocab_size


# --------------------------------------------------------------------------------------------------
# HF files


class SafetensorsReader:
    """Lazily opened safetensors shards of an HF checkpoint directory (single or indexed)."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.dir = os.fspath(hf_dir)
        index = os.path.join(self.dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.where = dict(json.load(f)["weight_map"])
        else:
            single = os.path.join(self.dir, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {self.dir}")
            with safe_open(single, framework="pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (not iterable)
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def slice(self, name: str):
        """A lazy slice object: index it (``[a:b]``, ``[:, a:b]``) to read part of the tensor."""
        if name not in self.where:
            raise KeyError(f"{name} not found in the HF checkpoint at {self.dir}")
        fname = self.where[name]
        if fname not in self._handles:
            self._handles[fname] = self._safe_open(os.path.join(self.dir, fname), framework="pt")
        return self._handles[fname].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self.slice(name).get_shape())


# --------------------------------------------------------------------------------------------------
# HF -> this rank's megatron shard


def _load_shard(
    reader: SafetensorsReader, hf_names: tuple[str, ...], kind: str, geo: _Geometry, r: int, t: int
):
    if kind == "replicated":
        return reader.slice(hf_names[0])[:]
    if kind in ("column", "row"):
        sl = reader.slice(hf_names[0])
        dim = 0 if kind == "column" else 1
        n = sl.get_shape()[dim]
        if n % t:
            raise ValueError(f"{hf_names[0]}: dim {dim} of size {n} is not divisible by TP={t}")
        a, b = r * n // t, (r + 1) * n // t
        return sl[a:b] if dim == 0 else sl[:, a:b]
    if kind == "vocab":
        sl = reader.slice(hf_names[0])
        rows, hidden = sl.get_shape()
        if rows != geo.hf_vocab:
            raise ValueError(f"{hf_names[0]} has {rows} rows but the config's vocab_size is {geo.hf_vocab}")
        chunk = geo.padded_vocab // t
        a, b = r * chunk, (r + 1) * chunk
        part = sl[a : min(b, rows)] if a < rows else None
        if part is not None and part.shape[0] == chunk:
            return part
        out = torch.zeros(chunk, hidden, dtype=part.dtype if part is not None else torch.float32)
        if part is not None:
            out[: part.shape[0]] = part
        return out
    if kind == "qkv":
        q, k, v = (reader.slice(n) for n in hf_names)
        g_local = geo.groups // t
        g0, g1 = r * g_local, (r + 1) * g_local
        hd, qpg = geo.head_dim, geo.q_per_group
        qs = q[g0 * qpg * hd : g1 * qpg * hd]
        ks = k[g0 * hd : g1 * hd]
        vs = v[g0 * hd : g1 * hd]
        rest = tuple(qs.shape[1:])
        fused = torch.cat(
            [
                qs.reshape(g_local, qpg * hd, *rest),
                ks.reshape(g_local, hd, *rest),
                vs.reshape(g_local, hd, *rest),
            ],
            dim=1,
        )
        return fused.reshape(g_local * (qpg + 2) * hd, *rest)
    if kind == "gate_up":
        gate, up = (reader.slice(n) for n in hf_names)
        f = gate.get_shape()[0]
        a, b = r * f // t, (r + 1) * f // t
        return torch.cat([gate[a:b], up[a:b]], dim=0)
    raise ValueError(f"unknown mapping kind {kind!r}")


def load_hf_config(hf_dir: str | os.PathLike):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.fspath(hf_dir))


@torch.no_grad()
def load_hf_weights(model, hf_dir: str | os.PathLike, hf_config=None, skip=()) -> list[str]:
    """Copy this rank's share of every parameter from the HF checkpoint in ``hf_dir``: its TP shard
    of the layers its model chunks hold (``model``: a GPTModel or a list of this rank's chunks).

    Strict: every megatron parameter must be covered by the table and every shape must match, except
    the megatron names in ``skip`` (global names, e.g. a critic's ``output_layer.weight``), which are
    neither loaded nor required.
    Returns the megatron parameter names loaded (prefixed ``"<chunk>."`` with several chunks).
    """
    chunks = _chunks(model)
    hf_config = hf_config if hf_config is not None else load_hf_config(hf_dir)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    table = _table_for(hf_config.model_type)
    r, t, _ = _tp()
    reader = SafetensorsReader(hf_dir)
    loaded: list[str] = []
    for c, chunk in enumerate(chunks):
        prefix = f"{c}." if len(chunks) > 1 else ""
        geo = _Geometry(chunk, hf_config.vocab_size)
        params = dict(chunk.named_parameters())
        done: list[str] = []
        for mname, global_name, hf_names, kind in _chunk_entries(chunk, table, tied):
            if global_name in skip:
                continue
            target = _resolve(params, mname)
            if target is None:
                if any(h not in reader for h in hf_names):
                    continue  # optional entry absent on both sides
                raise ValueError(f"the megatron model has no parameter {mname} for HF tensor(s) {hf_names}")
            shard = _load_shard(reader, hf_names, kind, geo, r, t)
            param = params[target]
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{target}: HF {hf_names} gives shard shape {tuple(shard.shape)}, megatron expects {tuple(param.shape)}"
                )
            param.data.copy_(shard)
            done.append(target)
        if moe.is_moe(hf_config):
            done += moe.load_expert_weights(chunk, reader, hf_config, _load_shard, geo)
        missing = sorted(set(params) - set(done) - set(skip))
        if missing:
            raise ValueError(f"parameters not loaded from {hf_dir}: {missing}")
        loaded += [prefix + name for name in done]
    return loaded


# --------------------------------------------------------------------------------------------------
# megatron -> full HF tensors


def _partition_dim(kind: str) -> int | None:
    return {"replicated": None, "row": 1}.get(kind, 0)


def _gather(local: torch.Tensor, dim: int | None, t: int, group) -> torch.Tensor:
    if dim is None or t == 1:
        return local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(t)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=dim)


def _split_full(full: torch.Tensor, hf_names: tuple[str, ...], kind: str, geo: _Geometry, t: int):
    if kind in ("replicated", "column", "row"):
        return [(hf_names[0], full)]
    if kind == "vocab":
        return [(hf_names[0], full[: geo.hf_vocab])]
    if kind == "qkv":
        hd, qpg = geo.head_dim, geo.q_per_group
        rest = tuple(full.shape[1:])
        grouped = full.reshape(geo.groups, (qpg + 2) * hd, *rest)
        q, k, v = torch.split(grouped, [qpg * hd, hd, hd], dim=1)
        return [
            (hf_names[0], q.reshape(geo.heads * hd, *rest)),
            (hf_names[1], k.reshape(geo.groups * hd, *rest)),
            (hf_names[2], v.reshape(geo.groups * hd, *rest)),
        ]
    if kind == "gate_up":
        rest = tuple(full.shape[1:])
        per_rank = full.reshape(t, 2, full.shape[0] // (2 * t), *rest)
        return [
            (hf_names[0], per_rank[:, 0].reshape(-1, *rest)),
            (hf_names[1], per_rank[:, 1].reshape(-1, *rest)),
        ]
    raise ValueError(f"unknown mapping kind {kind!r}")


def _local_params(chunks, table, tied) -> dict[str, tuple[torch.Tensor, str]]:
    """``{global megatron name: (this rank's parameter, kind)}`` over this rank's chunks (the tied
    output-layer copy is left out: HF's files hold the embedding only)."""
    out = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for local, name, _, kind in _chunk_entries(chunk, table, tied):
            target = _resolve(params, local)
            if target is not None and not (tied and name == _OUTPUT_LAYER):
                out[name] = (params[target].detach(), kind)
    return out


def _owners(local: dict[str, tuple[torch.Tensor, str]], pp_size: int, pp_group):
    """``{global megatron name: (pipeline rank, TP-local shape, dtype)}`` over the PP group."""
    mine = {name: (tuple(p.shape), p.dtype) for name, (p, _) in local.items()}
    if pp_size == 1:
        return {name: (0, *v) for name, v in mine.items()}
    everyone: list[Any] = [None] * pp_size
    dist.all_gather_object(everyone, mine, group=pp_group)
    return {name: (rank, *v) for rank, names in enumerate(everyone) for name, v in names.items()}


def _full_shape(local_shape: tuple[int, ...], dim: int | None, t: int) -> tuple[int, ...]:
    if dim is None or t == 1:
        return local_shape
    return tuple(n * t if d == dim else n for d, n in enumerate(local_shape))


@torch.no_grad()
def export_hf_weights(model, hf_config, dtype: torch.dtype | None = None,
                      weight_of: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                      only: set[str] | None = None,
                      skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` one at a time, on every rank: each parameter is all-gathered
    over the TP group by the pipeline stage that holds it, then broadcast over the PP group.

    ``weight_of(global megatron name, local shard) -> shard`` replaces what is exported of a parameter
    (LoRA: the merged ``W + s B A``, computed shard by shard before the gather); ``only``: the global
    megatron names to export (the same set on every rank), e.g. just the weights LoRA changes; ``skip``: global
    megatron names never exported (a critic's value head, which is not an ``lm_head``).

    ``model``: a GPTModel or a list of this rank's model chunks. Collective: all ranks of a
    model-parallel group must consume the whole iterator. Tensors are fresh (not views of
    parameters), contiguous, on the parameters' device, cast to ``dtype`` if given. For tied
    embeddings no ``lm_head.weight`` is yielded (as HF's ``save_pretrained``). Experts (MoE) are
    gathered over expert TP and EP within their stage, then sent over the PP group one at a time.
    """
    chunks = _chunks(model)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    table = _table_for(hf_config.model_type)
    _, t, tp_group = _tp()
    pp_rank, pp_size, pp_group = _pp()
    geo = _Geometry(chunks[0], hf_config.vocab_size)
    device = next(chunks[0].parameters()).device
    local = _local_params(chunks, table, tied)
    owners = _owners(local, pp_size, pp_group)
    for mname, hf_names, kind in _expanded(table, chunks[0].config.num_layers, tied):
        if mname not in owners:
            continue  # an optional entry this architecture variant lacks
        if (only is not None and mname not in only) or mname in skip:
            continue
        owner, shape, param_dtype = owners[mname]
        dim = _partition_dim(kind)
        if owner == pp_rank:
            param = local[mname][0]
            full = _gather(param if weight_of is None else weight_of(mname, param), dim, t, tp_group)
        else:
            param = None
            full = torch.empty(_full_shape(shape, dim, t), dtype=param_dtype, device=device)
        if pp_size > 1:
            full = full.contiguous()
            dist.broadcast(full, src=dist.get_global_rank(pp_group, owner), group=pp_group)
        for name, tensor in _split_full(full, hf_names, kind, geo, t):
            tensor = tensor.to(dtype) if dtype is not None else tensor
            if param is not None and tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
                tensor = tensor.clone()  # never hand out views of live parameters
            yield name, tensor.contiguous()
    if moe.is_moe(hf_config) and only is None:  # gathered copies, never views of parameters
        experts = (
            name_tensor
            for chunk in chunks
            for name_tensor in moe.export_expert_weights(chunk, hf_config, _gather, _split_full, geo)
        )
        if pp_size > 1:
            experts = _broadcast_stream_over_pp(experts, pp_rank, pp_size, pp_group, device)
        for name, tensor in experts:
            yield name, (tensor.to(dtype) if dtype is not None else tensor).contiguous()


def _broadcast_stream_over_pp(local_items, pp_rank: int, pp_size: int, pp_group, device):
    """Every stage's ``(name, tensor)`` stream, stage after stage, on every rank of the PP group: the
    owning stage announces each tensor's name, shape and dtype, then broadcasts it (None ends a stage)."""
    for stage in range(pp_size):
        src = dist.get_global_rank(pp_group, stage)
        mine = iter(local_items) if stage == pp_rank else None
        while True:
            item = next(mine, None) if mine is not None else None
            header = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
            dist.broadcast_object_list(header, src=src, group=pp_group)
            if header[0] is None:
                break
            name, shape, tensor_dtype = header[0]
            tensor = item[1].contiguous() if item is not None else torch.empty(shape, dtype=tensor_dtype, device=device)
            dist.broadcast(tensor, src=src, group=pp_group)
            yield name, tensor


def save_hf_checkpoint(
    model: torch.nn.Module,
    hf_config,
    out_dir: str | os.PathLike,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    weight_of: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    skip: frozenset[str] = frozenset(),
    extra_tensors: dict[str, torch.Tensor] | None = None,
    saved_config=None,
) -> None:
    """Write ``model*.safetensors`` (+ index when sharded), ``config.json`` and the tokenizer.

    ``skip``: megatron names left out (:func:`export_hf_weights`); ``extra_tensors``: HF-named tensors written
    beside the exported ones (global rank 0's); ``saved_config``: the config.json to write when it is not
    ``hf_config`` (which still describes the weights). Collective over all ranks (every model-parallel
    group gathers); global rank 0 writes.
    """
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    exported = export_hf_weights(model, hf_config, dtype=dtype, weight_of=weight_of, skip=skip)
    for name, tensor in itertools.chain(exported, (extra_tensors or {}).items()):
        if not writer:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu()
        size += nbytes
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        if len(shards) == 1:
            save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
                for k, v in shard.items():
                    weight_map[k] = fname
                    total += v.numel() * v.element_size()
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        (saved_config or hf_config).save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()
