"""The engine's state between steps: offload / onload of GPU memory around a colocated rollout engine,
distributed checkpoints (``megatron.core.dist_checkpointing``: any TP / PP / VPP / EP layout loads
them), RNG state, and the HF weights out (streamed export, HF checkpoint folder)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from . import hf_weights
from .offload import CATEGORIES, OffloadStateError, assert_materialized
from .optim_step import init_adam_state, init_distributed_optimizer_state, inner_optimizers

log = logging.getLogger(__name__)


class EngineStateMixin:
    """Offload, checkpoints and weight export of the engine (needs its ``models``, ``chunks``,
    ``core``, ``optimizer``, ``mcfg``, ``hf_config``, ``step``, ``_offloader``, ``_offloaded`` and
    process-group attributes)."""

    # ----------------------------------------------------------------------------------------------
    # memory: offload between phases

    @property
    def is_offloaded(self) -> bool:
        return self._offloaded is not None

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Give the GPU memory of the parameters, gradient buffers and/or optimizer state (fp32 main
        params and Adam moments; with the distributed optimizer, this rank's shards) back, e.g. to a
        colocated rollout engine, until :meth:`onload`. Returns the bytes released per category.

        Parameters and optimizer state are copied to pinned host memory; gradient buffers are dropped
        (:meth:`update` zeroes them first anyway) and come back zeroed. Every tensor object and view
        stays the same (their storages are released and reallocated), so DDP's buffers, the
        optimizer's references and ``param.main_grad`` stay wired. On CPU this only checks state
        (unless ``offload_enabled`` is set). Not collective; each rank offloads its own shards.
        While offloaded, forward passes, updates, weight export and checkpoints raise.
        """
        import time

        if self._offloaded is not None:
            raise OffloadStateError(f"already offloaded ({self._offloaded}); call onload() first")
        want = {"params": bool(params), "grads": bool(grads), "optimizer": bool(optimizer)}
        groups = self._offload_groups()
        self.check_device_state(groups)
        if not any(want.values()):
            return {}
        self._offloaded = want
        if not self.offload_enabled:
            return {c: 0 for c, on in want.items() if on}
        t0 = time.perf_counter()
        freed = {}
        for c in CATEGORIES:
            if want[c]:  # scalars (torch Adam's step) and tensors elsewhere (the CPU) free nothing here
                items = [(n, t) for n, t in groups[c] if t.dim() > 0 and t.device == self.device]
                freed[c] = self._offloader.offload(c, items, keep_values=c != "grads")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info(
            "offloaded %s in %.2fs (%s)",
            ", ".join(freed),
            time.perf_counter() - t0,
            ", ".join(f"{c} {b / 2**20:.1f} MiB" for c, b in freed.items()),
        )
        return freed

    def onload(self) -> dict[str, int]:
        """Undo :meth:`offload`; then assert that every parameter, gradient buffer and optimizer
        tensor is on this actor's device with its memory (``OffloadStateError`` otherwise). Returns
        the bytes restored per category; a no-op (apart from the check) when nothing is offloaded."""
        import time

        t0 = time.perf_counter()
        restored = {c: self._offloader.onload(c) for c in CATEGORIES if c in self._offloader.offloaded}
        self._offloaded = None
        self.check_device_state()
        if restored:
            log.info("onloaded %s in %.2fs", ", ".join(restored), time.perf_counter() - t0)
        return restored

    def check_device_state(self, groups: dict[str, list[tuple[str, torch.Tensor]]] | None = None) -> int:
        """Assert every tracked tensor (parameters, buffers, gradient buffers, optimizer main params
        and state) is on this actor's device with its memory; 0-dim optimizer state (torch Adam's
        ``step``) may live on the CPU. Returns how many tensors were checked."""
        groups = self._offload_groups() if groups is None else groups
        named = [item for c in CATEGORIES for item in groups[c]]
        expected = {
            name: (t.device if name.startswith("optimizer state") and t.dim() == 0 else self.device)
            for name, t in named
        }
        return assert_materialized(named, expected, what="actor tensor")

    def _offload_groups(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """``{category: [(name, tensor)]}``; each storage belongs to the first category listing it
        (params, grads, optimizer): an fp32 optimizer's main params *are* the model params."""
        names = {id(p): n for n, p in self.core.named_parameters()}
        params = [(f"param {n}", p) for n, p in self.core.named_parameters()]
        params += [(f"buffer {n}", b) for n, b in self.core.named_buffers() if isinstance(b, torch.Tensor)]
        grads: list[tuple[str, torch.Tensor]] = []
        for c, model in enumerate(self.models):
            ddp_buffers = getattr(model, "buffers", None)  # megatron DDP: a list (nn.Module: a method)
            if not isinstance(ddp_buffers, list):
                continue
            chunk = f" (chunk {c})" if len(self.models) > 1 else ""
            for i, buf in enumerate(ddp_buffers + list(getattr(model, "expert_parallel_buffers", []))):
                if buf.param_data is not None:
                    params.append((f"ddp buffer {i}{chunk} param_data", buf.param_data))
                if buf.grad_data is not None:
                    grads.append((f"ddp buffer {i}{chunk} grad_data", buf.grad_data))
        for n, p in self.core.named_parameters():
            if getattr(p, "main_grad", None) is not None:
                grads.append((f"main_grad {n}", p.main_grad))
            if p.grad is not None:
                grads.append((f"grad {n}", p.grad))
        optim: list[tuple[str, torch.Tensor]] = []
        for k, inner in enumerate(inner_optimizers(self.optimizer)):
            for g, group in enumerate(inner.param_groups):
                for j, mp in enumerate(group["params"]):
                    label = names.get(id(mp), f"[{k}][{g}][{j}]")
                    optim.append((f"optimizer main param {label}", mp))
                    if mp.grad is not None:
                        grads.append((f"optimizer main grad {label}", mp.grad))
                    for key, v in inner.state.get(mp, {}).items():
                        if isinstance(v, torch.Tensor):
                            optim.append((f"optimizer state {label}.{key}", v))
        out: dict[str, list[tuple[str, torch.Tensor]]] = {}
        owned: set[int] = set()
        for c, items in (("params", params), ("grads", grads), ("optimizer", optim)):
            keys = {t.untyped_storage()._cdata for _, t in items}
            out[c] = [(n, t) for n, t in items if t.untyped_storage()._cdata not in owned]
            owned |= keys
        return out

    def _require_onloaded(self, what: str) -> None:
        if self._offloaded is not None:
            raise OffloadStateError(
                f"{what}: the actor is offloaded ({self._offloaded}); call onload() first"
            )

    # ----------------------------------------------------------------------------------------------
    # weights out

    def export_hf_weights(self, dtype: torch.dtype | None = None,
                          only_changed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time, on every rank (collective over the TP and PP groups:
        every rank must consume the iterator). With LoRA the adapted weights are merged (``W + s B A``);
        ``only_changed``: with LoRA, just those (the rest is the base model the engine already has)."""
        self._require_onloaded("export_hf_weights")
        if self.lora is None:
            return hf_weights.export_hf_weights(self.chunks, self.hf_config, dtype=dtype)
        only = self.lora.changed_weight_names(self.hf_config.num_hidden_layers) if only_changed else None
        return hf_weights.export_hf_weights(self.chunks, self.hf_config, dtype=dtype, weight_of=self.lora.weight_of,
                                            only=only)

    def save_hf_checkpoint(
        self, out_dir: str | os.PathLike, tokenizer=None, dtype: torch.dtype | None = None
    ) -> None:
        """The model as an HF checkpoint folder (with LoRA: merged). Collective; global rank 0 writes."""
        self._require_onloaded("save_hf_checkpoint")
        hf_weights.save_hf_checkpoint(self.chunks, self.hf_config, out_dir, tokenizer=tokenizer, dtype=dtype,
                                      weight_of=self.lora.weight_of if self.lora is not None else None)

    def save_peft_adapter(self, out_dir: str | os.PathLike) -> None:
        """LoRA: the adapters in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``).
        Collective; global rank 0 writes."""
        from .lora import save_peft_adapter

        if self.lora is None:
            raise RuntimeError("save_peft_adapter: this model has no LoRA adapters")
        self._require_onloaded("save_peft_adapter")
        save_peft_adapter(self.lora, self.chunks, self.hf_config, out_dir,
                          writer=not dist.is_initialized() or dist.get_rank() == 0)
        if dist.is_initialized():
            dist.barrier()

    # ----------------------------------------------------------------------------------------------
    # distributed checkpoints (megatron.core.dist_checkpointing: any TP layout can load them)

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """``{"model", "optimizer", "rng", "meta"}`` for ``dist_checkpointing.save/load``.

        CPU: AdamW's ``exp_avg``/``exp_avg_sq`` are sharded like their parameters (so they reshard
        across TP too); AdamW's step count is in ``meta``. GPU: megatron optimizer's own sharded
        state dict (the distributed optimizer in its ``fully_reshardable`` format).
        ``is_loading``: build it as the target of ``dist_checkpointing.load``.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        self._require_onloaded("sharded_state_dict")
        # one dict per model chunk; the tensors inside carry global layer names, so any TP / PP /
        # VPP layout can load them. LoRA: the adapters alone (the base weights are the HF checkpoint's)
        if self.lora is not None:
            model_sd = self.lora.sharded_state_dict()
            kept = self.lora.config.keep_trainable  # fully trained beside the adapters (a critic's value head)
            for chunk in self.chunks if kept else ():
                model_sd.update({k: v for k, v in chunk.sharded_state_dict().items() if k.startswith(kept)})
        elif len(self.chunks) == 1:
            model_sd = self.chunks[0].sharded_state_dict()
        else:
            model_sd = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(self.chunks)}
        if self.optimizer is not None and self.megatron_optimizer and is_loading:
            init_distributed_optimizer_state(self.optimizer)
        if self.optimizer is None:
            optim_sd = None
        elif self.megatron_optimizer:
            # fully_reshardable: any TP/DP layout can load it (megatron 0.16's default format for
            # the distributed optimizer, fully_sharded_model_space, is deprecated and fails to save)
            optim_sd = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
            )
        else:
            optim_sd = self._cpu_optimizer_sharded_state_dict(model_sd)
        # one generator state per model-parallel rank (TP x PP), replicated over DP; without PP the
        # shape stays (tp,) as in checkpoints written before pipeline parallelism
        pp = (self.pp_size,) if self.pp_size > 1 else ()
        rng = ShardedObject(
            "rng_state",
            _rng_state(self.on_gpu),
            global_shape=(*pp, self.tp_size),
            global_offset=(*((self.pp_rank,) if pp else ()), self.tp_rank),
            replica_id=self.dp_rank * self.cp_size + self.cp_rank,  # CP ranks are replicas too
        )
        meta = {
            "step": self.step,
            "tp": self.tp_size,
            "ep": self.parallel.ep,
            "pp": self.pp_size,
            "vpp": self.parallel.vpp,
            "model_type": self.mcfg.model_type,
            "padded_vocab_size": self.mcfg.padded_vocab_size,
        }
        if self.lora is not None:
            meta["lora"] = self.lora.meta()
        out = {"model": model_sd, "optimizer": optim_sd, "rng": rng, "meta": meta}
        if optim_sd is None:
            del out["optimizer"]
        return out

    def _cpu_optimizer_sharded_state_dict(self, model_sd) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        init_adam_state(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        state = self.optimizer.state_dict()
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return state

    def save_checkpoint(self, ckpt_dir: str | os.PathLike) -> None:
        """Collective: every rank calls it with the same directory (created if missing).

        Every rank writes its own shard files into ``ckpt_dir`` (rank 0 also the common state and
        metadata): with node-local disks, each node's files are part of the checkpoint.
        """
        from megatron.core import dist_checkpointing

        ckpt_dir = os.fspath(ckpt_dir)
        os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self.sharded_state_dict(), ckpt_dir)
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: str | os.PathLike) -> dict[str, Any]:
        """Load model, optimizer state (not for a frozen actor) and (same TP and PP only) RNG from
        ``ckpt_dir``, written at any TP / PP / VPP / EP layout; returns its meta (``step``, ``tp``,
        ``pp``, ``vpp``, ``ep``, ``model_type``, ``padded_vocab_size``)."""
        from megatron.core import dist_checkpointing

        ckpt_dir = os.fspath(ckpt_dir)
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
        meta = dict(common.get("meta", {}))
        if meta.get("padded_vocab_size", self.mcfg.padded_vocab_size) != self.mcfg.padded_vocab_size:
            raise ValueError(
                f"checkpoint {ckpt_dir} has a padded vocab of {meta['padded_vocab_size']} (TP={meta.get('tp')}), "
                f"this model {self.mcfg.padded_vocab_size} (TP={self.tp_size}); load it with a TP that pads alike"
            )
        self._check_lora_checkpoint(meta.get("lora"), ckpt_dir)
        sd = self.sharded_state_dict(is_loading=True)
        same_layout = meta.get("tp") == self.tp_size and meta.get("pp", 1) == self.pp_size
        if not same_layout:
            del sd["rng"]  # per-rank generator states do not map onto another TP / PP layout
        loaded = dist_checkpointing.load(sd, ckpt_dir)
        if self.lora is not None:
            self.lora.load(loaded["model"])
            kept = {k: v for k, v in loaded["model"].items() if not k.startswith("lora.")}
            for chunk in self.chunks if kept else ():
                chunk.load_state_dict({k: v for k, v in kept.items() if k in chunk.state_dict()}, strict=False)
        elif len(self.chunks) == 1:
            self.chunks[0].load_state_dict(loaded["model"], strict=True)
        else:
            for i, chunk in enumerate(self.chunks):
                chunk.load_state_dict(loaded["model"][f"model{i}"], strict=True)
        step = int(meta.get("step", 0))
        if self.optimizer is None:
            pass  # frozen model: weights only
        elif self.megatron_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            state = loaded["optimizer"]
            for param_state in state["state"].values():
                param_state["step"] = torch.tensor(float(step))
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": state["state"], "param_groups": groups})
        if same_layout:
            _set_rng_state(loaded["rng"], self.on_gpu)
        self.step = step
        return meta


    def _check_lora_checkpoint(self, saved: dict[str, Any] | None, ckpt_dir: str) -> None:
        """A LoRA job loads adapters trained on its own base model; a full-weight job no adapters."""
        from .errors import MegatronConfigError
        from .lora import check_base

        if self.lora is not None:
            check_base(saved, self.lora, ckpt_dir)
        elif saved:
            raise MegatronConfigError(
                f"checkpoint {ckpt_dir} holds LoRA adapters (rank {saved.get('rank')}), not full weights; set "
                "spec.lora as it was saved to resume it, or start fresh (checkpoint.resumeMode: disable)")


def _rng_state(on_gpu: bool) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any], on_gpu: bool) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if on_gpu and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
