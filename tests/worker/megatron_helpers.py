"""Helpers for the megatron actor tests: tiny random HF models and a torchrun entry point.

Run as a script under torchrun (``python -m torch.distributed.run --nproc-per-node 2
tests/worker/megatron_helpers.py SCENARIO HF_DIR OUT_DIR``) it plays one multi-process scenario and
writes its results to ``OUT_DIR`` (the ``__main__`` guard is required: dist-checkpoint saving starts
a writer process).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}

TINY_MOE = {
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.01,
    "rope_theta": 1000000.0,
}


def tiny_hf_config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "qwen2":  # qkv bias, tied embeddings
        cls, kw = Qwen2Config, {"tie_word_embeddings": True, "rope_theta": 10000.0}
    elif arch == "llama":  # untied, llama3 rope scaling
        llama3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        cls, kw = (
            LlamaConfig,
            {
                "tie_word_embeddings": False,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, **llama3},
                "rope_theta": 500000.0,
                "max_position_embeddings": 16384,
            },
        )
    elif arch == "qwen3":  # q/k norm, head_dim != hidden / heads
        cls, kw = Qwen3Config, {"tie_word_embeddings": False, "head_dim": 32, "rope_theta": 1000000.0}
    elif arch == "qwen3_moe":  # 4 experts top-2 (renormalised) in layer 0, a dense MLP in layer 1
        from transformers import Qwen3MoeConfig

        cls, kw = Qwen3MoeConfig, {**TINY_MOE, "head_dim": 32, "mlp_only_layers": [1], "norm_topk_prob": True}
    elif arch == "qwen2_moe":  # + shared expert with its sigmoid gate, qkv bias, top-k not renormalised
        from transformers import Qwen2MoeConfig

        cls, kw = Qwen2MoeConfig, {**TINY_MOE, "shared_expert_intermediate_size": 48, "norm_topk_prob": False}
    else:
        raise ValueError(arch)
    return cls(**{**TINY, **kw, **overrides})


def make_tiny_hf_model(arch: str, out_dir: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """A random fp32 ``*ForCausalLM`` saved with ``save_pretrained`` (no downloads)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # norms and biases are 1/0 at init: randomise so the mapping is tested
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def load_hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        hf_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()


def sample_batch(vocab: int = 128, seed: int = 0):
    """(input_ids, attention_mask) of 4 rows x 12: left-padded prompts + right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    mask[2, :2] = 0
    mask[2, 10:] = 0  # both
    return ids, mask


def varied_batch(vocab: int = 128, seed: int = 1):
    """(input_ids, attention_mask) of 4 rows x 15 with 15, 7, 11 and 13 real tokens (left, right and
    both-sided padding): packed lengths that 2 * cp and TP do not divide."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 15), generator=g)
    mask = torch.ones(4, 15, dtype=torch.long)
    mask[1, :8] = 0  # 7 real, left padded
    mask[2, 11:] = 0  # 11 real, right padded
    mask[3, :1] = 0
    mask[3, 14:] = 0  # 13 real, both
    return ids, mask


def hf_logits(model, input_ids, attention_mask):
    pos = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits


def max_abs_logit(hf_dir, input_ids, attention_mask, temperature: float = 1.0) -> float:
    """The largest |logit| / T of the HF model over the batch's real tokens: the magnitude the
    tolerances' bounds (tolerances.py) scale with."""
    logits = hf_logits(load_hf_model(hf_dir), input_ids, attention_mask)
    return logits[attention_mask.bool()].abs().max().item() / temperature


def reorder_bounds(hf_dir, input_ids, attention_mask) -> dict:
    """The fp32 reordering bounds (tolerances.py) of the HF model in hf_dir on this batch, for two
    evaluations whose sums run in another order (megatron against HF, TP/DP/PP/CP/EP layouts and
    micro-batch splits against one process; a 2-rank all-reduce re-brackets a sum decoder_chain already
    counts): logit (relative), lp / ent (absolute, per token), grad (relative), and the model's
    config, max |logit| z, the number n of log-prob tokens and the sequence length."""
    import tolerances as T

    config, seq = T.hf_config(hf_dir), input_ids.shape[1]
    z = max_abs_logit(hf_dir, input_ids, attention_mask)
    n = int((attention_mask.bool() & (attention_mask.cumsum(1) > 1)).sum())
    return {"logit": T.logit_bound(config, seq), "lp": T.logprob_bound(config, z, seq_len=seq),
            "ent": T.entropy_bound(config, z, seq_len=seq), "config": config, "z": z, "n": n, "seq": seq,
            "grad": T.grad_bound(config, n, z, seq_len=seq)}


