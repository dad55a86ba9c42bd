"""MoE routing replay (algorithm.routingReplay): the engine records each token's experts, the actor replays them.

One process: the transformers engine's recording equals the routing of a full forward over the same tokens; the
actor's log-probs under a given routing equal the HF model's forced to that routing (and differ from its own
choice); updates with activation recompute replay in the backward pass too. Two processes (``replay_layouts``
under torchrun): TP2 + sequence parallel, PP2 (routers of the second stage are HF layers 2 and 3) with full
recompute, CP2 and EP2 give the one-process results. A GRPO run on builtin://tiny-qwen3-moe learns with replay,
and the trainer's log-probs match the rollout's.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
import tolerances as T
from rljob_worker.data.batching import pad_batch
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
from rljob_worker.megatron.engine_config import RecomputeConfig
from rljob_worker.rollout.base import SamplingParams
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.routed_experts import routing_batch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) path")

TOP_K, EXPERTS = 2, 4  # megatron_helpers' tiny MoE: 4 experts, top-2


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_replay")
    return {
        # 4 layers, layer 1 dense: a pipeline's second stage holds HF layers 2 and 3
        "qwen3_moe": H.make_tiny_hf_model("qwen3_moe", root / "qwen3_moe", seed=3, num_hidden_layers=4,
                                          mlp_only_layers=[1]),
        "qwen2_moe": H.make_tiny_hf_model("qwen2_moe", root / "qwen2_moe", seed=4),
    }


def random_routing(batch: int, cols: int, layers: int, seed: int = 7) -> torch.Tensor:
    """(batch, cols, layers, k) distinct experts per token, uniformly at random."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, cols, layers, EXPERTS, generator=g)
    return scores.topk(TOP_K, dim=-1).indices.to(torch.uint8)


def _gates(model):
    return {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}


