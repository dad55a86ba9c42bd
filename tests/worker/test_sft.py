"""SFT (algorithm: sft) on CPU.

Pure parts in process: the masked loss ignores -100 labels, the lr schedule, the data formats and the
SFT validation rules. Through the megatron actor: a batch's loss and gradient are the same packed
(tight) and padded (extra padding columns, another micro-batch grouping). Real runs through `rljob
run`, each its own process tree: the tiny model learns the synthetic target-token task (validation
loss falls below half its start), TP2 trains the same trajectory as TP1 and resumes mid-run onto it,
and the HF export warm-starts a GRPO quickstart run.
"""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from rljob_api.enums import LRSchedule, PromptOverflow, SFTDataFormat
from rljob_api.validation import RLJobValidationError, parse_rljob
from rljob_worker.data.prompts import DataError
from rljob_worker.data.sft_samples import (
    IGNORE_INDEX,
    SFTExample,
    build_sft_dataset,
    collate,
    load_sft_datasets,
    messages_example,
    prompt_response_example,
)
from rljob_worker.trainers.sft import _loss_fn, lr_at, sft_loss

REPO = Path(__file__).resolve().parents[2]
STEPS = 24


def sft_doc(name: str = "sft", **changes) -> dict:
    """A CPU SFT job on the builtin tiny model: learn the target-token task's full-reward response."""
    doc = {
        "apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
        "spec": {
            "device": "cpu", "nnodes": 1, "gpusPerNode": 1,
            "model": {"path": "builtin://tiny-qwen2", "dtype": "float32"},
            "algorithm": {"name": "sft"},
            "sft": {"format": "prompt-response", "maxLength": 32, "lrSchedule": "cosine"},
            "data": {"synthetic": {"task": "target-token", "numPrompts": 64, "numValPrompts": 16},
                     "maxResponseLength": 16},
            "training": {"trainBatchSizePerNode": 8, "microBatchSizePerGpu": 4, "lr": 5.0e-3, "lrWarmupSteps": 2,
                         "weightDecay": 0.0, "totalTrainingSteps": STEPS, "testFreq": 8, "valBeforeTrain": True},
            "megatron": {"useDistributedOptimizer": False},
            "checkpoint": {"saveFreq": -1, "exportHf": True},
            "metrics": {"enabled": False},
        },
    }
    for path, value in changes.items():
        section, _, field = path.rpartition(".")
        target = doc["spec"]
        for part in filter(None, section.split(".")):
            target = target.setdefault(part, {})
        target[field] = value
    return doc


def tokenizer():
    from rljob_worker.data.builtin_models import build_char_tokenizer

    return build_char_tokenizer()


# --------------------------------------------------------------------------- the loss


def test_ignored_labels_contribute_nothing():
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 7, generator=g) * 3
    labels = torch.randint(2, 16, (3, 7), generator=g)
    ignored = torch.rand(3, 7, generator=g) < 0.4
    ignored[:, 0] = True
    labels[ignored] = IGNORE_INDEX

    base, info = sft_loss(logprobs, labels, 5.0)
    assert info["target_tokens"] == float((~ignored).sum())
    assert base == pytest.approx(float(-logprobs[~ignored].sum() / 5.0))
    # Changing what an ignored position predicts (its target's log-prob, even to -inf or NaN) changes nothing.
    for poison in (0.0, -50.0, float("-inf"), float("nan")):
        changed = logprobs.clone()
        changed[ignored] = poison
        assert torch.equal(sft_loss(changed, labels, 5.0)[0], base)
    # ... and neither gradient flows there nor does a NaN leak in through it.
    leaf = logprobs.clone().requires_grad_(True)
    sft_loss(torch.where(ignored, torch.full_like(leaf, float("nan")), leaf), labels, 5.0)[0].backward()
    assert torch.all(leaf.grad[ignored] == 0) and torch.all(leaf.grad[~ignored] == -1 / 5.0)
    # Labelling a position -100 is the same as removing it from the batch's targets.
    labels2 = labels.clone()
    labels2[1, 5] = IGNORE_INDEX
    was_target = labels[1, 5] != IGNORE_INDEX
    expected = base * 5.0 + (float(logprobs[1, 5]) if was_target else 0.0)
    assert float(sft_loss(logprobs, labels2, 5.0)[0]) * 5.0 == pytest.approx(float(expected))


