"""SFT data: parquet rows (or a synthetic task) -> token sequences with per-token labels, and batches.

Formats (spec.sft.format):
- tokenized: columns `input_ids`, optional `attention_mask` (tokens where it is 0 are dropped) and
  optional `labels` (default: every token is a target).
- prompt-response: text columns data.promptKey (a string, or chat messages rendered with the chat
  template and its generation prompt, exactly as the GRPO data path renders prompts) and
  sft.responseKey; the response gets the tokenizer's EOS appended. Loss on the response.
- messages: a list of {role, content} under sft.messagesKey. With a chat template, the conversation
  is rendered turn by turn and each turn owns the text it adds; the tokens an assistant turn adds
  after the generation prompt are targets. Without one (or with data.applyChatTemplate false) the
  contents are concatenated and each assistant turn is followed by EOS, so a one-turn conversation
  equals the prompt-response row with the same texts.
- data.synthetic: the task's prompts with the response that earns the full reward: digit-sum `3+4=` ->
  `7`; target-token: the target character repeated data.maxResponseLength times.

Labels follow the Hugging Face convention, unshifted: ``labels[t] == input_ids[t]`` where token t is
a target (predicted from tokens < t) and ``IGNORE_INDEX`` (-100) where it is not. The first token is
never a target (nothing predicts it). Rows left with no target (e.g. a response cut off by
truncation) are dropped and counted.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from rljob_api.enums import PromptOverflow, SFTDataFormat
from rljob_api.models import RLJobSpec

from rljob_worker.data.prompts import DataError, read_parquet_rows, render_prompt

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass
class SFTExample:
    input_ids: list[int]
    labels: list[int]  # same length; IGNORE_INDEX where the token is not a target

    @property
    def num_targets(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


@dataclass
class SFTDataset:
    examples: list[SFTExample]
    filtered: int = 0  # longer than sft.maxLength (overflow: filter)
    truncated: int = 0
    no_targets: int = 0  # nothing left to learn from

    def __len__(self) -> int:
        return len(self.examples)


# --------------------------------------------------------------------------- one row -> one example


def _ids(tokenizer, text: str) -> list[int]:
    # No special tokens: the chat template (or the prompt itself) carries them, as in the GRPO data path.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _example(pieces: Sequence[tuple[list[int], bool]]) -> SFTExample:
    """Concatenate (token ids, is_target) pieces; the first token is never a target."""
    ids, labels = [], []
    for piece, target in pieces:
        ids.extend(piece)
        labels.extend(piece if target else [IGNORE_INDEX] * len(piece))
    if labels:
        labels[0] = IGNORE_INDEX
    return SFTExample(ids, labels)


def prompt_response_example(prompt_text: str, response: str, tokenizer, loss_on_prompt: bool) -> SFTExample:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return _example([(_ids(tokenizer, prompt_text), loss_on_prompt), (_ids(tokenizer, response) + eos, True)])


def messages_example(messages: list[dict], tokenizer, loss_on_prompt: bool, apply_chat_template: bool) -> SFTExample:
    """Multi-turn: each turn's own tokens; targets are assistant turns (and all turns with loss_on_prompt)."""
    messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in messages]
    pieces: list[tuple[list[int], bool]] = []
    if not (apply_chat_template and getattr(tokenizer, "chat_template", None)):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        for m in messages:
            assistant = m["role"] == "assistant"
            pieces.append((_ids(tokenizer, m["content"]) + (eos if assistant else []), assistant or loss_on_prompt))
        return _example(pieces)

    def render(turns: list[dict], generation_prompt: bool = False) -> str:
        if not turns:
            return ""
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    done = ""  # text rendered so far; each turn must only append to it
    for i, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        if assistant and i > 0:
            header = render(messages[:i], generation_prompt=True)  # e.g. "<|im_start|>assistant\n"
            _check_prefix(done, header, i)
            pieces.append((_ids(tokenizer, header[len(done):]), loss_on_prompt))
            done = header
        text = render(messages[: i + 1])
        _check_prefix(done, text, i)
        pieces.append((_ids(tokenizer, text[len(done):]), assistant or loss_on_prompt))
        done = text
    return _example(pieces)