def metric_bounds(tol: dict, ref: dict) -> dict:
    """Absolute bounds (tol: reorder_bounds) on update()'s metrics with seq_nll_loss, ref the other
    run's: the loss/nll and entropy are token means (mean_bound); the load-balancing loss sums router
    probabilities over the tokens and experts (positive terms: their magnitude is the loss); grad_norm
    relative (grad_bound). A normaliser off by the micro-batch or rank count is a factor >= 2, orders
    of magnitude above these."""
    import math

    import tolerances as T

    log_v = math.log(tol["config"]["vocab_size"])
    nll = T.mean_bound(tol["lp"], tol["n"], tol["z"] + log_v)
    out = {"loss": nll, "nll": nll, "entropy": T.mean_bound(tol["ent"], tol["n"], log_v),
           "grad_norm": tol["grad"] * abs(ref["grad_norm"])}
    if "moe_aux_loss" in ref:
        chain = T.decoder_chain(tol["config"], tol["seq"]) + tol["n"]
        out["moe_aux_loss"] = T.reorder_bound(chain, abs(ref["moe_aux_loss"]))
    return out


def hf_logprobs(model, input_ids, attention_mask):
    """Reference in the actor's convention: log p(x_t | real x_<t) at t, 0 where undefined."""
    logits = hf_logits(model, input_ids, attention_mask)
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    lp = torch.nn.functional.pad(lp, (1, 0))
    m = attention_mask.bool()
    valid = m & (m.long().cumsum(1) > 1)
    return lp * valid


