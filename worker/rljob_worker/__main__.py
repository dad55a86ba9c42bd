"""Worker entry point: `torchrun -m rljob_worker --spec /etc/rljob/spec.json` (one process per GPU).

The job's identity comes from the environment the operator sets (RLJOB_NAME, RLJOB_NAMESPACE);
`rljob run` sets the same variables plus local overrides (RLJOB_WORKDIR, RLJOB_CHECKPOINT_URI,
RLJOB_MAX_STEPS).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path


def trainer_class(spec):
    """The trainer for ``spec.algorithm.name``: SFT for ``sft``, PPO when ``spec.critic`` is set (advantage
    estimator gae), GRPO for every other policy-gradient variant."""
    if spec.algorithm.name == "sft":
        from rljob_worker.trainers.sft import SFTTrainer

        return SFTTrainer
    if spec.critic is not None:  # PPO: algorithm.advantageEstimator gae with a value model
        from rljob_worker.trainers.ppo import PPOTrainer

        return PPOTrainer
    from rljob_worker.trainers.grpo import GRPOTrainer

    return GRPOTrainer


def run_job(spec, ctx) -> int:
    """Run the spec's trainer on the shared loop; returns the process exit code. A split critic
    (spec.critic.placement split) or a shared one with its own megatron layout, or a separate rollout pool
    (spec.rollout.placement separate): the processes first split into the actor pool, which runs the trainer,
    and the critic or rollout pool, which serves it (:mod:`rljob_worker.runtime.pools`)."""
    from rljob_api.validation import critic_in_own_pool, rollout_in_own_pool

    from rljob_worker.run_loop import run

    if critic_in_own_pool(spec) or rollout_in_own_pool(spec):
        from rljob_worker.runtime.distributed import dist_env_from_environ
        from rljob_worker.runtime.pools import PoolLayout, init_pools

        pools = init_pools(dist_env_from_environ(os.environ), PoolLayout.from_spec(spec))
        if pools.is_critic:
            from rljob_worker.trainers.critic_pool import CriticPool

            return CriticPool(spec, pools).run()
        if pools.is_rollout:
            from rljob_worker.rollout.rollout_pool import RolloutPool

            return RolloutPool(spec, pools).run()
        os.environ.update(pools.actor_torchrun_environ())
        return run(trainer_class(spec)(spec, ctx, pools=pools))
    return run(trainer_class(spec)(spec, ctx))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rljob_worker", description="rljob worker (run under torchrun)")
    parser.add_argument("--spec", required=True, help="RLJob spec as JSON (the operator mounts it from a ConfigMap)")
    args = parser.parse_args(argv)
    _die_with_torchrun()
    # `kill -USR1 <worker pid>` prints every thread's stack to stderr (the pod log): where a stuck job waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank = os.environ.get("RANK", "0")
    from rljob_worker.runtime.pipe_output import OUTPUT_LOG_VAR, protect_output

    default_workdir = Path(os.environ.get("RLJOB_WORKDIR") or
                           f"/tmp/rljob/{os.environ.get('RLJOB_NAMESPACE', 'default')}/{os.environ.get('RLJOB_NAME', 'rljob')}")
    protect_output(Path(os.environ.get(OUTPUT_LOG_VAR) or default_workdir / "output.log"))  # `| tee` ended by Ctrl-C
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
        _say(f"cannot read --spec {args.spec}: {exc}")
        return 2
    except RLJobValidationError as exc:
        _say(f"invalid spec: {exc}")  # one line: errors joined by '; '
        return 2

    if rank == "0":
        from rljob_api.advice import spec_warnings

        for warning in spec_warnings(spec):
            logging.getLogger("rljob.spec").warning("%s", warning)

    problem = _metrics_port_problem(spec)
    if problem:
        _say(problem)
        return 2

    job_doc = Path(args.spec).with_name("job.json")  # the operator's ConfigMap: the RLJob's uid
    if job_doc.is_file() and not os.environ.get("RLJOB_UID"):
        try:
            os.environ["RLJOB_UID"] = str(json.loads(job_doc.read_text()).get("uid") or "")
        except (OSError, ValueError):
            pass

    from rljob_worker.run_loop import RunContext

    name = os.environ.get("RLJOB_NAME", "rljob")
    namespace = os.environ.get("RLJOB_NAMESPACE", "default")
    max_steps = os.environ.get("RLJOB_MAX_STEPS")
    ctx = RunContext(
        job_name=name,
        namespace=namespace,
        workdir=default_workdir,
        checkpoint_uri=os.environ.get("RLJOB_CHECKPOINT_URI") or None,
        max_steps=int(max_steps) if max_steps else None,
        show_progress_bar=os.environ.get("RLJOB_PROGRESS_BAR") == "1" and rank == "0",
    )
    from rljob_worker.rollout.compile_config import compile_cache_env

    os.environ.update(compile_cache_env(ctx.workdir))  # torch.compile's caches outlive this process (unless set)
    from rljob_worker.runtime.host_memory import pinned_host_env

    os.environ.update(pinned_host_env())  # before CUDA's first use: the offload's pinned buffers pin 3.8x faster
    from rljob_worker.run_health import RunFailed

    try:
        return run_job(spec, ctx)
    except RunFailed as exc:  # training cannot learn: say why in one line, fail (not retryable)
        _say(str(exc))
        return 1
    except Exception as exc:  # start-up errors are configuration errors: one clear line, no traceback wall
        from rljob_worker.startup_errors import disk_full_message, is_configuration_error

        full = disk_full_message(exc)
        if full:  # a full disk during a save: the path and the free space, not 65 lines of traceback
            _say(full)
            return 1
        if is_configuration_error(exc):
            _say(str(exc))
            return 2
        raise


def _say(line: str) -> None:
    """One line on stderr in one write: the worker runs unbuffered (python -u), where print writes the text and
    its newline apart, and the ranks of a pod that all refuse a setting wrote into each other's lines."""
    sys.stderr.write(f"rljob worker: {line}\n")
    sys.stderr.flush()


def _die_with_torchrun() -> None:
    """torchrun starts each worker in a session of its own, so a SIGKILLed torchrun (outside a container,
    whose processes all die together) left its workers training on, holding the metrics port and the
    checkpoint lease. Linux: the kernel SIGKILLs this worker when its parent goes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def _metrics_port_problem(spec) -> str | None:
    """Say at once, not after a minute of loading, that the metrics port is taken (an earlier run?)."""
    import socket

    if not spec.metrics.enabled or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    port = int(os.environ.get("RLJOB_METRICS_PORT", spec.metrics.port))
    if port == 0:
        return None
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics server binds
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as e:
            return (f"spec.metrics.port {port}: cannot serve metrics there ({e.strerror}); another process (an "
                    "earlier run?) holds it: stop it, or choose another port")
    return None


if __name__ == "__main__":
    sys.exit(main())
