"""Prompt data: verl-format parquet (or a synthetic task), tokenised, with a resumable sampler.

A row holds `prompt` (a string or a chat message list, under data.promptKey),
`data_source`, `reward_model.ground_truth` and `extra_info`. Prompts longer than
data.maxPromptLength are filtered or truncated as configured and counted.
`EpochSampler` yields the same batches in the same order for a given seed, and its
(epoch, position) state is saved in checkpoints so a resumed run neither repeats nor
skips a batch.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rljob_api.enums import PromptOverflow
from rljob_api.models import DataSpec

log = logging.getLogger(__name__)


class DataError(ValueError):
    pass


@dataclass
class PromptRecord:
    prompt_text: str  # rendered prompt (chat template applied)
    prompt_ids: list[int]
    ground_truth: str
    data_source: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptDataset:
    records: list[PromptRecord]
    filtered: int = 0  # prompts dropped for length
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.records)


def read_parquet_rows(path: str, fetch: Callable[[str], str] | None = None,
                      setting: str = "spec.data.trainFiles") -> list[dict]:
    """Rows of a parquet file; `fetch` turns an s3:// URI into a local path (the storage module).

    Errors name `setting` (the spec field the path came from) and the file.
    """
    import pyarrow.parquet as pq

    local = path
    if path.startswith("s3://"):
        if fetch is None:
            raise DataError(f"{setting}: {path}: s3:// data needs object storage settings (spec.s3)")
        local = fetch(path)
    elif path.startswith("file://"):
        local = path[len("file://"):]
    if not Path(local).exists():
        raise DataError(f"{setting}: data file {path} does not exist")
    try:
        return pq.read_table(local).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise DataError(f"{setting}: data file {path} is not readable parquet: {exc}") from None


def render_prompt(raw: Any, tokenizer, apply_chat_template: bool) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in raw):
        messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in raw]
        if apply_chat_template and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages)
    raise DataError(f"prompt must be a string or a list of chat messages with 'content', got {type(raw).__name__}")


def build_dataset(rows: list[dict], spec: DataSpec, tokenizer, source: str) -> PromptDataset:
    """Tokenise rows and apply the length policy. Raises DataError naming the setting on bad data."""
    key = spec.prompt_key
    if not rows:
        raise DataError(f"{source}: the data has no rows")
    if key not in rows[0]:
        raise DataError(f"spec.data.promptKey {key!r} is not a column of {source}; columns: {sorted(rows[0])}")
    out = PromptDataset(records=[])
    for i, row in enumerate(rows):
        try:
            text = render_prompt(row[key], tokenizer, spec.apply_chat_template)
        except DataError as exc:
            raise DataError(f"{source} row {i}, column spec.data.promptKey={key!r}: {exc}") from None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > spec.max_prompt_length:
            policy = spec.prompt_overflow
            if policy == PromptOverflow.FILTER:
                out.filtered += 1
                continue
            if policy == PromptOverflow.ERROR:
                raise DataError(f"{source} row {i}: prompt has {len(ids)} tokens > spec.data.maxPromptLength="
                                f"{spec.max_prompt_length} (set data.promptOverflow to filter or truncate-*)")
            ids = ids[-spec.max_prompt_length:] if policy == PromptOverflow.TRUNCATE_LEFT else ids[: spec.max_prompt_length]
            text = tokenizer.decode(ids)
            out.truncated += 1
        reward_model = row.get("reward_model") or {}
        truth = reward_model.get("ground_truth", "") if isinstance(reward_model, dict) else ""
        out.records.append(PromptRecord(text, ids, str(truth), str(row.get("data_source", "")), dict(row.get("extra_info") or {})))
    if not out.records:
        raise DataError(f"{source}: no prompts left after filtering ({out.filtered} longer than "
                        f"spec.data.maxPromptLength={spec.max_prompt_length})")
    if out.filtered or out.truncated:
        log.warning("%s: %d prompts filtered, %d truncated for spec.data.maxPromptLength=%d",
                    source, out.filtered, out.truncated, spec.max_prompt_length)
    return out


def check_ground_truth(rows: list[dict], path: str, setting: str, reward: str | None) -> None:
    """A reward that scores against reward_model.ground_truth gets it in every row, or the run stops here
    naming the column and the file (it would otherwise train on reward 0 for every sample)."""
    from rljob_worker.rewards import NEEDS_GROUND_TRUTH

    for i, row in enumerate(rows):
        reward_model = row.get("reward_model")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        if truth is None:
            missing = ("column reward_model is missing" if "reward_model" not in row else
                       "column reward_model.ground_truth is missing or null")
            where = f"{setting} {path}: {missing} (row {i}; columns: {sorted(row)})"
            if reward in NEEDS_GROUND_TRUTH:
                raise DataError(f"{where}, and spec.reward.function {reward!r} scores against it; add it (verl "
                                "layout: reward_model: {ground_truth: ...}) or choose a reward that needs none")
            log.warning("%s: spec.reward.function %r gets '' as the ground truth of such rows", where, reward)
            return
    if reward in NEEDS_GROUND_TRUTH and rows and all(_blank(r["reward_model"]["ground_truth"]) for r in rows):
        # present in every row but empty in all of them: every sample would score 0 and the run "succeed"
        first = {k: v for k, v in rows[0].items() if k != "reward_model"}
        raise DataError(f"{setting} {path}: column reward_model.ground_truth is empty in all {len(rows)} rows "
                        f"(first: row 0, {str(first)[:160]}), and spec.reward.function {reward!r} scores against "
                        "it: fill it in, or choose a reward that needs none")


def _blank(value) -> bool:
    return str(value).strip() == ""


def load_datasets(spec: DataSpec, tokenizer, seed: int, fetch=None,
                  reward: str | None = None) -> tuple[PromptDataset, PromptDataset | None]:
    """(train, val) datasets from parquet files or the synthetic task. With `reward` (spec.reward.function),
    files must carry the ground truth a built-in reward scores against."""
    if spec.synthetic is not None:
        from rljob_worker.data.synthetic import generate_rows

        train_rows = generate_rows(spec.synthetic.task, spec.synthetic.num_prompts, seed)
        val_rows = generate_rows(spec.synthetic.task, spec.synthetic.num_val_prompts, seed + 10_000)
        train = build_dataset(train_rows, spec, tokenizer, f"synthetic/{spec.synthetic.task}")
        val = build_dataset(val_rows, spec, tokenizer, "synthetic-val") if val_rows else None
        return train, val
    train_rows = _read_files(spec.train_files, "trainFiles", fetch, reward)
    if not train_rows:
        raise DataError(f"spec.data.trainFiles {spec.train_files}: no rows")
    train = build_dataset(train_rows, spec, tokenizer, ",".join(spec.train_files))
    val = None
    if spec.val_files:
        val_rows = _read_files(spec.val_files, "valFiles", fetch, reward)
        if not val_rows:
            raise DataError(f"spec.data.valFiles {spec.val_files}: no rows (remove valFiles to train without "
                            "validation)")
        val = build_dataset(val_rows, spec, tokenizer, ",".join(spec.val_files))
    return train, val


def _read_files(files: list[str], key: str, fetch, reward) -> list[dict]:
    """The rows of spec.data.<key>, in order; with `reward`, each file's ground truth checked."""
    rows = []
    for i, f in enumerate(files):
        where = f"spec.data.{key}[{i}]"
        file_rows = read_parquet_rows(f, fetch, where)
        if reward is not None:
            check_ground_truth(file_rows, f, where, reward)
        rows += file_rows
    return rows


class EpochSampler:
    """Deterministic batches of indices: a seeded permutation per epoch, partial last batch dropped."""

    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > size:
            raise DataError(f"the training set has {size} prompts, fewer than one batch of {batch_size} "
                            "(spec.training.trainBatchSizePerNode x nnodes)")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next_batch(self) -> list[int]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        self.position += 1
        return self._order(self.epoch)[start : start + self.batch_size].tolist()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != self.size or state.get("batch_size") != self.batch_size:
            log.warning("resuming with a different dataset size or batch size (%s -> %d/%d): the order restarts "
                        "from the saved epoch", state, self.size, self.batch_size)
            self.epoch, self.position = int(state["epoch"]) + (1 if state.get("position") else 0), 0
            return
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
