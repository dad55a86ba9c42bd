"""The pod's entry point: torchrun with the worker's own exit code and without torchrun's error wrapper.

    python -m rljob_worker.runtime.launch [torchrun options] -m rljob_worker --spec /etc/rljob/spec.json

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
STOP_TIMEOUT_S = 7 * 24 * 3600  # "until the workers exit": kubelet's grace period is the real bound


def exit_code_of(exitcode: int) -> int:
    """A worker's Popen-style exit code as a shell reports it: -15 (killed by SIGTERM) -> 143."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _let_workers_finish_their_save() -> None:
    """On SIGTERM torchrun signals the workers and SIGKILLs them 30 s later, cutting a preemption save
    short. The deadline that counts is the pod's terminationGracePeriodSeconds (kubelet's SIGKILL) or
    the user's patience (a second Ctrl-C), so torchrun waits for the workers as long as they run."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close
    if getattr(close, "_rljob_patient", False):
        return

    def patient_close(self, death_sig=None, timeout: int = 30):
        return close(self, death_sig, max(int(timeout), STOP_TIMEOUT_S))

    patient_close._rljob_patient = True
    api.PContext.close = patient_close


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    _let_workers_finish_their_save()
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
