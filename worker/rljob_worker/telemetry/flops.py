"""Parameters that act on each token, for the MFU estimate (``6 N`` FLOPs per token, forward and
backward, plus attention).

Counted from the HF config, so any parallel layout (TP, PP, EP) gives the same number. For a dense
model it is the parameter count of the HF model; for a mixture-of-experts model (qwen3_moe,
qwen2_moe) only the experts a token is routed to count: every MoE layer adds its router, ``top_k``
experts and the shared expert with its gate, not all ``num_experts``. Embeddings and the output
layer are counted (once when tied), as ``sum(p.numel())`` of the model would.
"""

from __future__ import annotations

from rljob_worker.megatron.moe import is_moe, moe_layer_pattern


def active_parameters(hf_config) -> int:
    """Parameters one token passes through in a forward pass of ``hf_config``'s model (llama,
    qwen2, qwen3, qwen3_moe, qwen2_moe)."""
    c = hf_config
    h, v = c.hidden_size, c.vocab_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    model_type = c.model_type

    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o
    if model_type == "qwen2" or (model_type == "qwen2_moe" and getattr(c, "qkv_bias", True)):
        attn += (heads + 2 * kv) * hd  # q, k, v biases
    elif getattr(c, "attention_bias", False):  # llama, qwen3: o_proj too
        attn += (heads + 2 * kv) * hd + h
    if model_type in ("qwen3", "qwen3_moe"):
        attn += 2 * hd  # q / k norms

    def mlp(inter: int) -> int:  # gate, up, down
        return 3 * h * inter + (2 * inter + h if getattr(c, "mlp_bias", False) else 0)

    dense_mlp = mlp(c.intermediate_size)
    moe_mlp = 0
    if is_moe(c):
        moe_mlp = h * c.num_experts + c.num_experts_per_tok * mlp(c.moe_intermediate_size)
        shared = int(getattr(c, "shared_expert_intermediate_size", 0) or 0)
        if shared:
            moe_mlp += mlp(shared) + h  # + the shared expert's sigmoid gate (h -> 1)
    pattern = moe_layer_pattern(c) if is_moe(c) else [0] * c.num_hidden_layers

    layers = sum(attn + 2 * h + (moe_mlp if sparse else dense_mlp) for sparse in pattern)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    return v * h + layers + h + (0 if tied else h * v)
