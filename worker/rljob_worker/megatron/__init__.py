"""megatron-core models of the trainers: one engine, a head per model.

- ``engine``: :class:`~rljob_worker.megatron.engine.MegatronEngine` (build and HF load, micro-batches
  through the pipeline schedules with a caller's head and loss; TP, DP, PP, VPP, CP, EP), with
  ``engine_config`` (``ParallelConfig``, ``OptimConfig``, ``RecomputeConfig``, layout checks, process
  groups), ``packing`` (padding-free micro-batches), ``optim_step`` (optimizer and its step, GPU and
  CPU) and ``engine_state`` (offload, dist-checkpoints, RNG, HF export); ``errors``: ``MegatronConfigError``.
- ``actor``: :class:`~rljob_worker.megatron.actor.MegatronActor`, the policy head on the engine
  (log-probs, entropy, vocab padding; ``update``, ``compute_logprobs``), by default through
  ``fused_head`` / ``fused_logprobs``: log-probs and entropy from the last hidden state and the
  vocab-parallel output weight in token chunks, no full-vocab fp32 logits (``RLJOB_FUSED_LOGPROBS=0``
  turns it off).
- ``model_config``: HF config -> megatron ``TransformerConfig`` + layer spec + ``GPTModel`` kwargs.
- ``hf_weights``: HF safetensors <-> megatron weights, per TP rank and pipeline stage (mapping
  tables per architecture).
- ``sdpa_attention``: SDPA core attention for megatron's local layer spec; ``fused_elementwise``: its
  RMSNorm, RoPE and SwiGLU as compiled kernels (on with a GPU; ``RLJOB_FUSED_ELEMENTWISE=0`` turns
  them off).
- ``cpu_compat``: the patches megatron-core needs on a machine without a GPU.

Importing this package does not import megatron-core; the modules import it when used.
"""