def seq_nll_loss(logprobs, entropy, mb):
    """-mean log-prob over valid positions (the test loss)."""
    m = mb["attention_mask"].bool()
    valid = (m & (m.long().cumsum(1) > 1)).float()
    loss = -(logprobs * valid).sum() / valid.sum()
    metrics = {"nll": loss.detach()}
    if entropy is not None:
        metrics["entropy"] = ((entropy * valid).sum() / valid.sum()).detach()
    return loss, metrics


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, never handed out before by this process, drawn below the kernel's
    ephemeral range: outgoing connections (gloo pairs, the rendezvous store, HTTP clients) take their source
    ports from that range, and in CI one took a port the kernel had handed out as free before the service bound
    it (a metrics port, between a killed run and its resume). As tests/conftest.py's free_ports, which test
    modules cannot import."""
    import random

    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    low = 10000 if high - 10000 >= 1000 else 1024
    for _ in range(20000):
        port = random.randrange(low, high)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free port on 127.0.0.1 below the ephemeral range")


def run_torchrun(
    scenario: str, hf_dir, out_dir, nproc: int = 2, timeout: float = 120, script: str | os.PathLike = __file__
) -> subprocess.CompletedProcess:
    """``script scenario hf_dir out_dir`` under torchrun on ``nproc`` gloo processes (``script``: this
    module's scenarios, or another module that dispatches the same way)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        scenario,
        str(hf_dir),
        str(out_dir),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun {scenario} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


# --------------------------------------------------------------------------------------------------
# scenarios run under torchrun


def _scenario_tp2(hf_dir: str, out_dir: str) -> None:
    """TP=2: logprobs, entropy, one update, export, dist-checkpoint; then DP=2 on the same ranks."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    out = Path(out_dir)
    ids, mask = sample_batch()
    actor = MegatronActor.from_hf(hf_dir, ParallelConfig(tp=2), OptimConfig(lr=1e-3), seed=1)
    rank = dist.get_rank()
    res = actor.compute_logprobs(
        {"input_ids": ids, "attention_mask": mask}, micro_batch_size=2, with_entropy=True
    )
    exported = {k: v.cpu() for k, v in actor.export_hf_weights()}
    metrics = actor.update(
        {"input_ids": ids, "attention_mask": mask}, seq_nll_loss, micro_batch_size=2, with_entropy=True
    )
    after = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, micro_batch_size=4)
    actor.save_checkpoint(out / "ckpt_tp2")
    eval_loss = actor.eval_loss(ids, mask)
    exported_after = {k: v.cpu() for k, v in actor.export_hf_weights()}
    if rank == 0:
        torch.save(
            {
                "logprobs": res["logprobs"],
                "entropy": res["entropy"],
                "metrics": metrics,
                "logprobs_after": after["logprobs"],
                "eval_loss": eval_loss,
                "exported": exported,
                "exported_after": exported_after,
            },
            out / "tp2.pt",
        )

    # A vocab TP does not divide (127): padded to 128 inside megatron, stripped on export.
    pad_dir = out / "hf_pad"
    if pad_dir.exists():
        actor = MegatronActor.from_hf(pad_dir, ParallelConfig(tp=2), OptimConfig(lr=1e-3), seed=1)
        ids127 = ids.clamp(max=126)
        res = actor.compute_logprobs({"input_ids": ids127, "attention_mask": mask}, 4, with_entropy=True)
        exported = {k: v.cpu() for k, v in actor.export_hf_weights()}
        if rank == 0:
            torch.save(
                {"logprobs": res["logprobs"], "entropy": res["entropy"], "exported": exported},
                out / "tp2_pad.pt",
            )

    # DP=2 on the same two processes: each rank takes half of the batch.
    actor = MegatronActor.from_hf(hf_dir, ParallelConfig(tp=1), OptimConfig(lr=1e-3), seed=1)
    half = slice(rank * 2, rank * 2 + 2)
    metrics = actor.update(
        {"input_ids": ids[half], "attention_mask": mask[half]}, seq_nll_loss, micro_batch_size=2
    )
    exported = {k: v.cpu() for k, v in actor.export_hf_weights()}
    checksum = torch.stack([t.double().sum() for t in exported.values()]).to(actor.device)
    gathered = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksum)
    gathered = [g.cpu() for g in gathered]
    actor.save_checkpoint(out / "ckpt_dp2")
    eval_loss = actor.eval_loss(ids, mask)
    if rank == 0:
        torch.save(
            {"metrics": metrics, "checksums": gathered, "exported": exported, "eval_loss": eval_loss},
            out / "dp2.pt",
        )
    (out / f"done_{rank}").write_text(json.dumps({"rank": rank}))


def _scenario_dp2_bf16_distopt(hf_dir: str, out_dir: str) -> None:
    """DP=2, bf16, distributed optimizer (GPU): 3 updates on half batches each, then a checkpoint."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    out = Path(out_dir)
    ids, mask = sample_batch()
    actor = MegatronActor.from_hf(
        hf_dir,
        ParallelConfig(use_distributed_optimizer=True),
        OptimConfig(lr=1e-2),
        dtype=torch.bfloat16,
        seed=1,
    )
    rank = dist.get_rank()
    half = slice(rank * 2, rank * 2 + 2)
    history = [
        actor.update({"input_ids": ids[half], "attention_mask": mask[half]}, seq_nll_loss, micro_batch_size=2)
        for _ in range(3)
    ]
    actor.save_checkpoint(out / "ckpt_dp2_distopt")
    nxt = actor.update(
        {"input_ids": ids[half], "attention_mask": mask[half]}, seq_nll_loss, micro_batch_size=2
    )
    exported = {k: v.cpu() for k, v in actor.export_hf_weights()}
    if rank == 0:
        torch.save({"history": history, "next": nxt, "exported": exported}, out / "dp2_distopt.pt")


def run_parallel_steps(
    hf_dir, parallel, dtype=torch.float32, steps: int = 2, lr: float = 1e-2, ckpt_dir=None
) -> dict:
    """Log-probs + entropy, then ``steps`` updates (with entropy), then log-probs again, of
    :func:`varied_batch` at micro-batch 2: the same calls in every process, whatever the layout.
    With ``ckpt_dir``, a distributed checkpoint is saved at the end."""
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig

    ids, mask = varied_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = MegatronActor.from_hf(hf_dir, parallel, OptimConfig(lr=lr), dtype=dtype, seed=1)
    # the tokens each layer really sees ([s, b, h] into the first norm): T / cp with CP, T / tp with SP
    seen = []
    norm = actor.core.decoder.layers[0].input_layernorm
    hook = norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    res = actor.compute_logprobs(batch, micro_batch_size=2, with_entropy=True)
    hook.remove()
    logits = actor.forward_logits(ids, mask)
    history = [actor.update(batch, seq_nll_loss, micro_batch_size=2, with_entropy=True) for _ in range(steps)]
    after = actor.compute_logprobs(batch, micro_batch_size=4)
    exported = {k: v.cpu() for k, v in actor.export_hf_weights()}
    if ckpt_dir is not None:
        actor.save_checkpoint(ckpt_dir)
    return {
        "logprobs": res["logprobs"].cpu(),
        "entropy": res["entropy"].cpu(),
        "logits": logits.cpu(),
        "history": history,
        "logprobs_after": after["logprobs"].cpu(),
        "exported_after": exported,
        "seq_seen": seen,
        "norm_types": sorted(
            {type(m).__name__ for n, m in actor.core.named_modules() if n.endswith("layernorm")}
            - {"IdentityOp"}
        ),
        "sp_tagged": sorted(
            n for n, p in actor.core.named_parameters() if getattr(p, "sequence_parallel", False)
        ),
    }


def _scenario_cp_sp(hf_dir: str, out_dir: str) -> None:
    """Two processes: CP=2 (qwen2), then TP=2 + sequence parallel (qwen2 and, if present, qwen3 with
    and without SP)."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import ParallelConfig

    out = Path(out_dir)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    results = {"cp2": run_parallel_steps(hf_dir, ParallelConfig(cp=2), dtype, ckpt_dir=out / "ckpt_cp2")}
    results["tp2_sp"] = run_parallel_steps(hf_dir, ParallelConfig(tp=2, sequence_parallel=True), dtype)
    os.environ["RLJOB_SEQUENCE_PACKING"] = "on"  # micro-batches as one concatenated sequence, split over TP
    results["tp2_sp_packed"] = run_parallel_steps(hf_dir, ParallelConfig(tp=2, sequence_parallel=True), dtype)
    del os.environ["RLJOB_SEQUENCE_PACKING"]
    qwen3 = out / "hf_qwen3"
    if qwen3.exists():  # q/k norms: replicated weights with per-TP-rank partial grads, with and without SP
        results["tp2_qwen3"] = run_parallel_steps(qwen3, ParallelConfig(tp=2), dtype)
        results["tp2_sp_qwen3"] = run_parallel_steps(
            qwen3, ParallelConfig(tp=2, sequence_parallel=True), dtype
        )
    if dist.get_rank() == 0:
        torch.save(results, out / "cp_sp.pt")


def _scenario_ep2(hf_dir: str, out_dir: str) -> None:
    """Qwen3-MoE on two ranks (DP=2 for the dense part): EP=1 (experts replicated) against EP=2
    (two experts each), same data layout, aux loss on: logprobs of the whole batch, two updates on
    half batches, export, an EP=2 checkpoint. Then TP=2 with expert TP=2 (EP=1) and TP=2 with EP=2
    (expert TP=1), frozen: logprobs and export."""
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    out = Path(out_dir)
    ids, mask = sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    rank = int(os.environ["RANK"])  # before from_hf initialises torch.distributed
    half = slice(rank * 2, rank * 2 + 2)
    results = {}
    for name, parallel in (("ep1", ParallelConfig()), ("ep2", ParallelConfig(ep=2))):
        actor = MegatronActor.from_hf(hf_dir, parallel, OptimConfig(lr=1e-2), seed=1)
        res = {"logprobs": actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"]}
        res["local_experts"] = sorted(n for n, _ in actor.core.named_parameters() if ".local_experts." in n)
        res["history"] = [
            actor.update({"input_ids": ids[half], "attention_mask": mask[half]}, seq_nll_loss, micro_batch_size=1)
            for _ in range(2)
        ]
        res["exported"] = {k: v.cpu() for k, v in actor.export_hf_weights()}
        if name == "ep2":
            actor.save_checkpoint(out / "ckpt_ep2")
        res["eval_loss"] = actor.eval_loss(ids, mask)
        results[name] = res
    for name, parallel in (("tp2_etp2", ParallelConfig(tp=2, etp=2)), ("tp2_ep2", ParallelConfig(tp=2, ep=2, etp=1))):
        # frozen: megatron trains MoE under TP only with sequence parallel (scenario moe_tp2_sp)
        actor = MegatronActor.from_hf(hf_dir, parallel, OptimConfig(lr=1e-2), seed=1, trainable=False)
        results[name] = {
            "logprobs": actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"],
            "exported": {k: v.cpu() for k, v in actor.export_hf_weights()},
        }
    if rank == 0:
        torch.save(results, out / "ep2.pt")


def _scenario_moe_tp2_sp(hf_dir: str, out_dir: str) -> None:
    """Two processes: Qwen3-MoE (``hf_dir``) trained at TP=2 + sequence parallel, with expert TP = TP
    (megatron's default) and with expert TP = 1 (experts replicated over the TP ranks, each running
    its own sequence share); then Qwen2-MoE (shared expert + gate, ``OUT_DIR/hf_qwen2_moe``) alike."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import ParallelConfig

    out = Path(out_dir)
    results = {}
    models = {"qwen3_moe": hf_dir, "qwen2_moe": out / "hf_qwen2_moe"}
    for arch, path in models.items():
        for name, etp in (("etp2", None), ("etp1", 1)):
            parallel = ParallelConfig(tp=2, etp=etp, sequence_parallel=True)
            results[f"{arch}_tp2_sp_{name}"] = run_parallel_steps(path, parallel)
    if dist.get_rank() == 0:
        torch.save(results, out / "moe_tp2_sp.pt")


def _scenario_moe_tp2_sp_ep2(hf_dir: str, out_dir: str) -> None:
    """Four processes: Qwen3-MoE at TP=2 + sequence parallel + EP=2 (expert TP 2; DP=2 on the same
    data), as the production layout TP2 + SP + EP4 in miniature. The alltoall dispatcher gathers
    uneven token counts over expert TP (gloo: cpu_compat pads them)."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import ParallelConfig

    res = run_parallel_steps(hf_dir, ParallelConfig(tp=2, ep=2, sequence_parallel=True))
    if dist.get_rank() == 0:
        torch.save(res, Path(out_dir) / "moe_tp2_sp_ep2.pt")


def _scenario_ep2_bf16(hf_dir: str, out_dir: str) -> None:
    """GPU: Qwen3-MoE in bf16 with the distributed optimizer on two GPUs, EP=1 against EP=2 (DP=2 for
    the dense part): logprobs, two updates on half batches, export."""
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids, mask = sample_batch()
    rank = int(os.environ["RANK"])
    half = slice(rank * 2, rank * 2 + 2)
    results = {}
    for name, ep in (("ep1", 1), ("ep2", 2)):
        actor = MegatronActor.from_hf(
            hf_dir,
            ParallelConfig(ep=ep, use_distributed_optimizer=True),
            OptimConfig(lr=1e-3, grad_clip=100.0),
            dtype=torch.bfloat16,
            seed=1,
        )
        res = {"logprobs": actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, 2)["logprobs"]}
        res["history"] = [
            actor.update({"input_ids": ids[half], "attention_mask": mask[half]}, seq_nll_loss, micro_batch_size=1)
            for _ in range(2)
        ]
        res["exported"] = {k: v.float().cpu() for k, v in actor.export_hf_weights()}
        results[name] = res
    if rank == 0:
        torch.save(results, out / "ep2_bf16.pt")


PP_MODELS = {  # name -> (arch, overrides) of the models the pp2 scenario runs
    "llama": ("llama", {}),  # untied, 2 layers: one per stage
    "qwen2_tied": ("qwen2", {}),  # tied embeddings: a copy on the last stage
    "llama4": ("llama", {"num_hidden_layers": 4}),  # VPP2: two chunks of one layer per stage
}


def make_pp_models(root) -> Path:
    root = Path(root)
    for i, (name, (arch, overrides)) in enumerate(PP_MODELS.items()):
        make_tiny_hf_model(arch, root / name, seed=i, **overrides)
    return root


def pp_steps(actor, out_dir=None) -> dict:
    """What the PP tests compare between layouts: log-probs and entropy, logits, two updates (at
    micro-batch 2, then 3: uneven micro-batches, which the pipeline pads to one shape), log-probs
    after, eval loss, the exported weights (and a checkpoint in ``out_dir``)."""
    ids, mask = sample_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    res = actor.compute_logprobs(batch, micro_batch_size=2, with_entropy=True)
    out = {
        "logprobs": res["logprobs"],
        "entropy": res["entropy"],
        "logits": actor.forward_logits(ids, mask),
        "exported": {k: v.cpu() for k, v in actor.export_hf_weights()},
        "updates": [
            actor.update(batch, seq_nll_loss, micro_batch_size=mbs, with_entropy=True) for mbs in (2, 3)
        ],
        "logprobs_after": actor.compute_logprobs(batch, micro_batch_size=1)["logprobs"],
        "eval_loss": actor.eval_loss(ids, mask),
    }
    if out_dir is not None:
        actor.save_checkpoint(Path(out_dir))
    out["exported_after"] = {k: v.cpu() for k, v in actor.export_hf_weights()}
    return out


def _scenario_pp2(models_root: str, out_dir: str) -> None:
    """PP=2 (and PP=2 x VPP=2) over two gloo processes: every model of PP_MODELS through pp_steps,
    checkpoints and an HF export; each rank saves its results (they must agree)."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    out, root = Path(out_dir), Path(models_root)
    results = {}
    for name, vpp in (("llama", None), ("qwen2_tied", None), ("llama4", 2)):
        actor = MegatronActor.from_hf(root / name, ParallelConfig(pp=2, vpp=vpp), OptimConfig(lr=1e-3), seed=1)
        results[name] = pp_steps(actor, out / f"ckpt_{name}")
        if name == "qwen2_tied":
            actor.save_hf_checkpoint(out / "hf_export_tied")
    results["mixed"] = _mix_tp_and_pp_checkpoints(root / "llama", out)
    os.environ["RLJOB_SEQUENCE_PACKING"] = "on"  # micro-batches concatenated: (1, longest total) through the stages
    for name, vpp in (("qwen2_tied", None), ("llama4", 2)):
        actor = MegatronActor.from_hf(root / name, ParallelConfig(pp=2, vpp=vpp), OptimConfig(lr=1e-3), seed=1)
        results[f"{name}_concatenated"] = pp_steps(actor)
    del os.environ["RLJOB_SEQUENCE_PACKING"]
    torch.save(results, out / f"pp2_rank{dist.get_rank()}.pt")


def _mix_tp_and_pp_checkpoints(hf_dir: Path, out: Path) -> dict:
    """TP2 loads the PP2 checkpoint, takes a step and saves; PP2 loads that TP2 checkpoint."""
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    ids, mask = sample_batch()
    tp2 = MegatronActor.from_hf(hf_dir, ParallelConfig(tp=2), OptimConfig(lr=1e-3), seed=5)
    tp2.load_checkpoint(out / "ckpt_llama")
    mixed = {"tp2_from_pp2": tp2.eval_loss(ids, mask)}
    tp2.update({"input_ids": ids, "attention_mask": mask}, seq_nll_loss, micro_batch_size=2)
    tp2.save_checkpoint(out / "ckpt_llama_tp2")
    mixed["tp2_after_step"] = tp2.eval_loss(ids, mask)
    pp2 = MegatronActor.from_hf(hf_dir, ParallelConfig(pp=2), OptimConfig(lr=1e-3), seed=5)
    mixed["pp2_from_tp2_meta"] = pp2.load_checkpoint(out / "ckpt_llama_tp2")
    mixed["pp2_from_tp2"] = pp2.eval_loss(ids, mask)
    return mixed


def _scenario_pp2_bf16(models_root: str, out_dir: str) -> None:
    """PP=2 in bf16 (GPU: Float16Module, megatron DDP and optimizer, finalize_model_grads for the
    tied embedding): pp_steps on the untied llama and the tied qwen2; each rank saves its results."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    out, root = Path(out_dir), Path(models_root)
    results = {}
    for name in ("llama", "qwen2_tied"):
        actor = MegatronActor.from_hf(
            root / name, ParallelConfig(pp=2), OptimConfig(lr=1e-3), dtype=torch.bfloat16, seed=1
        )
        results[name] = pp_steps(actor, out / f"ckpt_bf16_{name}")
    torch.save(results, out / f"pp2_bf16_rank{dist.get_rank()}.pt")


SCENARIOS = {
    "tp2": _scenario_tp2,
    "dp2_bf16_distopt": _scenario_dp2_bf16_distopt,
    "ep2": _scenario_ep2,
    "ep2_bf16": _scenario_ep2_bf16,
    "cp_sp": _scenario_cp_sp,
    "pp2": _scenario_pp2,
    "pp2_bf16": _scenario_pp2_bf16,
    "moe_tp2_sp": _scenario_moe_tp2_sp,
    "moe_tp2_sp_ep2": _scenario_moe_tp2_sp_ep2,
}


# --------------------------------------------------------------------------------------------------
# mixture-of-experts x pipeline parallelism (moe_pp2, moe_pp2_bf16)

MOE_PP_MODELS = {  # name -> (arch, overrides) of the models the moe_pp2 scenarios run
    # experts in layers 0, 2, 3, a dense MLP in layer 1: stage 0 holds [moe, dense], stage 1 [moe, moe]
    # (its experts are local layers 0, 1 = HF layers 2, 3)
    "qwen3_moe4": ("qwen3_moe", {"num_hidden_layers": 4, "mlp_only_layers": [1]}),
    "qwen2_moe": ("qwen2_moe", {}),  # shared experts + gate, one MoE layer per stage
    "qwen3_moe_dense_last": ("qwen3_moe", {}),  # 2 layers, layer 1 dense: stage 1 has no experts
}


def make_moe_pp_models(root) -> Path:
    root = Path(root)
    for i, (name, (arch, overrides)) in enumerate(MOE_PP_MODELS.items()):
        make_tiny_hf_model(arch, root / name, seed=10 + i, **overrides)
    return root


def moe_pp_steps(actor, out_dir=None) -> dict:
    """:func:`pp_steps` plus where this stage's layers and experts are. Its uneven micro-batches
    pad to one shape in the pipeline; the router's padding mask must keep that padding out of the
    load-balancing loss for PP2 to equal PP1."""
    layers = actor.core.decoder.layers
    structure = {
        "local_experts": sorted(
            {
                int(n.split("local_experts.")[1].split(".")[0])
                for n, _ in actor.core.named_parameters()
                if "local_experts." in n
            }
        ),
        "layer_numbers": [layer.layer_number for layer in layers],
        "moe_layers": [type(layer.mlp).__name__ for layer in layers],
    }
    return {**structure, **pp_steps(actor, out_dir)}


def _scenario_moe_pp2(
    models_root: str, out_dir: str, dtype=torch.float32, tag: str = "moe_pp2", names=tuple(MOE_PP_MODELS)
) -> None:
    """PP=2 (EP=1, DP=1) over two processes: the models ``names`` of MOE_PP_MODELS through
    moe_pp_steps, a checkpoint each; each rank saves its results (they must agree)."""
    import torch.distributed as dist
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    out, root = Path(out_dir), Path(models_root)
    results = {}
    for name in names:
        actor = MegatronActor.from_hf(
            root / name, ParallelConfig(pp=2), OptimConfig(lr=1e-3, grad_clip=100.0), dtype=dtype, seed=1
        )
        results[name] = moe_pp_steps(actor, out / f"ckpt_{tag}_{name}")
    if dtype == torch.float32:  # micro-batches concatenated, the padding mask over the padding segment
        os.environ["RLJOB_SEQUENCE_PACKING"] = "on"
        actor = MegatronActor.from_hf(
            root / "qwen2_moe", ParallelConfig(pp=2), OptimConfig(lr=1e-3, grad_clip=100.0), dtype=dtype, seed=1
        )
        results["qwen2_moe_concatenated"] = moe_pp_steps(actor)
        del os.environ["RLJOB_SEQUENCE_PACKING"]
    torch.save(results, out / f"{tag}_rank{dist.get_rank()}.pt")


def _scenario_moe_pp2_bf16(models_root: str, out_dir: str) -> None:
    """GPU: the moe_pp2 scenario in bf16 (megatron DDP and optimizer per stage), every stage with
    experts."""
    names = ("qwen3_moe4", "qwen2_moe")
    _scenario_moe_pp2(models_root, out_dir, dtype=torch.bfloat16, tag="moe_pp2_bf16", names=names)


def _scenario_moe_pp2_bf16_dense_last(models_root: str, out_dir: str) -> None:
    """GPU: qwen3_moe_dense_last in bf16 at PP=2: stage 1 has no expert parameters, so megatron's
    optimizer there chains no expert optimizer (its grad norm must still agree with stage 0's)."""
    names = ("qwen3_moe_dense_last",)
    _scenario_moe_pp2(models_root, out_dir, dtype=torch.bfloat16, tag="moe_pp2_bf16", names=names)


SCENARIOS.update(
    moe_pp2=_scenario_moe_pp2,
    moe_pp2_bf16=_scenario_moe_pp2_bf16,
    moe_pp2_bf16_dense_last=_scenario_moe_pp2_bf16_dense_last,
)


# --------------------------------------------------------------------------------------------------
# four GPUs (issue: 4-GPU parallelism verification): mixed layouts against one GPU


FOUR_GPU_LAYOUTS = {  # name -> (model, ParallelConfig kwargs)
    "tp2_pp2": ("qwen2", {"tp": 2, "pp": 2}),
    "tp2_dp2_distopt": ("qwen2", {"tp": 2, "use_distributed_optimizer": True}),
    "pp2_dp2_distopt": ("qwen2", {"pp": 2, "use_distributed_optimizer": True}),
    "tp2_sp_ep2_moe": ("qwen3_moe", {"tp": 2, "sequence_parallel": True, "ep": 2}),
    "tp2_cp2": ("qwen2", {"tp": 2, "cp": 2}),
}
if os.environ.get("RLJOB_GPU4_ONLY"):  # run a subset (debugging): comma-separated layout names
    FOUR_GPU_LAYOUTS = {k: v for k, v in FOUR_GPU_LAYOUTS.items() if k in os.environ["RLJOB_GPU4_ONLY"].split(",")}


def _scenario_gpu4(models_root: str, out_dir: str) -> None:
    """Four processes, bf16 on GPUs: each layout of FOUR_GPU_LAYOUTS runs :func:`run_parallel_steps`
    (every DP rank takes the same batch, so DP must change nothing). A failing layout is recorded,
    not fatal, so one report covers all of them."""
    import traceback

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from rljob_worker.megatron.actor import ParallelConfig

    results = {}
    for name, (model, kwargs) in FOUR_GPU_LAYOUTS.items():
        try:
            results[name] = run_parallel_steps(Path(models_root) / model, ParallelConfig(**kwargs), torch.bfloat16)
        except Exception:  # noqa: BLE001 - report and go on with the next layout
            results[name] = {"error": traceback.format_exc()[-3000:]}
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, Path(out_dir) / "gpu4.pt")


SCENARIOS["gpu4"] = _scenario_gpu4


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worker"))
    torch.set_num_threads(1)
    SCENARIOS[sys.argv[1]](sys.argv[2], sys.argv[3])
    from rljob_worker.runtime.distributed import destroy_distributed

    destroy_distributed()

