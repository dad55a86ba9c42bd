"""The pod's entry point: torchrun with the worker's own exit code and without torchrun's error wrapper.

    python -m rljob_worker.launch [torchrun options] -m rljob_worker --spec /etc/rljob/spec.json

Plain `torchrun` turns any worker failure into exit 1 plus a ~30-line `ChildFailedError`
traceback and "Root Cause" box. The worker has already said what went wrong in one line (a
configuration error: exit 2), or saved a checkpoint on SIGTERM (exit 143, which PyTorchJob's
`restartPolicy: ExitCode` treats as retryable), so this passes the first failed worker's exit
code through and prints nothing of torchrun's own, except one line for a crash the worker did
not explain itself (the worker's traceback is above it).
"""
from __future__ import annotations

import logging
import signal
import sys

EXIT_CONFIG = 2
EXIT_PREEMPTED = 143


def exit_code_of(exitcode: int) -> int:
    """A worker's Popen-style exit code as a shell reports it: -15 (killed by SIGTERM) -> 143."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    # torchrun's own ERROR/WARNING lines ("failed (exitcode: 2) local_rank: 0 ...") repeat what the
    # worker said; this module reports what is left.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = exit_code_of(failure.exitcode)
        if code not in (EXIT_CONFIG, EXIT_PREEMPTED):
            print(f"rljob: worker rank {rank} (pid {failure.pid}) exited with code {code}"
                  + (f" ({signal.Signals(code - 128).name})" if 128 < code < 160 else "")
                  + "; its output above says why", file=sys.stderr, flush=True)
        return code
    except SignalException as exc:  # torchrun itself got SIGTERM/SIGINT and stopped the workers
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
