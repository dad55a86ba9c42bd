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
