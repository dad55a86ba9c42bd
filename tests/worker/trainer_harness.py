"""Run the real trainer from a test, in its own process, optionally sabotaged.

    python tests/worker/trainer_harness.py SPEC.json WORKDIR [--sabotage flip-sign|zero-advantages]
                                           [--record-rollouts]

Sabotage exists so the learning tests prove they can fail: the same run with the
policy-gradient sign flipped, or with every advantage zeroed, must not learn.
--record-rollouts (also under torchrun): every rank appends what its engine was asked and gave
(prompts, n, seed, responses) to WORKDIR/rollouts_rank<R>.jsonl, and rank 0 appends the batch the
estimator is built from (prompts and responses, row by row) to WORKDIR/estimator_batches.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("workdir")
    parser.add_argument("--sabotage", choices=["flip-sign", "zero-advantages"])
    parser.add_argument("--checkpoint-uri")
    parser.add_argument("--name", default="test")
    parser.add_argument("--record-rollouts", action="store_true")
    args = parser.parse_args()

    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from rljob_api.validation import parse_spec
    from rljob_worker import run_loop
    from rljob_worker.__main__ import run_job
    from rljob_worker.trainers import grpo as trainer

    if args.sabotage == "flip-sign":
        real = trainer.algo.grpo_loss

        def flipped(*a, **kw):
            loss, metrics = real(*a, **kw)
            return -loss, metrics

        trainer.algo.grpo_loss = flipped
    elif args.sabotage == "zero-advantages":
        real_adv = trainer.algo.compute_outcome_advantages

        def zeroed(rewards, *a, **kw):
            adv, metrics = real_adv(rewards, *a, **kw)
            return torch.zeros_like(adv), metrics

        trainer.algo.compute_outcome_advantages = zeroed

    if args.record_rollouts:
        record_rollouts(trainer, Path(args.workdir), int(os.environ.get("RANK", "0")))

    spec = parse_spec(json.loads(Path(args.spec).read_text()))
    ctx = run_loop.RunContext(job_name=args.name, namespace="test", workdir=Path(args.workdir),
                              checkpoint_uri=args.checkpoint_uri or f"file://{args.workdir}/ckpt")
    os.environ.setdefault("RLJOB_METRICS_PORT", "0")
    return run_job(spec, ctx)


def record_rollouts(trainer, workdir: Path, rank: int) -> None:
    def append(path: Path, record: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    real_make_engine = trainer.make_engine

    def make_recording_engine(*args, **kwargs):
        engine = real_make_engine(*args, **kwargs)
        real_generate = engine.generate

        def generate(prompt_ids, params):
            out = real_generate(prompt_ids, params)
            append(workdir / f"rollouts_rank{rank}.jsonl", {"prompts": prompt_ids, "n": params.n, "seed": params.seed,
                                                           "responses": out.response_ids,
                                                           "max_rows": kwargs.get("max_rows")})
            return out

        engine.generate = generate
        return engine

    trainer.make_engine = make_recording_engine
    real_pad_batch = trainer.pad_batch

    def pad_batch(prompt_ids, response_ids, pad_id, **options):  # options: loss_masks of multi-turn rollouts
        if rank == 0:
            append(workdir / "estimator_batches.jsonl", {"prompts": prompt_ids, "responses": response_ids})
        return real_pad_batch(prompt_ids, response_ids, pad_id, **options)

    trainer.pad_batch = pad_batch


if __name__ == "__main__":
    sys.exit(main())
