"""The rljob worker: GRPO rollout, reward, advantage and megatron-core update loop run by torchrun."""
