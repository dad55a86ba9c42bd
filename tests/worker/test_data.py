"""Prompt data: verl-format parquet -> tokenised PromptDataset, the length policy, EpochSampler,
and the gsm8k / synthetic preprocessing scripts. Parquet files are written here with pyarrow."""
from __future__ import annotations

import json
import string
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rljob_api.enums import PromptOverflow
from rljob_api.models import DataSpec
from rljob_worker.data.prompts import DataError, EpochSampler, build_dataset, load_datasets, read_parquet_rows
from rljob_worker.preprocess import gsm8k as gsm8k_pre
from rljob_worker.preprocess import synthetic as synthetic_pre
from rljob_worker.rewards import resolve_reward

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer(chat_template: str | None = None):
    """One token per printable ASCII character (ids 2..), so token counts are string lengths."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def verl_row(prompt, truth="1", index=0, key="prompt") -> dict:
    return {key: prompt, "data_source": "test", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": index}}


def write(tmp_path, rows, name="data.parquet") -> str:
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def spec(path=None, **kw) -> DataSpec:
    return DataSpec(train_files=[path] if path else [], **{"max_prompt_length": 64, **kw})


# ---------------------------------------------------------------- parquet -> dataset


def test_string_prompts_from_parquet(tmp_path):
    path = write(tmp_path, [verl_row("1+2=", "3", 0), verl_row("hello", "x", 1)])
    train, val = load_datasets(spec(path), char_tokenizer(), seed=0)
    assert val is None
    assert [r.prompt_text for r in train.records] == ["1+2=", "hello"]
    tok = char_tokenizer()
    assert train.records[0].prompt_ids == tok("1+2=", add_special_tokens=False)["input_ids"]
    assert len(train.records[1].prompt_ids) == 5
    assert [r.ground_truth for r in train.records] == ["3", "x"]
    assert train.records[1].data_source == "test" and train.records[1].extra == {"index": 1}
    assert train.filtered == 0 and train.truncated == 0


def test_chat_prompts_use_the_tokenizers_chat_template(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write(tmp_path, [verl_row(messages, "4")])
    train, _ = load_datasets(spec(path), char_tokenizer(CHAT_TEMPLATE), seed=0)
    assert train.records[0].prompt_text == "<system>Be brief.\n<user>2+2?\n<assistant>"
    assert len(train.records[0].prompt_ids) == len(train.records[0].prompt_text)
    # without a template (or with the setting off) the contents are joined by newlines
    plain, _ = load_datasets(spec(path), char_tokenizer(), seed=0)
    assert plain.records[0].prompt_text == "Be brief.\n2+2?"
    off, _ = load_datasets(spec(path, apply_chat_template=False), char_tokenizer(CHAT_TEMPLATE), seed=0)
    assert off.records[0].prompt_text == "Be brief.\n2+2?"


def test_custom_prompt_key_and_val_files(tmp_path):
    train_path = write(tmp_path, [verl_row("abc", key="question")], "train.parquet")
    val_path = write(tmp_path, [verl_row("de", key="question"), verl_row("f", key="question")], "val.parquet")
    data = DataSpec(train_files=[f"file://{train_path}"], val_files=[val_path], prompt_key="question")
    train, val = load_datasets(data, char_tokenizer(), seed=0)
    assert [r.prompt_text for r in train.records] == ["abc"]
    assert [r.prompt_text for r in val.records] == ["de", "f"]


def test_missing_prompt_key_names_the_setting(tmp_path):
    path = write(tmp_path, [verl_row("abc")])
    with pytest.raises(DataError, match=r"spec\.data\.promptKey 'question'.*columns: \['data_source', 'extra_info', 'prompt'"):
        load_datasets(spec(path, prompt_key="question"), char_tokenizer(), seed=0)


def test_a_prompt_that_is_neither_text_nor_messages_names_the_row(tmp_path):
    path = write(tmp_path, [verl_row("ok"), verl_row(None)])
    with pytest.raises(DataError, match=r"row 1, column spec\.data\.promptKey='prompt'.*NoneType"):
        load_datasets(spec(path), char_tokenizer(), seed=0)


def test_missing_file_names_setting_and_file(tmp_path):
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match=r"spec\.data\.trainFiles\[0\]: data file .*nope\.parquet does not exist"):
        load_datasets(spec(missing), char_tokenizer(), seed=0)
    good = write(tmp_path, [verl_row("a")])
    with pytest.raises(DataError, match=r"spec\.data\.valFiles\[0\]: .*nope\.parquet"):
        load_datasets(DataSpec(train_files=[good], val_files=[missing]), char_tokenizer(), seed=0)


def test_a_missing_ground_truth_column_stops_a_reward_that_needs_it(tmp_path, caplog):
    """gsm8k scored every sample 0 against '' before: now the file and the column are named at start-up."""
    good = write(tmp_path, [verl_row("a")], "good.parquet")
    no_column = write(tmp_path, [{"prompt": "a", "data_source": "t"}], "bare.parquet")
    no_field = write(tmp_path, [verl_row("a"), {"prompt": "b", "reward_model": {"style": "rule"}}], "nofield.parquet")
    with pytest.raises(DataError, match=r"spec\.data\.trainFiles\[1\] .*bare\.parquet: column reward_model is "
                                        r"missing \(row 0; .*spec\.reward\.function 'gsm8k' scores against it"):
        load_datasets(DataSpec(train_files=[good, no_column]), char_tokenizer(), seed=0, reward="gsm8k")
    with pytest.raises(DataError, match=r"nofield\.parquet: column reward_model\.ground_truth is missing or null \(row 1"):
        load_datasets(spec(no_field), char_tokenizer(), seed=0, reward="math-boxed")
    with pytest.raises(DataError, match=r"spec\.data\.valFiles\[0\] .*bare\.parquet"):
        load_datasets(DataSpec(train_files=[good], val_files=[no_column]), char_tokenizer(), seed=0, reward="gsm8k")
    # a reward that needs no ground truth trains; a custom one gets a warning naming the file
    load_datasets(spec(no_column), char_tokenizer(), seed=0, reward="format")
    with caplog.at_level("WARNING"):
        load_datasets(spec(no_column), char_tokenizer(), seed=0, reward="my_rewards:length")
    assert "bare.parquet: column reward_model is missing" in caplog.text and "my_rewards:length" in caplog.text


def test_a_ground_truth_column_empty_in_every_row_stops_a_reward_that_needs_it(tmp_path):
    """Present but empty for every row: the run trained on reward 0 and exited 0. Now start-up refuses it,
    with the count and the first row; a file where some rows have a ground truth still loads."""
    empty = write(tmp_path, [verl_row("1+2=", ""), verl_row("3+4=", " ", 1), verl_row("5+6=", "", 2)], "empty.parquet")
    with pytest.raises(DataError, match=r"spec\.data\.trainFiles\[0\] .*empty\.parquet: column reward_model\."
                                        r"ground_truth is empty in all 3 rows \(first: row 0, .*1\+2=.*'gsm8k'"):
        load_datasets(spec(empty), char_tokenizer(), seed=0, reward="gsm8k")
    load_datasets(spec(empty), char_tokenizer(), seed=0, reward="format")  # needs no ground truth
    some = write(tmp_path, [verl_row("1+2=", ""), verl_row("3+4=", "7", 1)], "some.parquet")
    load_datasets(spec(some), char_tokenizer(), seed=0, reward="gsm8k")


@pytest.mark.parametrize("content", [b"", b"prompt,answer\n1+1,2\n", b"PAR1 but not really"])
def test_unreadable_file_names_the_file(tmp_path, content):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(content)
    with pytest.raises(DataError, match=r"spec\.data\.trainFiles\[0\]: data file .*bad\.parquet is not readable parquet"):
        load_datasets(spec(str(bad)), char_tokenizer(), seed=0)


def test_s3_without_a_fetcher_names_spec_s3():
    with pytest.raises(DataError, match=r"spec\.s3"):
        read_parquet_rows("s3://bucket/train.parquet")


def test_s3_uris_go_through_the_fetcher(tmp_path):
    local = write(tmp_path, [verl_row("abc")])
    seen = []
    rows = read_parquet_rows("s3://bucket/train.parquet", fetch=lambda uri: seen.append(uri) or local)
    assert seen == ["s3://bucket/train.parquet"] and rows[0]["prompt"] == "abc"


# ---------------------------------------------------------------- length policy

ROWS = [verl_row("12345", index=0), verl_row("123456789", index=1), verl_row("12", index=2)]


def test_overlong_prompts_are_filtered_and_counted(caplog):
    data = build_dataset(ROWS, spec(max_prompt_length=5), char_tokenizer(), "rows")
    assert [r.prompt_text for r in data.records] == ["12345", "12"]
    assert data.filtered == 1 and data.truncated == 0
    assert "1 prompts filtered" in caplog.text


def test_overlong_prompts_truncated_left_keep_the_end():
    data = build_dataset(ROWS, spec(max_prompt_length=5, prompt_overflow=PromptOverflow.TRUNCATE_LEFT),
                         char_tokenizer(), "rows")
    assert [r.prompt_text for r in data.records] == ["12345", "56789", "12"]
    assert [len(r.prompt_ids) for r in data.records] == [5, 5, 2]
    assert data.truncated == 1 and data.filtered == 0


def test_overlong_prompts_truncated_right_keep_the_start():
    data = build_dataset(ROWS, spec(max_prompt_length=5, prompt_overflow=PromptOverflow.TRUNCATE_RIGHT),
                         char_tokenizer(), "rows")
    assert [r.prompt_text for r in data.records] == ["12345", "12345", "12"]
    assert data.truncated == 1


def test_overlong_prompt_with_error_policy_names_row_and_setting():
    with pytest.raises(DataError, match=r"rows row 1: prompt has 9 tokens > spec\.data\.maxPromptLength=5"):
        build_dataset(ROWS, spec(max_prompt_length=5, prompt_overflow=PromptOverflow.ERROR), char_tokenizer(), "rows")


def test_everything_filtered_is_an_error():
    with pytest.raises(DataError, match=r"no prompts left after filtering \(3 longer than spec\.data\.maxPromptLength=1\)"):
        build_dataset(ROWS, spec(max_prompt_length=1), char_tokenizer(), "rows")


def test_an_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match=r"spec\.data\.trainFiles.*no rows"):
        load_datasets(spec(str(path)), char_tokenizer(), seed=0)


def test_an_empty_validation_file_names_val_files(tmp_path):
    train = write(tmp_path, [verl_row("1+2=", "3", 0)])
    empty = tmp_path / "empty-val.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match=r"^spec\.data\.valFiles \[.*empty-val\.parquet'\]: no rows \(remove valFiles"):
        load_datasets(spec(str(train), val_files=[str(empty)]), char_tokenizer(), seed=0)


def test_synthetic_data_needs_no_files():
    from rljob_api.models import SyntheticDataSpec

    data = DataSpec(synthetic=SyntheticDataSpec(task="digit-sum", num_prompts=10, num_val_prompts=3), max_prompt_length=8)
    train, val = load_datasets(data, char_tokenizer(), seed=1)
    assert len(train) == 10 and len(val) == 3
    again, _ = load_datasets(data, char_tokenizer(), seed=1)
    assert [r.prompt_text for r in again.records] == [r.prompt_text for r in train.records]
    for r in train.records:
        a, b = int(r.prompt_text[0]), int(r.prompt_text[2])
        assert r.prompt_text == f"{a}+{b}=" and r.ground_truth == str((a + b) % 10)


# ---------------------------------------------------------------- EpochSampler


def drain(sampler: EpochSampler, batches: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(batches)]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_sampler_is_deterministic_per_seed_and_reshuffles_per_epoch():
    a, b, c = EpochSampler(20, 4, seed=7), EpochSampler(20, 4, seed=7), EpochSampler(20, 4, seed=8)
    first, second, other = drain(a, 10), drain(b, 10), drain(c, 10)
    assert first == second
    assert first != other
    epoch0, epoch1 = flat(first[:5]), flat(first[5:])
    assert epoch0 != epoch1  # a fresh permutation each epoch
    assert epoch0 != list(range(20))


def test_sampler_never_repeats_within_an_epoch_and_drops_the_partial_batch():
    s = EpochSampler(10, 3, seed=0)
    assert s.batches_per_epoch == 3
    for epoch in range(3):
        seen = flat(drain(s, 3))
        assert len(seen) == 9 and len(set(seen)) == 9 and set(seen) <= set(range(10))
        assert s.epoch == epoch


def test_sampler_without_shuffle_walks_in_order():
    s = EpochSampler(6, 2, seed=0, shuffle=False)
    assert drain(s, 4) == [[0, 1], [2, 3], [4, 5], [0, 1]]


@pytest.mark.parametrize("taken", [0, 1, 4, 5, 6, 11])  # 5 batches an epoch: mid-epoch, at and past the boundary
def test_sampler_resumes_exactly_from_its_state(taken):
    reference = EpochSampler(21, 4, seed=3)
    expected = drain(reference, taken + 8)[taken:]
    s = EpochSampler(21, 4, seed=3)
    drain(s, taken)
    state = json.loads(json.dumps(s.state_dict()))  # it goes into a checkpoint as JSON
    resumed = EpochSampler(21, 4, seed=3)
    resumed.load_state_dict(state)
    assert drain(resumed, 8) == expected


def test_sampler_resumed_with_another_batch_size_starts_the_next_epoch():
    s = EpochSampler(20, 4, seed=0)
    drain(s, 2)
    resumed = EpochSampler(20, 5, seed=0)
    resumed.load_state_dict(s.state_dict())
    assert (resumed.epoch, resumed.position) == (1, 0)


def test_batch_larger_than_dataset_is_an_error():
    with pytest.raises(DataError, match=r"3 prompts, fewer than one batch of 4.*trainBatchSizePerNode"):
        EpochSampler(3, 4, seed=0)


# ---------------------------------------------------------------- preprocessing

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "What is 1000 + 234?", "answer": "It is 1,234.\n#### 1,234"},
    {"question": "Owe 5 dollars?", "answer": "He is down 5.\n#### -5"},
]


def test_gsm8k_preprocess_writes_verl_rows(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    out = tmp_path / "out" / "gsm8k.parquet"
    assert gsm8k_pre.main(["--input", str(src), "--output", str(out), "--split", "test"]) == 0
    rows = pq.read_table(out).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1234", "-5"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    assert {r["extra_info"]["split"] for r in rows} == {"test"}
    assert {r["data_source"] for r in rows} == {"openai/gsm8k"}
    prompt = rows[1]["prompt"]
    assert prompt[0]["role"] == "user" and prompt[0]["content"].startswith("What is 1000 + 234?")
    assert "#### <answer>" in prompt[0]["content"]
    # the worker reads it (chat template applied) and the gsm8k reward accepts the reference answer
    train, _ = load_datasets(spec(str(out), max_prompt_length=512), char_tokenizer(CHAT_TEMPLATE), seed=0)
    assert train.records[1].prompt_text.startswith("<user>What is 1000 + 234?")
    reward = resolve_reward("gsm8k")
    for record, raw in zip(train.records, GSM8K):
        assert reward(record.prompt_text, raw["answer"], record.ground_truth, record.extra) == 1.0


def test_gsm8k_preprocess_reads_parquet_via_the_module_entry_point(tmp_path):
    src = write(tmp_path, GSM8K, "in.parquet")
    out = tmp_path / "out.parquet"
    proc = subprocess.run([sys.executable, "-m", "rljob_worker.preprocess.gsm8k", "--input", src, "--output", str(out)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3 rows" in proc.stdout
    assert pq.read_table(out).num_rows == 3


def test_gsm8k_preprocess_rejects_bad_input(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    assert gsm8k_pre.main(["--input", str(src), "--output", str(tmp_path / "o.parquet")]) == 2
    assert "row 0: the answer has no '#### <number>' line" in capsys.readouterr().err
    src.write_text(json.dumps({"q": "x"}) + "\n")
    assert gsm8k_pre.main(["--input", str(src), "--output", str(tmp_path / "o.parquet")]) == 2
    assert "needs 'question' and 'answer'" in capsys.readouterr().err
    assert gsm8k_pre.main(["--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.parquet")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "o.parquet").exists()


def test_synthetic_preprocess_matches_the_on_the_fly_task(tmp_path):
    from rljob_worker.data.synthetic import generate_rows

    out = tmp_path / "ds.parquet"
    assert synthetic_pre.main(["--task", "digit-sum", "--num-prompts", "12", "--seed", "5", "--output", str(out)]) == 0
    assert pq.read_table(out).to_pylist() == generate_rows("digit-sum", 12, 5)
