"""The rljob worker: GRPO rollout, reward, advantage and megatron-core update loop run by torchrun."""

import time as _time

STARTED = _time.monotonic()  # the start-up's first phase ("imports") is measured from here
