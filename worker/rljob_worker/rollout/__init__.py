"""Rollout engines behind one interface (`RolloutEngine`), fed by the same stream of
HF-named weight tensors exported from the megatron actor after every update."""
from rljob_worker.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from rljob_worker.rollout.factory import make_engine

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "make_engine"]
