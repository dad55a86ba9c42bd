"""Worker entry point: `torchrun -m rljob_worker --spec /etc/rljob/spec.json` (one process per GPU).

The job's identity comes from the environment the operator sets (RLJOB_NAME, RLJOB_NAMESPACE);
`rljob run` sets the same variables plus local overrides (RLJOB_WORKDIR, RLJOB_CHECKPOINT_URI,
RLJOB_MAX_STEPS).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path


def trainer_class(spec):
    """The trainer for ``spec.algorithm.name``: SFT for ``sft``, PPO when ``spec.critic`` is set (advantage
    estimator gae), GRPO for every other policy-gradient variant."""
    if spec.algorithm.name == "sft":
        from rljob_worker.sft_trainer import SFTTrainer

        return SFTTrainer
    if spec.critic is not None:  # PPO: algorithm.advantageEstimator gae with a value model
        from rljob_worker.ppo_trainer import PPOTrainer

        return PPOTrainer
    from rljob_worker.trainer import GRPOTrainer

    return GRPOTrainer


def run_job(spec, ctx) -> int:
    """Run the spec's trainer on the shared loop; returns the process exit code."""
    from rljob_worker.run_loop import run

    return run(trainer_class(spec)(spec, ctx))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rljob_worker", description="rljob worker (run under torchrun)")
    parser.add_argument("--spec", required=True, help="RLJob spec as JSON (the operator mounts it from a ConfigMap)")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    # megatron-core announces every missing optional kernel package; the worker image has them,
    # CPU runs do not need them, and either way the notices bury the progress lines.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "botocore", "urllib3", "transformers", "megatron"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from rljob_api.validation import RLJobValidationError, parse_spec

    try:
        spec = parse_spec(json.loads(Path(args.spec).read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"rljob worker: cannot read --spec {args.spec}: {exc}", file=sys.stderr)
        return 2
    except RLJobValidationError as exc:
        print(f"rljob worker: invalid spec: {exc}", file=sys.stderr)  # one line: errors joined by '; '
        return 2

    from rljob_worker.run_loop import RunContext

    name = os.environ.get("RLJOB_NAME", "rljob")
    namespace = os.environ.get("RLJOB_NAMESPACE", "default")
    max_steps = os.environ.get("RLJOB_MAX_STEPS")
    ctx = RunContext(
        job_name=name,
        namespace=namespace,
        workdir=Path(os.environ.get("RLJOB_WORKDIR", f"/tmp/rljob/{namespace}/{name}")),
        checkpoint_uri=os.environ.get("RLJOB_CHECKPOINT_URI") or None,
        max_steps=int(max_steps) if max_steps else None,
        show_progress_bar=os.environ.get("RLJOB_PROGRESS_BAR") == "1" and rank == "0",
    )
    try:
        return run_job(spec, ctx)
    except Exception as exc:  # start-up errors are configuration errors: one clear line, no traceback wall
        from rljob_worker.startup_errors import is_configuration_error

        if is_configuration_error(exc):
            print(f"rljob worker: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
