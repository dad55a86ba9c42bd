"""The megatron-core policy model of the GRPO trainer.

- ``actor``: :class:`~rljob_worker.megatron.actor.MegatronActor` (log-probs, update, weight export,
  distributed checkpoints; TP, DP, PP and VPP), ``ParallelConfig``, ``OptimConfig``.
- ``model_config``: HF config -> megatron ``TransformerConfig`` + layer spec + ``GPTModel`` kwargs.
- ``hf_weights``: HF safetensors <-> megatron weights, per TP rank and pipeline stage (mapping
  tables per architecture).
- ``sdpa_attention``: SDPA core attention for megatron's local layer spec.
- ``cpu_compat``: the patches megatron-core needs on a machine without a GPU.

Importing this package does not import megatron-core; the modules import it when used.
"""