def test_lr_schedule():
    peak, planned, warm = 1e-3, 20, 4
    cos = [lr_at(s, planned, peak, warm, LRSchedule.COSINE, 0.1) for s in range(1, planned + 3)]
    assert cos[:4] == pytest.approx([peak / 4, peak / 2, 3 * peak / 4, peak])  # linear warm-up
    assert cos[4] == pytest.approx(peak)  # the first step after warm-up runs at the peak
    assert all(a > b for a, b in itertools.pairwise(cos[4:planned]))  # then decays
    assert peak * 0.1 < cos[planned - 1] < peak * 0.12  # just above the floor at the last planned step
    assert cos[planned:] == pytest.approx([peak * 0.1] * 2)  # steps past the plan stay at the floor
    const = [lr_at(s, planned, peak, warm, LRSchedule.CONSTANT) for s in range(1, planned + 1)]
    assert const[3:] == [peak] * (planned - 3)
    assert lr_at(1, planned, peak, 0, LRSchedule.COSINE) == peak


# --------------------------------------------------------------------------- data


def test_prompt_response_trains_on_response_and_eos():
    tok = tokenizer()
    ex = prompt_response_example("12+3=", "5", tok, loss_on_prompt=False)
    assert tok.convert_ids_to_tokens(ex.input_ids) == list("12+3=") + ["5", "<eos>"]
    assert ex.labels == [IGNORE_INDEX] * 5 + ex.input_ids[5:]
    every = prompt_response_example("12+3=", "5", tok, loss_on_prompt=True)
    assert every.labels == [IGNORE_INDEX] + every.input_ids[1:]  # nothing predicts the first token


def test_messages_mask_assistant_turns():
    tok = tokenizer()
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "4+4="}, {"role": "assistant", "content": "8"}]
    # Without a chat template: contents concatenated, EOS after each assistant turn; one turn == prompt-response.
    plain = messages_example(chat, tok, False, apply_chat_template=True)
    assert tok.decode(plain.input_ids) == "1+2=3<eos>4+4=8<eos>"
    targets = [t for t, lab in zip(tok.convert_ids_to_tokens(plain.input_ids), plain.labels) if lab != IGNORE_INDEX]
    assert targets == ["3", "<eos>", "8", "<eos>"]
    assert messages_example(chat[:2], tok, False, True) == prompt_response_example("1+2=", "3", tok, False)
    # With a chat template: each turn owns the text it adds; the generation prompt (" ") is not a target.
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
                         "{% else %}#{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %} {% endif %}")
    templated = messages_example(chat, tok, False, apply_chat_template=True)
    tokens = tok.convert_ids_to_tokens(templated.input_ids)
    assert "".join(tokens) == "#1+2= 3<eos>#4+4= 8<eos>"
    assert [t for t, lab in zip(tokens, templated.labels) if lab != IGNORE_INDEX] == ["3", "<eos>", "8", "<eos>"]
    with_prompt = messages_example(chat, tok, True, apply_chat_template=True)
    assert with_prompt.labels == [IGNORE_INDEX] + with_prompt.input_ids[1:]
    # A template that rewrites earlier turns (e.g. drops past reasoning) cannot give per-turn masks.
    tok.chat_template = "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(DataError, match="tokenized"):
        messages_example(chat, tok, False, apply_chat_template=True)


def _spec(**changes):
    return parse_rljob(sft_doc(**changes)).spec