def _check_prefix(before: str, after: str, turn: int) -> None:
    if not after.startswith(before):
        raise DataError(f"the chat template rewrites earlier turns when turn {turn} is added (e.g. it drops "
                        "reasoning from past assistant turns), so per-turn loss masks are undefined; "
                        "pre-tokenise the data and use sft.format: tokenized")


def tokenized_example(row: dict) -> SFTExample:
    ids = row.get("input_ids")
    if not isinstance(ids, (list, tuple)) or not all(isinstance(x, int) for x in ids):
        raise DataError("input_ids must be a list of integers")
    mask = row.get("attention_mask")
    labels = row.get("labels")
    mask = [1] * len(ids) if mask is None else list(mask)
    labels = list(ids) if labels is None else list(labels)
    if len(mask) != len(ids) or len(labels) != len(ids):
        raise DataError(f"input_ids ({len(ids)}), attention_mask ({len(mask)}) and labels ({len(labels)}) "
                        "must have the same length")
    kept = [(tok, lab) for tok, m, lab in zip(ids, mask, labels) if m]
    for t, (tok, lab) in enumerate(kept):
        if lab != IGNORE_INDEX and lab != tok:
            raise DataError(f"labels[{t}]={lab} is neither input_ids[{t}]={tok} nor -100: labels are unshifted "
                            "(Hugging Face convention), a copy of input_ids with -100 where no loss is taken")
    out = SFTExample([tok for tok, _ in kept], [lab for _, lab in kept])
    if out.labels:
        out.labels[0] = IGNORE_INDEX
    return out


def _fit_length(ex: SFTExample, max_length: int, policy: PromptOverflow) -> SFTExample | None:
    """Apply sft.overflow; None means filtered."""
    if len(ex.input_ids) <= max_length:
        return ex
    if policy == PromptOverflow.FILTER:
        return None
    if policy == PromptOverflow.ERROR:
        raise DataError(f"a sequence has {len(ex.input_ids)} tokens > spec.sft.maxLength={max_length} "
                        "(set sft.overflow to filter or truncate-*)")
    keep = slice(-max_length, None) if policy == PromptOverflow.TRUNCATE_LEFT else slice(0, max_length)
    out = SFTExample(ex.input_ids[keep], ex.labels[keep])
    out.labels[0] = IGNORE_INDEX
    return out


# --------------------------------------------------------------------------- rows -> dataset


