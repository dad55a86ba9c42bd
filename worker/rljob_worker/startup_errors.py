"""Which exceptions are the user's configuration (one clear line) rather than bugs (a traceback)."""
from __future__ import annotations


class StartupError(ValueError):
    """A setting or the machine's state stops the run at start-up; the message names the setting and the fix."""


def is_configuration_error(exc: BaseException) -> bool:
    from rljob_worker.checkpoint.run_checkpoints import CheckpointContentError
    from rljob_worker.checkpoint.store import StorageError
    from rljob_worker.data.model_source import ModelSourceError
    from rljob_worker.data.prompts import DataError
    from rljob_worker.megatron.errors import MegatronConfigError
    from rljob_worker.rewards import RewardError
    from rljob_worker.rollout.every_rank import RolloutLayoutError

    return isinstance(exc, (CheckpointContentError, DataError, ModelSourceError, RewardError, StorageError,
                            MegatronConfigError, RolloutLayoutError, StartupError))


def disk_full_message(exc: BaseException) -> str | None:
    """One line for a full disk anywhere in `exc`'s chain (causes, contexts, the per-rank failures of
    torch's distributed checkpoint): the path being written and the free space on its file system."""
    import errno
    import re

    stack, seen, text_hit = [exc], set(), None
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return _disk_full_line(e.filename2 or e.filename)  # a copy names (source, destination)
        if text_hit is None and "[Errno 28]" in str(e):
            text_hit = str(e)
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            stack += [getattr(f, "exc", f) for f in failures.values() if isinstance(getattr(f, "exc", f), BaseException)]
    if text_hit is None:
        return None
    path = re.search(r"\[Errno 28\][^']*'([^']+)'", text_hit)
    return _disk_full_line(path.group(1) if path else None)


def _disk_full_line(path) -> str:
    import os
    import shutil

    where, free = str(path) if path else None, None
    probe = os.path.dirname(os.path.abspath(where)) if where else None
    while probe:
        try:
            free = shutil.disk_usage(probe).free
            break
        except OSError:
            parent = os.path.dirname(probe)
            probe = None if parent == probe else parent
    room = f" ({free / 2**20:.1f} MiB free on that file system)" if free is not None else ""
    return (f"no space left on device writing {where or 'a checkpoint file'}{room}; the committed checkpoints are "
            "intact: free space there, or point spec.checkpoint.uri (and rljob run's --workdir) at a larger volume")