def test_tokenized_rows_and_length_policy():
    tok = tokenizer()
    spec = _spec(**{"sft.format": "tokenized", "sft.maxLength": 5, "data.synthetic": None,
                    "data.trainFiles": ["/t.parquet"]})
    rows = [
        {"input_ids": [0, 0, 3, 4, 5, 6], "attention_mask": [0, 0, 1, 1, 1, 1], "labels": [-100, -100, 3, -100, 5, 6]},
        {"input_ids": [3, 4, 5]},  # no labels: every token (but the first) is a target
        {"input_ids": [3, 4, 5, 6, 7, 8, 9], "labels": [-100] * 6 + [9]},  # too long: filtered
        {"input_ids": [3, 4], "labels": [-100, -100]},  # nothing to learn: dropped
    ]
    ds = build_sft_dataset(rows, spec, tok, "t")
    assert ds.examples == [SFTExample([3, 4, 5, 6], [IGNORE_INDEX, IGNORE_INDEX, 5, 6]),
                           SFTExample([3, 4, 5], [IGNORE_INDEX, 4, 5])]
    assert (ds.filtered, ds.no_targets) == (1, 1)
    spec.sft.overflow = PromptOverflow.TRUNCATE_LEFT
    assert build_sft_dataset(rows[2:3], spec, tok, "t").examples == [SFTExample([5, 6, 7, 8, 9], [-100] * 4 + [9])]
    spec.sft.overflow = PromptOverflow.ERROR
    with pytest.raises(DataError, match="maxLength=5"):
        build_sft_dataset(rows[2:3], spec, tok, "t")
    with pytest.raises(DataError, match=r"row 0: labels\[1\]=7 is neither input_ids\[1\]=4 nor -100"):
        build_sft_dataset([{"input_ids": [3, 4], "labels": [3, 7]}], spec, tok, "t")
    spec.sft.format = SFTDataFormat.PROMPT_RESPONSE
    with pytest.raises(DataError, match="spec.sft.responseKey 'response' is not a column"):
        build_sft_dataset([{"prompt": "1", "answer": "2"}], spec, tok, "t")


@pytest.mark.parametrize("field", ["trainFiles", "valFiles"])
def test_an_empty_file_names_its_field(tmp_path, field):
    full, empty = tmp_path / "full.parquet", tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="], "response": ["2"]}), full)
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "response": pa.array([], pa.string())}), empty)
    files = {"data.trainFiles": [str(empty if field == "trainFiles" else full)],
             "data.valFiles": [str(empty)] if field == "valFiles" else []}
    with pytest.raises(DataError, match=rf"^spec\.data\.{field} \[.*empty\.parquet'\]: no rows"):
        load_sft_datasets(_spec(**{"data.synthetic": None, **files}), tokenizer(), seed=1)


def test_synthetic_data_and_collate():
    tok = tokenizer()
    train, val = load_sft_datasets(_spec(), tok, seed=1)
    assert (len(train), len(val)) == (64, 16)
    ex = train.examples[0]
    text = tok.decode(ex.input_ids)
    assert text.endswith("=" + "7" * 16 + "<eos>")
    assert ex.num_targets == 17  # the 16 target characters and EOS
    digits, _ = load_sft_datasets(_spec(**{"data.synthetic.task": "digit-sum"}), tok, seed=1)
    a, b = map(int, tok.decode(digits.examples[0].input_ids[:3]).split("+"))
    assert tok.decode(digits.examples[0].input_ids[4:]) == f"{(a + b) % 10}<eos>"
    batch = collate([train.examples[0], digits.examples[0]], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(ex.input_ids))
    assert batch["attention_mask"][1].sum() == 6 and torch.all(batch["labels"][1, 6:] == IGNORE_INDEX)


# --------------------------------------------------------------------------- validation rules


@pytest.mark.parametrize("changes, path, words", [
    ({"sft": None}, "spec.sft", "algorithm.name sft needs spec.sft"),
    ({"algorithm.name": "grpo"}, "spec.sft", "only used by algorithm.name sft"),
    ({"training.trainBatchSizePerNode": 6}, "spec.training.microBatchSizePerGpu", "pick a divisor of 6"),
    ({"gpusPerNode": 4, "training.trainBatchSizePerNode": 6, "training.microBatchSizePerGpu": 1},
     "spec.training.trainBatchSizePerNode", "6 sequences (x nnodes=1) must divide evenly over 4"),
    ({"sft.format": "messages"}, "spec.sft.format", "data.synthetic generates prompt-response rows"),
    ({"training.maxTokensPerMicroBatch": 65536}, "spec.training.maxTokensPerMicroBatch", "GRPO actor update only"),
])
def test_sft_rules_reject(changes, path, words):
    doc = sft_doc(**{k: v for k, v in changes.items() if k != "sft"})
    if "sft" in changes:
        del doc["spec"]["sft"]
    with pytest.raises(RLJobValidationError) as exc:
        parse_rljob(doc)
    assert any(e.path == path and words in e.message for e in exc.value.errors), exc.value.errors


def test_grpo_only_rules_do_not_apply_to_sft():
    # mini-batch, samplesPerPrompt and valN rules are GRPO's: an SFT job may leave them anywhere
    parse_rljob(sft_doc(**{"training.ppoMiniBatchSizePerNode": 64, "rollout.samplesPerPrompt": 3,
                           "rollout.valN": 4, "algorithm.klPlacement": "reward"}))