def _hf_logprobs_with_grad(model, ids, mask):
    """megatron_helpers.hf_logprobs' convention (log p(x_t | x_<t) at t, 0 where undefined), differentiable."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1].float()
    lp = torch.nn.functional.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    return lp * (mask.bool() & (mask.cumsum(1) > 1))


def hf_forced_logprobs(model, ids, mask, routed, grad: bool = False):
    """The HF model's next-token log-probs (B, T) with every MoE layer's router forced to ``routed``'s experts
    (the weights: the router's own softmax at them, renormalised as the model's top-k is)."""
    handles = []
    for i, gate in _gates(model).items():
        def force(module, _inputs, output, layer=i):
            logits = output[0]
            idx = routed[:, :, layer].reshape(-1, TOP_K).long()
            weights = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if module.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), idx
        handles.append(gate.register_forward_hook(force))
    try:
        return _hf_logprobs_with_grad(model, ids, mask) if grad else H.hf_logprobs(model, ids, mask)
    finally:
        for h in handles:
            h.remove()


def _actor(hf_dir, parallel=None, recompute=None):
    parallel = parallel or ParallelConfig()
    kw = {"recompute": recompute} if recompute is not None else {}
    actor = MegatronActor.from_hf(hf_dir, parallel, OptimConfig(lr=1e-2, grad_clip=0.0), seed=1,
                                  transformer_overrides={"moe_aux_loss_coeff": 0.0}, **kw)
    actor.enable_routing_replay()
    return actor


# --------------------------------------------------------------------------------------------------
# one process


def test_engine_records_the_routing_of_a_full_forward(hf_dirs):
    """Sampling with a KV cache (a prefill, then one token a step) records per token the experts that a forward
    over the whole prompt + response chooses; the dense layer holds the filler; the last token is never fed."""
    engine = HFEngine(str(hf_dirs["qwen3_moe"]), dtype=torch.float32, device=torch.device("cpu"), eos_token_id=1,
                      pad_token_id=0, record_routing=True)
    prompts = [[5, 9, 17, 3], [40, 2], [7, 7, 7, 7, 7, 8]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=7, seed=3))
    assert len(out.routed_experts) == 6
    model, gates = engine.model, _gates(engine.model)
    for j, (resp, routed) in enumerate(zip(out.response_ids, out.routed_experts)):
        tokens = prompts[j // 2] + resp[:-1]
        assert tuple(routed.shape) == (len(tokens), 4, TOP_K)
        assert routed.dtype == torch.uint8
        seen = {}
        handles = [g.register_forward_hook(lambda m, a, o, i=i, seen=seen: seen.__setitem__(i, o[2]))
                   for i, g in gates.items()]
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
        for h in handles:
            h.remove()
        for layer, idx in seen.items():
            assert torch.equal(routed[:, layer].long(), idx), (j, layer)
        assert torch.equal(routed[:, 1].long(), torch.arange(TOP_K).expand(len(tokens), TOP_K))  # dense layer


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_replayed_logprobs_equal_the_hf_model_forced_to_the_same_experts(hf_dirs, arch):
    hf = H.load_hf_model(hf_dirs[arch])
    ids, mask = H.sample_batch()
    routed = random_routing(*ids.shape, hf.config.num_hidden_layers)
    actor = _actor(hf_dirs[arch])
    replayed = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask, "routed_experts": routed}, 3)
    own = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, 3)  # no routing given: routers choose
    tol = H.reorder_bounds(hf_dirs[arch], ids, mask)["lp"]
    valid = (mask.bool() & (mask.cumsum(1) > 1))
    torch.testing.assert_close(replayed["logprobs"], hf_forced_logprobs(hf, ids, mask, routed), rtol=0, atol=tol)
    torch.testing.assert_close(own["logprobs"], H.hf_logprobs(hf, ids, mask), rtol=0, atol=tol)
    # the random routing is not the model's own: the log-probs move beyond rounding (the HF comparison above
    # therefore could not pass with the routers choosing for themselves)
    assert (replayed["logprobs"] - own["logprobs"])[valid].abs().max() > 4 * tol


def test_an_update_replays_in_the_backward_recompute_too(hf_dirs):
    """Full recompute re-runs each layer's router inside the backward pass; with two micro-batches in flight the
    recompute takes its own micro-batch's experts: loss and gradient norm equal the run without recompute and
    the HF model forced to the same experts."""
    ids, mask = H.sample_batch()
    routed = random_routing(*ids.shape, 4, seed=11)
    batch = {"input_ids": ids, "attention_mask": mask, "routed_experts": routed}
    plain = _actor(hf_dirs["qwen3_moe"]).update(batch, H.seq_nll_loss, micro_batch_size=2)
    recomputed = _actor(hf_dirs["qwen3_moe"], recompute=RecomputeConfig("full", "uniform", 1)).update(
        batch, H.seq_nll_loss, micro_batch_size=2)

    hf = H.load_hf_model(hf_dirs["qwen3_moe"]).train()
    valid = (mask.bool() & (mask.cumsum(1) > 1)).float()
    losses = []
    for rows in (slice(0, 2), slice(2, 4)):  # the actor's "mean" reduction: the mean of micro-batch losses
        lp = hf_forced_logprobs(hf, ids[rows], mask[rows], routed[rows], grad=True)
        losses.append(-(lp * valid[rows]).sum() / valid[rows].sum())
    ref_loss = sum(losses) / 2
    ref_loss.backward()
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None))

    tol = H.reorder_bounds(hf_dirs["qwen3_moe"], ids, mask)
    loss_tol = T.mean_bound(tol["lp"], tol["n"], tol["z"] + math.log(tol["config"]["vocab_size"]))
    for got in (plain, recomputed):
        assert got["loss"] == pytest.approx(float(ref_loss), abs=loss_tol)
        assert got["grad_norm"] == pytest.approx(float(ref_norm), rel=tol["grad"])


def test_replay_removes_the_routing_part_of_a_bf16_engines_mismatch(tmp_path):
    """The rollout's own numerics: a bf16 engine against the fp32 trainer, on a model whose routers nearly tie
    (router weights x 0.05) and whose experts matter (down projections x 8), so rounding flips some tokens'
    experts. Without replay those tokens' log-probs jump; with the engine's experts replayed only rounding is
    left: the largest gap shrinks severalfold (8x when written) and the trainer's routing is the engine's."""
    from rljob_worker.data.batching import scatter_response_values
    from safetensors.torch import load_file, save_file

    model_dir = H.make_tiny_hf_model("qwen3_moe", tmp_path / "m", seed=3, num_hidden_layers=4, mlp_only_layers=[1])
    weights = load_file(model_dir / "model.safetensors")
    for name in weights:
        if name.endswith("mlp.gate.weight"):
            weights[name] = weights[name] * 0.05
        elif ".experts." in name and "down_proj" in name:
            weights[name] = weights[name] * 8
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    engine = HFEngine(str(model_dir), dtype=torch.bfloat16, device=torch.device("cpu"), eos_token_id=1,
                      pad_token_id=0, record_routing=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (6,), generator=g).tolist() for _ in range(8)]
    out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=16, seed=1))
    expanded = [p for p in prompts for _ in range(4)]
    batch = pad_batch(expanded, out.response_ids, 0)
    rollout_lp = scatter_response_values(out.response_logprobs, batch["response_mask"])
    batch["routed_experts"] = routing_batch(out.routed_experts, [6] * len(expanded), 6, batch["input_ids"].shape[1])
    plain = {k: batch[k] for k in ("input_ids", "attention_mask")}

    actor = MegatronActor.from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-3), seed=1)
    own = actor.compute_logprobs(plain, 8)["logprobs"]
    actor.enable_routing_replay()
    replayed = actor.compute_logprobs(batch, 8)["logprobs"]
    mask = batch["response_mask"].bool()
    gap_own, gap_replayed = ((lp - rollout_lp)[mask].abs() for lp in (own, replayed))
    assert gap_replayed.max() * 3 < gap_own.max()
    assert gap_replayed.mean() < gap_own.mean()


def test_a_dense_model_is_refused_naming_the_field(tmp_path):
    from rljob_worker.megatron.errors import MegatronConfigError

    actor = MegatronActor.from_hf(H.make_tiny_hf_model("qwen2", tmp_path / "dense"), ParallelConfig(),
                                  OptimConfig(lr=1e-3), seed=1)
    with pytest.raises(MegatronConfigError, match=r"spec.algorithm.routingReplay: the model \(qwen2\) has no experts"):
        actor.enable_routing_replay()


def test_routing_batch_aligns_with_pad_batch():
    prompts, responses = [[3, 4, 5], [6]], [[7, 8], [9, 10, 11]]
    routed = [torch.full((4, 2, TOP_K), 3, dtype=torch.uint8), torch.full((3, 2, TOP_K), 2, dtype=torch.uint8)]
    batch = pad_batch(prompts, responses, pad_id=0)
    out = routing_batch(routed, [3, 1], 3, batch["input_ids"].shape[1])
    assert tuple(out.shape) == (2, 6, 2, TOP_K)
    fed = torch.zeros(2, 6, dtype=torch.bool)
    fed[0, 0:4], fed[1, 2:5] = True, True  # prompt + all but the last response token
    assert (out[0, :4] == 3).all() and (out[1, 2:5] == 2).all()
    assert torch.equal(out[~fed], torch.arange(TOP_K, dtype=torch.uint8).expand(int((~fed).sum()), 2, TOP_K))


# --------------------------------------------------------------------------------------------------
# layouts (two processes) against one process

LAYOUTS = {
    "tp2_sp": ParallelConfig(tp=2, sequence_parallel=True),
    "pp2_recompute": ParallelConfig(pp=2),
    "cp2": ParallelConfig(cp=2),
    "ep2": ParallelConfig(ep=2),
    # micro-batches concatenated (packing.pack_concatenated): the recorded experts follow each token there too
    "tp2_sp_concatenated": ParallelConfig(tp=2, sequence_parallel=True),
    "pp2_recompute_concatenated": ParallelConfig(pp=2),
}


def replay_steps(hf_dir, parallel, recompute=None) -> dict:
    """Log-probs under a random routing of varied_batch, an update at micro-batch 2 (TP/PP/CP: every rank on
    the whole batch), and the log-probs after it."""
    ids, mask = H.varied_batch()
    batch = {"input_ids": ids, "attention_mask": mask, "routed_experts": random_routing(*ids.shape, 4, seed=5)}
    actor = _actor(hf_dir, parallel, recompute)
    out = {"logprobs": actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"]}
    if parallel.ep == 1:
        out["update"] = actor.update(batch, H.seq_nll_loss, micro_batch_size=2)
        out["after"] = actor.compute_logprobs(batch, micro_batch_size=4)["logprobs"]
    return out


def _scenario_replay_layouts(hf_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    results = {}
    for name, parallel in LAYOUTS.items():
        MoEAuxLossAutoScaler.main_loss_backward_scale = None  # process-wide state the next layout's schedule sets
        recompute = RecomputeConfig("full", "uniform", 1) if "recompute" in name else None
        os.environ["RLJOB_SEQUENCE_PACKING"] = "on" if name.endswith("_concatenated") else "off"
        results[name] = replay_steps(hf_dir, parallel, recompute)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, Path(out_dir) / "replay_layouts.pt")


@pytest.fixture(scope="module")
def layouts(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay_layouts")
    H.run_torchrun("replay_layouts", hf_dirs["qwen3_moe"], out, timeout=400, script=__file__)
    return torch.load(out / "replay_layouts.pt"), replay_steps(hf_dirs["qwen3_moe"], ParallelConfig())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replay_in_every_layout_equals_one_process(hf_dirs, layouts, layout):
    got, ref = layouts[0][layout], layouts[1]
    tol = H.reorder_bounds(hf_dirs["qwen3_moe"], *H.varied_batch())
    torch.testing.assert_close(got["logprobs"], ref["logprobs"], rtol=0, atol=tol["lp"])
    if "update" in got:
        bounds = H.metric_bounds(tol, ref["update"])
        for key in ("loss", "grad_norm"):
            assert got["update"][key] == pytest.approx(ref["update"][key], abs=bounds[key]), key
        # after an Adam step: within the pre-step bounds, as test_megatron_moe's layouts
        assert (got["after"] - ref["after"]).abs().max() <= tol["lp"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worker"))
    torch.set_num_threads(1)
    {"replay_layouts": _scenario_replay_layouts}[sys.argv[1]](sys.argv[2], sys.argv[3])
    from rljob_worker.runtime.distributed import destroy_distributed

    destroy_distributed()


# --------------------------------------------------------------------------------------------------
# the trainer


def test_grpo_with_routing_replay_learns_on_the_moe_example(tmp_path):
    """examples/moe-routing-replay.yaml in one process (the example runs EP2 over two): the engine's routing
    reaches the actor through the batch (two mini-batches: the old-policy pass replays too), the trainer's
    log-probs stay on the rollout's (no token off by 0.1), and the task is learned."""
    import yaml
    from test_learning import rewards, run_trainer

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "moe-routing-replay.yaml").read_text())
    spec = spec["spec"]
    spec["gpusPerNode"] = 1
    spec["megatron"].pop("expertModelParallelSize")
    records = run_trainer(spec, tmp_path, "--checkpoint-uri", f"file://{tmp_path}/ckpt")
    r = rewards(records)
    assert len(r) == 30 and r[:3].mean() < 0.3 and r[-5:].mean() > 0.7, r
    assert all(rec["rollout/logprob_mismatch_frac"] == 0 for rec in records)
    assert all(rec["timing/old_logprob_s"] > 0 for rec in records)
