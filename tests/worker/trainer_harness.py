"""Run the real trainer from a test, in its own process, optionally sabotaged.

    python tests/worker/trainer_harness.py SPEC.json WORKDIR [--sabotage flip-sign|zero-advantages]

Sabotage exists so the learning tests prove they can fail: the same run with the
policy-gradient sign flipped, or with every advantage zeroed, must not learn.
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
    args = parser.parse_args()

    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from rljob_api.validation import parse_spec
    from rljob_worker import run_loop, trainer
    from rljob_worker.__main__ import run_job

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

    spec = parse_spec(json.loads(Path(args.spec).read_text()))
    ctx = run_loop.RunContext(job_name=args.name, namespace="test", workdir=Path(args.workdir),
                              checkpoint_uri=args.checkpoint_uri or f"file://{args.workdir}/ckpt")
    os.environ.setdefault("RLJOB_METRICS_PORT", "0")
    return run_job(spec, ctx)


if __name__ == "__main__":
    sys.exit(main())