def test_llama_sft_example_translates_the_seed_config():
    job = parse_rljob(yaml.safe_load((REPO / "examples" / "llama-sft-megatron.yaml").read_text()))
    s = job.spec
    assert s.algorithm.name == "sft" and s.sft.format == SFTDataFormat.TOKENIZED
    m = s.megatron
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size) == (4, 2, 2)
    assert (s.training.micro_batch_size_per_gpu, s.training.train_batch_size_per_node * s.nnodes) == (4, 64)
    assert s.sft.max_length == 2048


# --------------------------------------------------------------------------- packed == padded (the actor)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU (gloo) path")
    from rljob_worker.data.builtin_models import materialize_builtin

    return materialize_builtin("tiny-qwen2", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def actor(model_dir):
    from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

    # lr 0: update() computes loss and gradient norm, and the weights stay as they are.
    return MegatronActor.from_hf(model_dir, ParallelConfig(), OptimConfig(lr=0.0), seed=1)


def _update(actor, examples, micro, pad_left=0, pad_right=0):
    batch = collate(examples, pad_id=0)
    batch = {k: torch.nn.functional.pad(v, (pad_left, pad_right), value=IGNORE_INDEX if k == "labels" else 0)
             for k, v in batch.items()}
    targets = sum(ex.num_targets for ex in examples)
    batch["normaliser"] = targets / (len(examples) // micro)
    return actor.update(batch, _loss_fn, micro_batch_size=micro)


def _split_bounds(model_dir, examples, extra_cols: int) -> tuple[float, float]:
    """Padding columns and another micro-batch grouping change only the order of the sums (attention
    over more masked keys, the target-token sum over other micro-batches): the loss (a mean over the
    targets of -log p, each term within logprob_bound and at most |z| + log V) within mean_bound, the
    grad norm within grad_bound (relative). A normaliser off by the micro-batch count is a factor 2-3."""
    sys.path.insert(0, str(Path(__file__).parent))
    import megatron_helpers as H
    import tolerances as T

    batch, n = collate(examples, pad_id=0), sum(ex.num_targets for ex in examples)
    config, seq = T.hf_config(model_dir), batch["input_ids"].shape[1] + extra_cols
    z = H.max_abs_logit(model_dir, batch["input_ids"], batch["attention_mask"])
    lp = T.logprob_bound(config, z, seq_len=seq)
    return T.mean_bound(lp, n, z + math.log(config["vocab_size"])), T.grad_bound(config, n, z, seq_len=seq)


def test_packed_equals_padded(actor, model_dir):
    tok = tokenizer()
    train, _ = load_sft_datasets(_spec(**{"data.synthetic.task": "digit-sum", "sft.lossOnPromptTokens": True}),
                                 tok, seed=2)
    examples = [*train.examples[:3], *load_sft_datasets(_spec(), tok, seed=2)[0].examples[:3]]  # 6 and 20+ tokens
    tight = _update(actor, examples, micro=2)
    padded = _update(actor, examples, micro=2, pad_left=3, pad_right=9)
    regrouped = _update(actor, sorted(examples, key=lambda e: len(e.input_ids)), micro=3, pad_right=4)
    assert tight["loss"] > 0.5
    loss_tol, grad_tol = _split_bounds(model_dir, examples, extra_cols=3 + 9)
    for other in (padded, regrouped):
        assert other["loss"] == pytest.approx(tight["loss"], abs=loss_tol)
        assert other["grad_norm"] == pytest.approx(tight["grad_norm"], rel=grad_tol)
    # Causal: tokens after the last target of every row are context for nothing.
    cut = [SFTExample(ex.input_ids + [5, 6, 7], ex.labels + [IGNORE_INDEX] * 3) for ex in examples]
    assert _update(actor, cut, micro=2)["loss"] == pytest.approx(tight["loss"], abs=loss_tol)


# --------------------------------------------------------------------------- real runs (`rljob run`)


def rljob_run(doc: dict, root: Path, *args: str) -> list[dict]:
    """Run the job like a user (`rljob run`), checkpoints under root/ckpt; the metrics, last record per step."""
    path = root / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    work = root / doc["metadata"]["name"]
    proc = subprocess.run([sys.executable, "-m", "rljob_cli.main", "run", str(path), "--workdir", str(work),
                           "--checkpoint-uri", f"file://{root}/ckpt", *args], capture_output=True, text=True,
                          timeout=300, check=False)
    logs = "".join(p.read_text() for p in work.glob("pod-*.log"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs[-2000:]}"
    by_step = {}
    for line in (work / "work" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = {**by_step.get(record["step"], {}), **record}
    return [by_step[s] for s in sorted(by_step)]


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-tp1")
    return rljob_run(sft_doc("sft"), root), root


def test_sft_learns_and_exports(tp1_run):
    records, root = tp1_run
    assert [r["step"] for r in records] == list(range(STEPS + 1))  # step 0: validation before training
    val = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert sorted(val) == [0, 8, 16, 24]
    print(f"SFT validation loss: {val}")
    assert val[24] < 0.5 * val[0], val
    train = [r["actor/loss"] for r in records[1:]]
    assert sum(train[-4:]) < 0.5 * sum(train[:4])
    assert all(r["actor/grad_norm"] > 0 for r in records[1:])
    assert [r["actor/lr"] for r in records[1:]] == pytest.approx(
        [lr_at(s, STEPS, 5e-3, 2, LRSchedule.COSINE) for s in range(1, STEPS + 1)])
    assert all(r["data/target_tokens"] == 8 * 17 for r in records[1:])  # global batch 8 x (16 chars + EOS)
    hf = root / "ckpt" / "default" / "sft" / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf.iterdir()}


def test_tp2_matches_tp1_and_resumes_onto_it(tp1_run, tmp_path):
    """TP2 (two processes in one pod) stopped at step 12 (`--steps 12`) and resumed by a second run
    follows the TP1 trajectory: per-step loss, gradient norm and validation loss."""
    ref, _ = tp1_run
    doc = sft_doc("sft-tp2", gpusPerNode=2, **{"megatron.tensorModelParallelSize": 2,
                                                "checkpoint.exportHf": False})
    rljob_run(doc, tmp_path, "--steps", "12")
    assert (tmp_path / "ckpt" / "default" / "sft-tp2" / "step_000012" / "COMMIT").exists()
    got = rljob_run(doc, tmp_path)  # resumes from step 12 (same workdir: metrics.jsonl continues)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref[1:], got[1:]):
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-4), (a["step"], a, b)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-3), a["step"]
        assert b["actor/lr"] == pytest.approx(a["actor/lr"], rel=1e-9)
    for step in (0, 8, 16, 24):
        assert got[step]["val/loss"] == pytest.approx(ref[step]["val/loss"], rel=1e-4)


def test_pp2_matches_tp1_resumes_and_exports(tp1_run, tmp_path):
    """PP2 (two pipeline stages in one pod, tied embeddings split across them) stopped at step 12 and
    resumed follows the TP1 trajectory, and its HF export equals TP1's (every tensor from its stage)."""
    ref, ref_root = tp1_run
    doc = sft_doc("sft-pp2", gpusPerNode=2, **{"megatron.pipelineModelParallelSize": 2})
    rljob_run(doc, tmp_path, "--steps", "12")
    got = rljob_run(doc, tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref[1:], got[1:]):
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-4), (a["step"], a, b)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-3), a["step"]
    for step in (0, 8, 16, 24):
        assert got[step]["val/loss"] == pytest.approx(ref[step]["val/loss"], rel=1e-4)
    from safetensors.torch import load_file

    want = load_file(ref_root / "ckpt" / "default" / "sft" / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "ckpt" / "default" / "sft-pp2" / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-4)


def test_sft_export_warm_starts_grpo(tp1_run, tmp_path):
    """The exported HF folder is the model.path of a GRPO quickstart run: it loads, trains 3 steps, and the
    policy already earns most of the reward (a fresh tiny model earns ~0.1; see test_learning)."""
    _, root = tp1_run
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = "grpo-after-sft"
    doc["spec"]["model"]["path"] = f"file://{root}/ckpt/default/sft/hf"
    doc["spec"]["training"].update(valBeforeTrain=False)
    doc["spec"]["checkpoint"].update(exportHf=False, saveFreq=-1)
    doc["spec"]["metrics"] = {"enabled": False}
    records = rljob_run(doc, tmp_path, "--steps", "3")
    rewards = [r["reward/mean"] for r in records]
    assert len(rewards) == 3
    assert sum(rewards) / 3 > 0.5, rewards
