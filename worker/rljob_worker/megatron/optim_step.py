"""The optimizer and its step: megatron's DDP + optimizer on GPU (bf16 params, fp32 main params,
optional distributed optimizer; ``finalize_model_grads`` does the DP, tied-embedding and expert
reductions), torch AdamW over the local shards on CPU with the same reductions by hand (DP x CP mean,
TP-partial sums, tied embeddings under PP, expert-DP), global-norm clipping over TP / PP / EP."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rljob_worker.runtime.distributed import all_reduce_grads

from . import moe
from .engine_config import OptimConfig, ParallelConfig
from .model_config import MegatronModelConfig


class OptimStepMixin:
    """The engine's optimizer step (needs the engine's ``models``, ``core``, ``optimizer``, ``optim``,
    ``step``, ``mcfg``, ``hf_config`` and process-group attributes)."""

    def current_lr(self) -> float:
        warm = self.optim.lr_warmup_steps
        return self.optim.lr * min(1.0, (self.step + 1) / warm) if warm > 0 else self.optim.lr

    def _zero_grad(self) -> None:
        if self.megatron_optimizer:
            for model in self.models:
                model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _gpu_step(self, lr: float) -> tuple[float, bool]:
        from megatron.core.distributed import finalize_model_grads

        # DP all-reduce (or reduce-scatter) of the grad buffers; with PP, tied embedding grads too
        finalize_model_grads(self.models)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        return grad_norm, not ok

    def _cpu_step(self, lr: float) -> tuple[float, bool]:
        from megatron.core import parallel_state as ps

        from .sequence_parallel import tp_partial_grad_params

        params = [p for p in self.core.parameters() if p.requires_grad]
        self._cpu_sum_tied_embedding_grads(params)
        experts = [p for p in moe.expert_params(self.core) if p.requires_grad]  # LoRA: experts stay frozen
        expert_ids = {id(p) for p in experts}
        dense = [p for p in params if id(p) not in expert_ids]
        grads = [p.grad for p in dense if p.grad is not None]
        # SP norms and q/k norms: partial grads on each TP rank, summed as finalize_model_grads does
        partial = tp_partial_grad_params(self.core.named_parameters(), self.mcfg.transformer_config)
        all_reduce_grads(partial, self.tp_group)
        # average over DP x CP (gloo), as megatron's DDP does on GPU (see context_parallel.gather_from_cp)
        dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        all_reduce_grads(dense, dp_cp_group, divisor=dist.get_world_size(dp_cp_group))
        # experts: summed over the expert-DP group (which spans the CP ranks too), scaled by 1 / (DP x CP)
        moe.average_expert_grads(experts, self.dp_size * self.cp_size)
        grad_norm = self._cpu_grad_norm(dense, experts)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            clip = self.optim.grad_clip
            if clip > 0 and grad_norm > clip:
                coef = clip / (grad_norm + 1e-6)
                for g in grads + [p.grad for p in experts if p.grad is not None]:
                    g.mul_(coef)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _cpu_sum_tied_embedding_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Tied embeddings under PP: the first stage's embedding and the last stage's copy of it
        both get the sum of their gradients (what megatron's finalize_model_grads does on GPU)."""
        if self.pp_size == 1 or not self.mcfg.tie_word_embeddings:
            return
        from megatron.core import parallel_state as ps

        for p in params:
            if getattr(p, "shared_embedding", False):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=ps.get_embedding_group())

    def _cpu_grad_norm(
        self, params: list[torch.nn.Parameter], experts: list[torch.nn.Parameter] = ()
    ) -> float:
        """Global L2 norm over TP and PP; params replicated over TP (norms) are counted on TP rank 0
        only, the last stage's copy of tied embeddings (``shared``) not at all, expert params once per
        expert shard (:func:`moe.expert_grad_sq`, summed over the pipeline stages too)."""
        from megatron.core import parallel_state as ps

        sq = torch.zeros((), dtype=torch.float64, device=self.device)  # on the GPU with LoRA (NCCL)
        for p in params:
            if p.grad is None or getattr(p, "shared", False):
                continue
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                sq += p.grad.detach().double().pow(2).sum()
        if self.tp_size * self.pp_size > 1:
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        if moe.is_moe(self.hf_config):  # every stage joins, one without expert layers with 0
            expert_sq = moe.expert_grad_sq(list(experts))
            if self.pp_size > 1:
                dist.all_reduce(expert_sq, group=self.pp_group)
            sq += expert_sq.to(sq.device)
        return float(sq.sqrt())


def cpu_adamw(core: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    # As megatron: no weight decay on biases and norm weights (1-D parameters).
    decay = [p for p in core.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in core.parameters() if p.requires_grad and p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
    )


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers holding the state: torch AdamW itself (CPU), or the ``.optimizer`` of each
    megatron optimizer (a ChainedOptimizer chains several)."""
    if optimizer is None:
        return []
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
        elif inner is not None:
            raise TypeError(f"cannot offload the state of optimizer {type(inner).__name__}")
    return out


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Materialise AdamW's lazily created state so it has a structure to save or load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def gpu_wrap(
    chunks: list, mcfg: MegatronModelConfig, parallel: ParallelConfig, optim: OptimConfig, dtype: torch.dtype
):
    """GPU: Float16Module (bf16/fp16) -> megatron DDP per model chunk -> one megatron optimizer over
    all chunks (fp32 main params)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = mcfg.transformer_config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    models = []
    for i, core in enumerate(chunks):
        model = Float16Module(config, core) if dtype in (torch.bfloat16, torch.float16) else core
        # as megatron's training loop: chunks after the first keep their grads in one bucket
        models.append(
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, disable_bucketing=i > 0)
        )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip if optim.grad_clip > 0 else 0.0,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, models)
    fix_torch_adam_step_on_load(optimizer)
    return models, optimizer


def init_distributed_optimizer_state(optimizer) -> None:
    """megatron's DistributedOptimizer (without apex/TE) cannot build a state dict to load into
    before its first step; take a zero-gradient step at lr 0 (which changes nothing) to create the
    Adam state, as megatron does for its FSDP format."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            lrs = [g["lr"] for g in opt.optimizer.param_groups]
            for g in opt.optimizer.param_groups:
                g["lr"] = 0.0
            opt._init_optimizer_states_with_dummy_values()
            for g, lr in zip(opt.optimizer.param_groups, lrs):
                g["lr"] = lr


def fix_torch_adam_step_on_load(optimizer) -> None:
    """megatron 0.16.1's DistributedOptimizer, when it falls back to torch Adam (no apex/TE), copies
    every key of the Adam state, "step" included, from a loaded checkpoint that never holds "step"
    (it restores step separately): KeyError. Instance-level fix: fill the missing "step" with the
    value load_state_dict already set."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            state = _opt.optimizer.state.get(main_param, {})
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
