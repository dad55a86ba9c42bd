"""The trainers under the run loop: GRPO, PPO (GRPO plus a megatron-core critic) and SFT."""
