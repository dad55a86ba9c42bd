"""`builtin://` models: tiny random-init HF checkpoints rljob builds from shipped configs.

They exist so that the quickstart, CI and smoke tests train a real Qwen2-architecture
model through the whole stack without downloading anything. The tokenizer is
character-level over a 16-symbol vocabulary (digits, '+', '=', ' ', '#', specials),
which the synthetic tasks in `rljob_worker.data.synthetic` are written in. tiny-qwen2-tools adds the
tool-call tags as four more tokens and a chat template that renders a tool message as
``<tool_response>OUTPUT`` (the tool-secret task, spec.tools).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
CHARS = list("0123456789+= #")
VOCAB = [PAD, EOS, *CHARS]  # 16 symbols: uniform sampling hits one given symbol ~6% of the time
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOLS_VOCAB = [*VOCAB, *TOOL_TAGS]
# A tool message is `<tool_response>OUTPUT` and the model's next turn follows the output directly: an answer that
# repeats the output's last token is then the one a tied-embedding model leans to (the tool-secret task).
TOOLS_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}"
                       "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")

TINY_QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": len(VOCAB),
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "use_cache": True,
    "bos_token_id": VOCAB.index(EOS),
    "eos_token_id": VOCAB.index(EOS),
    "pad_token_id": VOCAB.index(PAD),
}

# The same model widened to head_dim 64 (hidden 128, 2 heads, 1 KV head): vLLM 0.26 hangs in its start-up warm-up at
# rollout tensor-parallel 2 on tiny-qwen2's head_dim 16 and runs this one (2 H100s, bench/NOTES.md, session 5).
TINY_QWEN2_HD64_CONFIG = {**TINY_QWEN2_CONFIG, "hidden_size": 128, "intermediate_size": 256,
                          "num_attention_heads": 2, "num_key_value_heads": 1}

TINY_QWEN2_TOOLS_CONFIG = {**TINY_QWEN2_CONFIG, "vocab_size": len(TOOLS_VOCAB)}

# A Qwen3-MoE of the same size: 4 experts, top-2 renormalised, in both layers (routing replay, the MoE examples on a
# CPU). The load-balancing loss is off in its config (router_aux_loss_coef 0) so the quickstart task's loss is GRPO's.
TINY_QWEN3_MOE_CONFIG = {**TINY_QWEN2_CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                         "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                         "router_aux_loss_coef": 0.0, "output_router_logits": False}

BUILTIN_MODELS = {"tiny-qwen2": TINY_QWEN2_CONFIG, "tiny-qwen2-hd64": TINY_QWEN2_HD64_CONFIG,
                  "tiny-qwen2-tools": TINY_QWEN2_TOOLS_CONFIG, "tiny-qwen3-moe": TINY_QWEN3_MOE_CONFIG}


def build_char_tokenizer(tools: bool = False):
    """A character-level `PreTrainedTokenizerFast` over VOCAB (no files, no downloads); ``tools``: TOOLS_VOCAB,
    the tags as special tokens (one token each) and TOOLS_CHAT_TEMPLATE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = TOOLS_VOCAB if tools else VOCAB
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(vocab)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if tools:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TOOL_TAGS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")
    if tools:
        out.chat_template = TOOLS_CHAT_TEMPLATE
    return out


def per_expert_state(state: dict) -> dict:
    """transformers' in-memory fused experts (``experts.gate_up_proj (E, 2I, H)``, ``experts.down_proj (E, H, I)``)
    -> the per-expert tensors of a Qwen-MoE checkpoint on disk (``experts.{e}.gate_proj.weight`` ...)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :half].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = tensor[e, half:].contiguous()
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return out


def materialize_builtin(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write builtin model `name` as an HF folder (config, tokenizer, safetensors) and return it.

    Idempotent: an existing complete folder is reused. Random init is seeded, so every
    node of a job builds the same weights.
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model.path builtin://{name} is not a built-in model; choose one of {sorted(BUILTIN_MODELS)}")
    out = Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(BUILTIN_MODELS[name])
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # a folder of this process's own: two pods of a job (or two local ranks) sharing the workdir write at once
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        # Written by hand: transformers' save_pretrained writes nothing on a process whose global
        # torch.distributed rank is not 0, and every node builds its own copy.
        from safetensors.torch import save_file

        config.to_json_file(str(tmp / "config.json"))
        state = per_expert_state({k: v.contiguous() for k, v in model.state_dict().items()})
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # HF convention: tied output weights live in embed_tokens
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        build_char_tokenizer(tools=name == "tiny-qwen2-tools").save_pretrained(tmp)
        (tmp / "rljob_builtin.json").write_text(json.dumps({"name": name, "seed": seed}))
        # each file lands whole (a rename); the two files the reuse check above reads land last
        for child in sorted(tmp.iterdir(), key=lambda c: c.name in ("config.json", "model.safetensors")):
            child.replace(out / child.name)
    finally:  # a failed write leaves no half folder beside the model
        shutil.rmtree(tmp, ignore_errors=True)
    return out
