"""LoRA on megatron-core: the same adapters, gradients and loss at TP1, TP2, TP2 + SP, PP2, CP2, DP2 and at
any micro-batch size; a frozen base that training never touches; merged weights for the rollout; adapter-only
checkpoints that refuse another base model; a PEFT export that `peft` loads onto the HF base model."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lora_scenarios as S
import megatron_helpers as H
import tolerances as T
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig
from rljob_worker.megatron.errors import MegatronConfigError
from rljob_worker.megatron.lora import LoraConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) path")

LR = 1e-2


def lora_actor(hf_dir, parallel: ParallelConfig | None = None, **lora) -> MegatronActor:
    return MegatronActor.from_hf(hf_dir, parallel or ParallelConfig(), OptimConfig(lr=LR, grad_clip=0.0), seed=1,
                                 lora=LoraConfig(**{**S.LORA, "seed": 3, **lora}))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return H.make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora") / "hf")


@pytest.fixture(scope="module")
def tol(hf_dir):
    """Reordering bounds of the model on varied_batch (tolerances.py). Gradients of the second step follow
    one Adam step, taken within the pre-step bounds as in test_megatron_parallel; adapters after two steps
    within adam_weight_bound."""
    b = H.reorder_bounds(hf_dir, *H.varied_batch())
    return b | {"adapter": T.adam_weight_bound(b["grad"], lr=LR, steps=2)}


@pytest.fixture(scope="module")
def tp1(hf_dir):
    return S.lora_steps(lora_actor(hf_dir))


@pytest.fixture(scope="module")
def layouts(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_layouts")
    H.run_torchrun("layouts", hf_dir, out, timeout=600, script=Path(S.__file__))
    ranks = [torch.load(out / f"layouts_rank{r}.pt") for r in range(2)]
    merged = {}
    for name in S.LAYOUTS:  # PP: each stage has its own layers' adapters; TP ranks agree
        first = ranks[0][name]
        grads = [{**ranks[0][name]["grads"][i], **ranks[1][name]["grads"][i]} for i in range(2)]
        merged[name] = {**first, "grads": grads, "ranks": [r[name] for r in ranks], "out": out}
    return merged


def assert_grads_close(got: list[dict], want: list[dict], bound: float) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w)
        scale = max(t.abs().max().item() for t in w.values())
        assert scale > 0
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=0, atol=bound * scale,
                                       msg=lambda m, n=name, s=step: f"step {s + 1} {n}: {m}")


@pytest.mark.parametrize("layout", sorted(S.LAYOUTS))
def test_layout_gives_tp1s_loss_gradients_and_adapters(layouts, tp1, tol, layout):
    got = layouts[layout]
    bounds = H.metric_bounds(tol, tp1["updates"][0])
    for g, w in zip(got["updates"], tp1["updates"]):
        assert g["loss"] == pytest.approx(w["loss"], abs=bounds["loss"])
    # B starts at zero: the first step moves B only, and A's gradient is exactly zero at every layout
    assert all(float(t.abs().max()) == 0 for n, t in got["grads"][0].items() if n.endswith("lora_a"))
    assert all(float(t.abs().max()) > 0 for n, t in got["grads"][1].items())
    assert_grads_close(got["grads"], tp1["grads"], tol["grad"])
    for rank in got["ranks"]:  # every rank holds the whole, equal adapters
        assert sorted(rank["peft"]) == sorted(tp1["peft"])
        for name, tensor in rank["peft"].items():
            torch.testing.assert_close(tensor, tp1["peft"][name], rtol=0, atol=tol["adapter"])
    torch.testing.assert_close(got["logprobs_after"], tp1["logprobs_after"], rtol=0, atol=tol["lp"])
    torch.testing.assert_close(got["reference"], tp1["reference"], rtol=0, atol=tol["lp"])


@pytest.mark.parametrize("layout", S.CHECKPOINTED)
def test_a_checkpoint_of_another_layout_loads_the_same_adapters(layouts, hf_dir, layout):
    """The adapters' shards (fc1's B: gate and up rows of each TP rank) land where TP1 keeps them."""
    from rljob_worker.megatron.lora import peft_tensors

    actor = lora_actor(hf_dir, seed=11)
    assert actor.load_checkpoint(layouts[layout]["out"] / f"ckpt_{layout}")["step"] == 2
    loaded = dict(peft_tensors(actor.lora, actor.chunks, actor.hf_config))
    assert sorted(loaded) == sorted(layouts[layout]["peft"])
    for name, tensor in loaded.items():
        assert torch.equal(tensor, layouts[layout]["peft"][name]), name


def test_the_gradient_does_not_depend_on_the_micro_batch_size(hf_dir, tp1, tol):
    whole = S.lora_steps(lora_actor(hf_dir), micro_batch_sizes=(4, 4))
    assert_grads_close(whole["grads"], tp1["grads"], tol["grad"])


def test_training_moves_adapters_only_and_the_reference_is_the_base(hf_dir, tol):
    actor = lora_actor(hf_dir)
    base = {n: p.detach().clone() for n, p in actor.core.named_parameters() if ".lora." not in n}
    trained = [n for n, p in actor.core.named_parameters() if p.requires_grad]
    assert trained and all(".lora.lora_" in n for n in trained)
    ids, mask = H.varied_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    before = actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"]
    hf = H.hf_logprobs(H.load_hf_model(hf_dir), ids, mask)
    torch.testing.assert_close(before, hf, rtol=0, atol=tol["lp"])  # B = 0: the base model exactly
    for _ in range(3):
        actor.update(batch, H.seq_nll_loss, micro_batch_size=2)
    for name, p in actor.core.named_parameters():
        if ".lora." not in name:
            assert torch.equal(p, base[name]), f"{name} changed"
            assert p.grad is None, name
    # the optimizer holds the adapters alone: 2 tensors x 4 targets x 2 layers
    state = actor.optimizer.state_dict()["state"]
    assert len(state) == len(trained) == 16
    after = actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"]
    assert (after - before).abs().max() > 100 * tol["lp"]
    with actor.lora.disabled():
        assert torch.equal(actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"], before)
    snapshot = actor.lora.snapshot()
    norms = actor.lora.norms(snapshot, actor.tp_group, actor.pp_group)
    assert norms["lora/adapter_norm"] > 0 and norms["lora/update_norm"] == 0
    actor.update(batch, H.seq_nll_loss, micro_batch_size=2)
    assert actor.lora.norms(snapshot, actor.tp_group, actor.pp_group)["lora/update_norm"] > 0


def test_rollout_weights_are_merged_and_only_the_adapted_ones_travel(hf_dir, tol):
    actor = lora_actor(hf_dir)
    ids, mask = H.varied_batch()
    actor.update({"input_ids": ids, "attention_mask": mask}, H.seq_nll_loss, micro_batch_size=2)
    changed = dict(actor.export_hf_weights(only_changed=True))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert sorted(changed) == sorted(f"model.layers.{i}.{part}.{p}.weight" for i in range(2) for p in projections
                                     for part in (["self_attn"] if "proj" in p and p[0] in "qkvo" else ["mlp"]))
    everything = dict(actor.export_hf_weights())
    assert len(everything) > len(changed)
    for name, tensor in changed.items():
        assert torch.equal(tensor, everything[name])
    # the HF model with the merged weights computes the trainer's log-probs
    model = H.load_hf_model(hf_dir)
    model.load_state_dict({**model.state_dict(), **changed})
    want = actor.compute_logprobs({"input_ids": ids, "attention_mask": mask}, micro_batch_size=2)["logprobs"]
    torch.testing.assert_close(H.hf_logprobs(model, ids, mask), want, rtol=0, atol=tol["lp"])


def test_peft_loads_the_exported_adapter_onto_the_hf_base_with_the_trainers_logits(hf_dir, tmp_path):
    import peft  # a dev dependency (pyproject.toml): the check must run, never skip
    actor = lora_actor(hf_dir, rank=8, alpha=16.0)
    ids, mask = H.varied_batch()
    for _ in range(2):
        actor.update({"input_ids": ids, "attention_mask": mask}, H.seq_nll_loss, micro_batch_size=2)
    actor.save_peft_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["peft_type"] == "LORA"
    model = peft.PeftModel.from_pretrained(H.load_hf_model(hf_dir), tmp_path / "adapter").eval()
    want = actor.forward_logits(ids, mask)
    got = H.hf_logits(model, ids, mask)
    valid = mask.bool()
    bound = T.logit_bound(T.hf_config(hf_dir), ids.shape[1]) * got[valid].abs().max().item()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=bound)
    assert (got[valid] - H.hf_logits(H.load_hf_model(hf_dir), ids, mask)[valid]).abs().max() > 100 * bound


def test_checkpoints_hold_the_adapters_and_resume_exactly(hf_dir, tmp_path):
    ids, mask = H.varied_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    actor = lora_actor(hf_dir)
    for _ in range(2):
        actor.update(batch, H.seq_nll_loss, micro_batch_size=2)
    actor.save_checkpoint(tmp_path / "ckpt")
    from megatron.core import dist_checkpointing

    # the adapters and their two Adam moments, nothing of the base model
    saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt"))
    weights = {k: v for k, v in saved.items() if not k.startswith("optimizer.")}
    assert weights and all(k.startswith("lora.decoder.layers.") for k in weights), sorted(weights)
    adapters = sum(p.numel() for p in actor.lora.parameters())
    assert sum(v.global_shape.numel() if hasattr(v.global_shape, "numel") else torch.Size(v.global_shape).numel()
               for v in saved.values()) == 3 * adapters
    resumed = lora_actor(hf_dir, seed=11)  # other initial adapters: all of them must come from the checkpoint
    assert resumed.load_checkpoint(tmp_path / "ckpt")["step"] == 2
    for a, b in zip(actor.lora.parameters(), resumed.lora.parameters()):
        assert torch.equal(a, b)
    for _ in range(2):
        assert actor.update(batch, H.seq_nll_loss, micro_batch_size=2) == \
            resumed.update(batch, H.seq_nll_loss, micro_batch_size=2)
    assert torch.equal(actor.compute_logprobs(batch, 2)["logprobs"], resumed.compute_logprobs(batch, 2)["logprobs"])


def test_a_checkpoint_refuses_another_base_model_and_the_other_kind_of_job(hf_dir, tmp_path):
    actor = lora_actor(hf_dir)
    actor.save_checkpoint(tmp_path / "lora")
    other = H.make_tiny_hf_model("qwen2", tmp_path / "other_base", seed=5)  # same shapes, other weights
    with pytest.raises(MegatronConfigError, match="trained on base model .*spec.model.path"):
        lora_actor(other).load_checkpoint(tmp_path / "lora")
    with pytest.raises(MegatronConfigError, match="rank 4 .*spec.lora.rank"):
        lora_actor(hf_dir, rank=8).load_checkpoint(tmp_path / "lora")
    full = MegatronActor.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=LR), seed=1)
    with pytest.raises(MegatronConfigError, match="holds LoRA adapters"):
        full.load_checkpoint(tmp_path / "lora")
    full.save_checkpoint(tmp_path / "full")
    with pytest.raises(MegatronConfigError, match="holds full weights"):
        lora_actor(hf_dir).load_checkpoint(tmp_path / "full")


# --------------------------------------------------------------------------------------------------
# the trainer with spec.lora (separate processes: megatron's parallel state is process-global)


def lora_quickstart_spec() -> dict:
    import yaml

    return yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "lora-quickstart.yaml").read_text())["spec"]


def test_the_lora_quickstart_learns_and_exports_a_peft_adapter(tmp_path):
    from test_learning import rewards, run_trainer

    records = run_trainer(lora_quickstart_spec(), tmp_path, "--checkpoint-uri", f"file://{tmp_path}/ckpt")
    r = rewards(records)
    assert len(r) == 30
    assert r[0] < 0.3 and r[-5:].mean() > 0.7, r
    assert all(rec["lora/update_norm"] > 0 for rec in records)
    norms = [rec["lora/adapter_norm"] for rec in records]
    assert norms[-1] > norms[0] > 0
    assert all(rec["timing/ref_logprob_s"] > 0 for rec in records)  # klCoef > 0: the base as the reference
    adapter = next((tmp_path / "ckpt").rglob("hf/adapter_config.json")).parent
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}


def test_ppo_with_a_lora_critic_trains_its_value_head_in_full_and_resumes_it(tmp_path):
    """spec.critic.lora: the critic's transformer gets adapters, its new value head trains in full; both are
    in the critic's checkpoint, and a run resumed from it continues with the same value losses."""
    from megatron.core import dist_checkpointing
    from test_learning import read_metrics
    from test_ppo import ppo_spec
    from test_resume import finish, start

    spec = ppo_spec(lora={"rank": 4, "alpha": 8})
    spec["training"]["totalTrainingSteps"] = 4
    spec["checkpoint"].update(saveFreq=2, maxToKeep=0)
    code, out = finish(start(spec, tmp_path / "run", f"file://{tmp_path}/ckpt"))
    assert code == 0, out[-3000:]
    records = read_metrics(tmp_path / "run")
    assert all(r["critic/grad_norm"] > 0 for r in records)
    assert len({round(r["critic/vpred_mean"], 6) for r in records}) == len(records)  # its values move
    step2 = next((tmp_path / "ckpt").rglob("step_000002"))
    saved = dist_checkpointing.load_tensors_metadata(str(step2 / "critic"))
    weights = sorted(k for k in saved if not k.startswith("optimizer."))
    assert any(k.startswith("output_layer.") for k in weights), weights  # the value head, in full
    assert all(k.startswith(("lora.decoder.layers.", "output_layer.")) for k in weights), weights
    # resume the step-2 checkpoint in a fresh job: steps 3-4 repeat the straight run's value losses
    again = tmp_path / "again"
    spec["checkpoint"].update(resumeMode="uri", resumeFrom=f"file://{step2}")
    code, out = finish(start(spec, again, f"file://{tmp_path}/ckpt2"))
    assert code == 0, out[-3000:]
    resumed = {r["step"]: r["critic/value_loss"] for r in read_metrics(again)}
    assert sorted(resumed) == [3, 4]
    for r in records[2:]:
        assert resumed[r["step"]] == pytest.approx(r["critic/value_loss"], abs=1e-6), r["step"]


def test_sft_with_lora_lowers_the_loss_and_exports_a_peft_adapter(tmp_path):
    """spec.lora with algorithm sft (`rljob run`): the validation loss falls, the export is an adapter."""
    from test_sft import rljob_run, sft_doc

    steps = 8  # the loss is at its floor by step 8 (below)
    doc = sft_doc("sft-lora", **{"lora.rank": 8, "lora.alpha": 16, "training.lr": 5e-2, "lora.exportMerged": True,
                                 "training.totalTrainingSteps": steps, "training.testFreq": steps})
    records = rljob_run(doc, tmp_path)
    val = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert sorted(val) == [0, steps]
    # the frozen output scale of this random-init model bounds p(target) by 0.19 (bench/NOTES.md, issue 34):
    # a loss floor of -ln 0.19 = 1.66 nats per token, which LoRA reaches from the base's 2.0
    assert val[steps] < val[0] - 0.3, val
    assert all(r["lora/adapter_norm"] > 0 and r["lora/update_norm"] > 0 for r in records[1:])
    job = tmp_path / "ckpt" / "default" / "sft-lora"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (job / "hf").iterdir()}
    assert {"config.json", "model.safetensors"} <= {p.name for p in (job / "hf-merged").iterdir()}
