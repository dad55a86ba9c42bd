"""gsm8k-style {question, answer} rows -> verl-format parquet.

    python -m rljob_worker.preprocess.gsm8k --input train.jsonl --output gsm8k-train.parquet [--split train]
                                            [--python-tool]

The input is a local .jsonl or .parquet file whose rows hold `question` and `answer`, where
the answer ends with gsm8k's '#### <number>' line. Each output row asks the question as a
chat message with an instruction to end with '#### <answer>', and keeps the number after
'####' (commas removed) as `reward_model.ground_truth`, which `spec.reward.function: gsm8k`
compares against. ``--python-tool`` adds a system message that offers the `builtin: python` tool in the
Hermes format (examples/qwen2.5-7b-gsm8k-python-tool.yaml). Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from rljob_worker.preprocess import write_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step, and end your response with a line '#### <answer>' giving the final number."
PYTHON_TOOL_SYSTEM = (
    "You may run Python code to compute. To run code, write exactly "
    '<tool_call>{"name": "python", "arguments": {"code": "<your code>"}}</tool_call> and stop; what the code '
    "prints comes back in <tool_response></tool_response>. Then continue, and give the final answer.")
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


class PreprocessError(ValueError):
    pass


def extract_solution(answer: str) -> str | None:
    """The number after the last '####', commas removed ('#### 1,234' -> '1234'); None without one."""
    found = _FINAL.findall(answer)
    return found[-1].replace(",", "") if found else None


def to_verl_row(question: str, answer: str, *, split: str, index: int, data_source: str = DATA_SOURCE,
                python_tool: bool = False) -> dict:
    """One verl-format row; raises PreprocessError when `answer` has no '#### <number>'."""
    truth = extract_solution(answer)
    if truth is None:
        raise PreprocessError(f"row {index}: the answer has no '#### <number>' line: {answer[-80:]!r}")
    return {
        "data_source": data_source,
        "prompt": ([{"role": "system", "content": PYTHON_TOOL_SYSTEM}] if python_tool else [])
        + [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a local .jsonl (one JSON object a line) or .parquet file."""
    p = Path(path)
    if not p.is_file():
        raise PreprocessError(f"--input {p}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a bad file
            raise PreprocessError(f"--input {p}: not readable parquet: {exc}") from None
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise PreprocessError(f"--input {p} line {n}: not JSON: {exc}") from None
    return rows


def convert(rows: list[dict], *, split: str, data_source: str = DATA_SOURCE, python_tool: bool = False) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise PreprocessError(f"row {i}: needs 'question' and 'answer' fields, has {sorted(row)}")
        out.append(to_verl_row(str(row["question"]), str(row["answer"]), split=split, index=i,
                               data_source=data_source, python_tool=python_tool))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rljob_worker.preprocess.gsm8k", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="local .jsonl or .parquet with question/answer rows")
    parser.add_argument("--output", required=True, help="verl-format parquet file to write")
    parser.add_argument("--split", default="train", help="written to extra_info.split (default: train)")
    parser.add_argument("--data-source", default=DATA_SOURCE, help=f"data_source column (default: {DATA_SOURCE})")
    parser.add_argument("--python-tool", action="store_true",
                        help="add a system message offering the python tool (spec.tools builtin: python)")
    args = parser.parse_args(argv)
    try:
        rows = convert(read_rows(args.input), split=args.split, data_source=args.data_source,
                       python_tool=args.python_tool)
    except PreprocessError as exc:
        print(f"gsm8k preprocess: {exc}", file=sys.stderr)
        return 2
    out = write_parquet(rows, args.output)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
