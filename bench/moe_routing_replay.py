"""Routing replay on a GPU (issue 36): the trainer's log-probs against vLLM's, with and without the rollout's experts.

    python3 bench/moe_routing_replay.py [--layers 4] [--prompts 64] [--n 4] [--prompt-len 128] [--new 256]

Qwen3-30B-A3B's shape at reduced depth (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of 768, top-8
renormalised, vocab 151,936), random init, bf16, one GPU (expert parallel 1). vLLM 0.26 samples with
``enable_return_routed_experts``; then vLLM sleeps and the megatron actor (the worker's, bf16) computes the log-probs
of the same tokens twice: its routers choosing, and replaying vLLM's experts. Reports per response token
|log pi_train - log pi_rollout| (mean, p99, max, share above 0.1) and how often the trainer's own top-8 set equals
vLLM's per (token, layer). A random router is far flatter than a trained one, so more ties flip here than in a trained
model: the mismatch without replay is an upper end, not a typical value.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import results

SHAPE = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
         "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "max_position_embeddings": 4096, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "router_aux_loss_coef": 0.001, "bos_token_id": 151643, "eos_token_id": 151645}


def build_model(out: Path, layers: int) -> Path:
    from rljob_worker.data.builtin_models import per_expert_state
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**SHAPE, num_hidden_layers=layers, torch_dtype="bfloat16")
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(out / "config.json"))
    state = per_expert_state({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--dir", default="/tmp/moe30b")
    p.add_argument("--smoke", action="store_true", help="a tiny shape with the hf engine (no GPU, no vLLM): checks the script")
    a = p.parse_args()
    if a.smoke:
        SHAPE.update(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, bos_token_id=1,
                     eos_token_id=2)
    from rljob_worker.data.batching import pad_batch, scatter_response_values
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
    from rljob_worker.rollout.base import SamplingParams
    from rljob_worker.rollout.routed_experts import routing_batch
    from rljob_worker.rollout.vllm_engine import VLLMEngine

    t0 = time.perf_counter()
    model_dir = build_model(Path(a.dir), a.layers)
    print(f"model: {a.layers} layers of Qwen3-30B-A3B's shape, built in {time.perf_counter() - t0:.1f}s", flush=True)
    if a.smoke:
        from rljob_worker.rollout.hf_engine import HFEngine

        engine = HFEngine(str(model_dir), dtype=torch.bfloat16, device=torch.device("cpu"), pad_token_id=0,
                          eos_token_id=SHAPE["eos_token_id"], record_routing=True)
    else:
        engine = VLLMEngine(str(model_dir), dtype=torch.bfloat16, gpu_memory_utilization=0.35, record_routing=True,
                            max_model_len=a.prompt_len + a.new + 8, eos_token_id=SHAPE["eos_token_id"],
                            skip_tokenizer_init=True, enforce_eager=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SHAPE["vocab_size"] - 1000 if not a.smoke else 500, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.prompts)]
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(n=a.n, temperature=1.0, max_new_tokens=a.new, seed=2))
    gen_s = time.perf_counter() - t0
    expanded = [q for q in prompts for _ in range(a.n)]
    fed = [(r.shape[0], len(q) + len(ids)) for r, q, ids in zip(out.routed_experts, expanded, out.response_ids)]
    print(f"vLLM: {len(out.response_ids)} responses in {gen_s:.1f}s; routed experts per response: "
          f"{sorted({f - t for f, t in fed})} rows vs prompt + response tokens; shape {tuple(out.routed_experts[0].shape)}",
          flush=True)
    engine.sleep()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    batch = pad_batch(expanded, out.response_ids, 0)
    rollout_lp = scatter_response_values(out.response_logprobs, batch["response_mask"])
    batch["routed_experts"] = routing_batch(out.routed_experts, [len(q) for q in expanded], a.prompt_len,
                                            batch["input_ids"].shape[1])
    actor = MegatronActor.from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-6), dtype=torch.bfloat16, seed=0,
                                  trainable=False)
    actor.enable_routing_replay()
    from rljob_worker.megatron import routing_replay

    counts = {"agree": 0, "total": 0}
    filler = torch.arange(SHAPE["num_experts_per_tok"])
    for replay in actor.routing_replays:  # the unreplayed pass: compare the trainer's own top-8 sets with vLLM's
        inner = replay.get_replay_topk

        def keep(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None, _r=replay, _f=inner):
            probs, idx = _f(scores, topk, num_groups, group_topk, default_compute_topk)
            expected = getattr(_r, "expected", None)
            if _r.current is None and expected is not None:
                want = expected.to(idx.device).long().sort(-1).values
                real = ~(want.cpu() == filler).all(-1)  # padding and never-fed positions hold the filler
                same = (idx.sort(-1).values == want).all(-1).cpu()
                counts["agree"] += int(same[real].sum())
                counts["total"] += int(real.sum())
            return probs, idx

        replay.get_replay_topk = keep
    set_micro_batch = routing_replay.set_micro_batch

    def observe(replays, tokens):  # hand vLLM's experts to the comparison, let the routers choose
        for r in replays:
            r.expected = None if tokens is None else tokens[:, r.layer]
        set_micro_batch(replays, None)

    routing_replay.set_micro_batch = observe
    t0 = time.perf_counter()
    own = actor.compute_logprobs(batch, micro_batch_size=16)["logprobs"]
    own_s = time.perf_counter() - t0
    routing_replay.set_micro_batch = set_micro_batch
    for r in actor.routing_replays:
        r.expected = None
    t0 = time.perf_counter()
    replayed = actor.compute_logprobs(batch, micro_batch_size=16)["logprobs"]
    replay_s = time.perf_counter() - t0
    share = counts["agree"] / max(counts["total"], 1)
    print(f"RESULT the trainer's own top-8 set equals vLLM's for {share:.4f} of {counts['total']} (token, layer) "
          f"pairs", flush=True)
    mask = batch["response_mask"].bool()
    shape = (f"Qwen3-30B-A3B shape at {a.layers} layers (128 experts, top-8), random init, bf16, 1 GPU EP1; vLLM 0.26 "
             f"{a.prompts} x {a.n} samples of {a.prompt_len} + <= {a.new} tokens, temperature 1; megatron actor bf16")
    for name, lp in (("own routing", own), ("replayed routing", replayed)):
        gap = (lp - rollout_lp)[mask].abs().float()
        print(f"RESULT {name}: |log pi_train - log pi_rollout| mean {gap.mean():.4f} p99 {gap.quantile(0.99):.4f} "
              f"max {gap.max():.3f}, share > 0.1 {(gap > 0.1).float().mean():.4f} ({gap.numel()} tokens)", flush=True)
    gap_own, gap_rep = ((lp - rollout_lp)[mask].abs().float() for lp in (own, replayed))
    results.record("MoE log-prob mismatch trainer vs vLLM, routing replay", shape, "logprob_gap_mean",
                   float(gap_rep.mean()), "nats", baseline="the trainer's own routing (no replay)",
                   baseline_value=float(gap_own.mean()), same_run=True)
    for metric, stat in (("logprob_gap_p99", lambda g: g.quantile(0.99)), ("logprob_gap_max", torch.max)):
        results.record("MoE log-prob mismatch trainer vs vLLM, routing replay", shape, metric, float(stat(gap_rep)),
                       "nats", baseline="the trainer's own routing (no replay)", baseline_value=float(stat(gap_own)),
                       same_run=True)
    results.record("MoE routing agreement trainer vs vLLM (no replay)", shape, "topk_set_agreement", share,
                   "fraction", baseline="replayed routing (agreement 1 by construction)", baseline_value=1.0,
                   same_run=True)
    print(f"old-policy pass {own_s:.1f}s, replayed pass {replay_s:.1f}s", flush=True)


if __name__ == "__main__":
    main()
