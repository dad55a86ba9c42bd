"""LoRA steps that every parallel layout runs alike, and the torchrun scenario that runs them at TP2,
TP2 + sequence parallel, PP2, CP2 and DP2 (``python -m torch.distributed.run ... lora_scenarios.py layouts
HF_DIR OUT_DIR``); the tests compare each with TP1 in the test process."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H

LORA = {"rank": 4, "alpha": 8.0}
LAYOUTS = {
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "cp2": {"cp": 2},
    "dp2": {},  # two processes, TP1: each takes half of the rows
}
CHECKPOINTED = ("tp2", "tp2_sp", "pp2")  # saved after lora_steps, for loading into TP1


def full_grads(actor) -> dict[str, torch.Tensor]:
    """Every adapter's gradient on this rank, TP shards gathered into the whole tensor (global names)."""
    from rljob_worker.megatron import hf_weights as hw

    _, t, group = hw._tp()
    out = {}
    for a in actor.lora.adapted:
        for key, p in (("lora_a", a.adapter.lora_a), ("lora_b", a.adapter.lora_b)):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            full = hw._gather(g.detach(), dim, t, group).cpu().clone()
            if a.target == "linear_fc1" and key == "lora_b":  # TP rank order [g0; u0; g1; u1] -> [gate; up]
                full = full.reshape(t, 2, -1, full.shape[-1]).transpose(0, 1).reshape(full.shape)
            out[f"{a.name}.{key}"] = full
    return out


def lora_steps(actor, rows: slice = slice(None), micro_batch_sizes: tuple[int, int] = (2, 1)) -> dict:
    """Two LoRA updates of :func:`megatron_helpers.varied_batch` (``rows`` of it; at ``micro_batch_sizes``),
    recording the reduced adapter gradients each optimizer step sees (no clipping), then log-probs, the
    reference log-probs (adapters off) and the whole adapters in PEFT's format."""
    from rljob_worker.megatron.actor import valid_logprob_mask
    from rljob_worker.megatron.lora import peft_tensors

    ids, mask = H.varied_batch()
    batch = {"input_ids": ids[rows], "attention_mask": mask[rows]}
    grads: list[dict[str, torch.Tensor]] = []
    step = actor.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append(full_grads(actor))
        return step(*args, **kwargs)

    actor.optimizer.step = recording_step
    # the token mean over the whole mini-batch (micro-batches and DP ranks): the same loss at every layout
    batch["loss_mask"] = valid_logprob_mask(batch["attention_mask"])

    def loss_fn(logprobs, _entropy, mb, num_tokens, num_sequences):
        return -(logprobs * mb["loss_mask"].float()).sum() / num_tokens, {}

    updates = [actor.update(batch, loss_fn, micro_batch_size=mbs, normalise_by="loss_mask") for mbs in micro_batch_sizes]
    full = {"input_ids": ids, "attention_mask": mask}
    after = actor.compute_logprobs(full, micro_batch_size=2)["logprobs"]
    with actor.lora.disabled():
        reference = actor.compute_logprobs(full, micro_batch_size=2)["logprobs"]
    return {"updates": updates, "grads": grads, "logprobs_after": after.cpu(), "reference": reference.cpu(),
            "peft": {k: v.cpu() for k, v in peft_tensors(actor.lora, actor.chunks, actor.hf_config)}}


def _scenario_layouts(hf_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
    from rljob_worker.megatron.lora import LoraConfig

    results = {}
    for name, layout in LAYOUTS.items():
        actor = MegatronActor.from_hf(hf_dir, ParallelConfig(**layout), OptimConfig(lr=1e-2, grad_clip=0.0), seed=1,
                                      lora=LoraConfig(**LORA, seed=3))
        rows = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2) if name == "dp2" else slice(None)
        results[name] = lora_steps(actor, rows)
        if name in CHECKPOINTED:
            actor.save_checkpoint(Path(out_dir) / f"ckpt_{name}")
    torch.save(results, Path(out_dir) / f"layouts_rank{dist.get_rank()}.pt")


SCENARIOS = {"layouts": _scenario_layouts}

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worker"))
    torch.set_num_threads(1)
    SCENARIOS[sys.argv[1]](sys.argv[2], sys.argv[3])
    from rljob_worker.runtime.distributed import destroy_distributed

    destroy_distributed()
