"""Layout invariance of the GRPO loss: the gradient of one optimizer step on one mini-batch, at several
micro-batch sizes and parallel layouts, for each loss aggregation mode.

Run under torchrun (``python -m torch.distributed.run --nproc-per-node N tests/worker/loss_layouts.py
HF_DIR OUT_FILE [--local-normaliser]``): with one process it runs DP1 at micro-batch 1, 2, 4 and 8 (the
whole mini-batch in one micro-batch: the reference); with two, DP2 (each rank half of the rows), PP2 and
CP2. The gradient is read where the optimizer would step (the step itself is skipped, so every update
starts from the same weights), with gradient clipping off, and saved by global parameter name.

``--local-normaliser`` runs the loss as the trainer did before global normalisers: each micro-batch
normalised by its own counts, the mean of the micro-batch losses back-propagated (the "before"
numbers of issue #18).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROWS = 8
PROMPT_LENGTHS = [3, 5, 2, 4, 3, 6, 2, 4]
RESPONSE_LENGTHS = [1, 8, 2, 7, 3, 5, 8, 1]  # micro-batches and DP ranks get different token counts
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def mini_batch(vocab: int = 128) -> dict[str, torch.Tensor]:
    """8 rows: prompts left-padded to 6, responses right-padded to 8, advantages, reference log-probs."""
    g = torch.Generator().manual_seed(7)
    p, r = max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    ids = torch.randint(0, vocab, (ROWS, p + r), generator=g)
    attention = torch.zeros(ROWS, p + r, dtype=torch.long)
    response = torch.zeros(ROWS, p + r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        attention[i, p - pl:p + rl] = 1
        response[i, p:p + rl] = 1
    advantages = torch.randn(ROWS, 1, generator=g).expand(ROWS, p + r) * response
    ref_shift = 0.3 * torch.randn(ROWS, p + r, generator=g)  # ref = logprobs - shift: a KL-in-loss term
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response,
            "advantages": advantages.contiguous(), "ref_shift": ref_shift}


def make_loss_fn(mode: str):
    """The trainer's GRPO loss (policy gradient at ratio 1, KL in the loss, entropy bonus)."""
    from rljob_worker.algorithms import LossConfig, grpo_loss

    config = LossConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, aggregation=mode,
                        norm_length=max(RESPONSE_LENGTHS))

    def loss_fn(logprobs, entropy, micro, num_tokens=None, num_sequences=None):
        ref = logprobs.detach() - micro["ref_shift"]
        return grpo_loss(logprobs, logprobs.detach(), micro["advantages"], micro["response_mask"], config,
                         ref_logprobs=ref, entropy=entropy, num_tokens=num_tokens, num_sequences=num_sequences)

    return loss_fn


def _global_name(actor, name: str) -> str:
    """A pipeline stage's parameter name with the global layer index (megatron's layer_number), so the
    stages' gradients line up with a one-stage model's."""
    chunks = list(actor.core) if isinstance(actor.core, torch.nn.ModuleList) else [actor.core]
    parts = name.split(".")
    chunk = chunks[int(parts.pop(0))] if len(chunks) > 1 else chunks[0]
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def capture_step_gradients(actor) -> dict:
    """Replace the optimizer's step by a recorder of this rank's gradients (the weights never change)."""
    box = {}

    def record(*args, **kwargs):
        box["grads"] = {_global_name(actor, n): p.grad.detach().double().clone()
                        for n, p in actor.core.named_parameters() if p.grad is not None}

    actor.optimizer.step = record
    return box


def run_layout(hf_dir, parallel, rows: slice, micro_sizes, local_normaliser: bool) -> dict:
    import torch.distributed as dist
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig

    actor = MegatronActor.from_hf(hf_dir, parallel, OptimConfig(lr=1e-3, grad_clip=0.0), seed=1)
    box = capture_step_gradients(actor)
    batch = {k: v[rows] for k, v in mini_batch().items()}
    out = {}
    for mode in MODES:
        for mbs in micro_sizes:
            metrics = actor.update(batch, make_loss_fn(mode), micro_batch_size=mbs,
                                   with_entropy=True, normalise_by=None if local_normaliser else "response_mask")
            grads = [None] * dist.get_world_size()
            dist.all_gather_object(grads, box["grads"])  # every stage's and rank's parameters
            merged = {}
            for part in grads:
                merged.update(part)  # DP/CP ranks hold equal (reduced) gradients; PP stages disjoint ones
            out[(mode, mbs)] = {"grads": merged, "grad_norm": metrics["grad_norm"], "loss": metrics["loss"]}
    return out


def main() -> None:
    import torch.distributed as dist
    from rljob_worker.megatron.actor import ParallelConfig

    hf_dir, out_file = sys.argv[1], sys.argv[2]
    local = "--local-normaliser" in sys.argv
    from rljob_worker.runtime.distributed import init_from_environ

    init_from_environ()
    world = dist.get_world_size()
    results = {}
    if world == 1:
        results["dp1"] = run_layout(hf_dir, ParallelConfig(), slice(None), [1, 2, 3, 4, 8], local)
    else:
        rank = dist.get_rank()
        half = ROWS // 2
        results["dp2"] = run_layout(hf_dir, ParallelConfig(), slice(rank * half, (rank + 1) * half), [1, 2, 4], local)
        results["pp2"] = run_layout(hf_dir, ParallelConfig(pp=2), slice(None), [1, 2, 3, 4], local)
        results["cp2"] = run_layout(hf_dir, ParallelConfig(cp=2), slice(None), [1, 2, 4], local)
    if dist.get_rank() == 0:
        torch.save(results, out_file)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worker"))
    torch.set_num_threads(1)
    main()
    from rljob_worker.runtime.distributed import destroy_distributed

    destroy_distributed()