def build_sft_dataset(rows: list[dict], spec: RLJobSpec, tokenizer, source: str) -> SFTDataset:
    """Tokenise rows in the spec's format and apply the length policy. DataError names the setting."""
    s, d = spec.sft, spec.data
    if not rows:
        raise DataError(f"{source}: the data has no rows")
    fmt = s.format
    needed = {SFTDataFormat.TOKENIZED: [("input_ids", "the tokenized format")],
              SFTDataFormat.PROMPT_RESPONSE: [(d.prompt_key, "spec.data.promptKey"), (s.response_key, "spec.sft.responseKey")],
              SFTDataFormat.MESSAGES: [(s.messages_key, "spec.sft.messagesKey")]}[fmt]
    for column, setting in needed:
        if column not in rows[0]:
            raise DataError(f"{setting} {column!r} is not a column of {source} (sft.format {fmt.value}); "
                            f"columns: {sorted(rows[0])}")
    out = SFTDataset(examples=[])
    for i, row in enumerate(rows):
        try:
            if fmt == SFTDataFormat.TOKENIZED:
                ex = tokenized_example(row)
            elif fmt == SFTDataFormat.PROMPT_RESPONSE:
                response = row[s.response_key]
                if not isinstance(response, str):
                    raise DataError(f"column {s.response_key!r} must be a string, got {type(response).__name__}")
                prompt = render_prompt(row[d.prompt_key], tokenizer, d.apply_chat_template)
                ex = prompt_response_example(prompt, response, tokenizer, s.loss_on_prompt_tokens)
            else:
                messages = row[s.messages_key]
                if not isinstance(messages, (list, tuple)) or not all(
                        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                    raise DataError(f"column {s.messages_key!r} must be a list of {{role, content}} messages")
                ex = messages_example(list(messages), tokenizer, s.loss_on_prompt_tokens, d.apply_chat_template)
        except DataError as exc:
            raise DataError(f"{source} row {i}: {exc}") from None
        fitted = _fit_length(ex, s.max_length, s.overflow)
        if fitted is None:
            out.filtered += 1
            continue
        out.truncated += fitted is not ex
        if fitted.num_targets == 0:
            out.no_targets += 1
            continue
        out.examples.append(fitted)
    if not out.examples:
        raise DataError(f"{source}: no sequences left ({out.filtered} longer than spec.sft.maxLength={s.max_length}, "
                        f"{out.no_targets} without target tokens)")
    if out.filtered or out.truncated or out.no_targets:
        log.warning("%s: %d sequences filtered and %d truncated for spec.sft.maxLength=%d; %d dropped without "
                    "target tokens", source, out.filtered, out.truncated, s.max_length, out.no_targets)
    return out


def synthetic_sft_rows(task: str, num: int, seed: int, response_length: int) -> list[dict]:
    """The synthetic task's rows with a `response` column earning the full reward (see the module doc)."""
    from rljob_worker.data.synthetic import TARGET_CHAR, generate_rows

    def response(row: dict) -> str:
        return TARGET_CHAR * response_length if task == "target-token" else row["reward_model"]["ground_truth"]

    return [{**row, "response": response(row)} for row in generate_rows(task, num, seed)]


def load_sft_datasets(spec: RLJobSpec, tokenizer, seed: int,
                      fetch: Callable[[str], str] | None = None) -> tuple[SFTDataset, SFTDataset | None]:
    """(train, val) from data.trainFiles/valFiles or data.synthetic (val: None when there is none)."""
    d = spec.data
    if d.synthetic is not None:
        if spec.sft.format != SFTDataFormat.PROMPT_RESPONSE or spec.sft.response_key != "response":
            raise DataError("data.synthetic writes prompt-response rows with the response under 'response'")
        task, length = d.synthetic.task, d.max_response_length
        train = build_sft_dataset(synthetic_sft_rows(task, d.synthetic.num_prompts, seed, length), spec, tokenizer,
                                  f"synthetic/{task}")
        val_rows = synthetic_sft_rows(task, d.synthetic.num_val_prompts, seed + 10_000, length)
        val = build_sft_dataset(val_rows, spec, tokenizer, "synthetic-val") if val_rows else None
        return train, val
    train_rows = [r for i, f in enumerate(d.train_files) for r in read_parquet_rows(f, fetch, f"spec.data.trainFiles[{i}]")]
    if not train_rows:
        raise DataError(f"spec.data.trainFiles {d.train_files}: no rows")
    train = build_sft_dataset(train_rows, spec, tokenizer, ",".join(d.train_files))
    val = None
    if d.val_files:
        val_rows = [r for i, f in enumerate(d.val_files) for r in read_parquet_rows(f, fetch, f"spec.data.valFiles[{i}]")]
        if not val_rows:
            raise DataError(f"spec.data.valFiles {d.val_files}: no rows (remove valFiles to train without validation)")
        val = build_sft_dataset(val_rows, spec, tokenizer, ",".join(d.val_files))
    return train, val


# --------------------------------------------------------------------------- batches


def collate(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels, each (B, T) long, T = the longest example."""
    t = max(len(ex.input_ids) for ex in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), t), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.long)
    for i, ex in enumerate(examples):
        n = len(ex.input_ids)
        ids[i, :n] = torch.tensor(ex.input_ids, dtype=torch.long)
        labels[i, :n] = torch.tensor(ex.labels, dtype=torch.long)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
