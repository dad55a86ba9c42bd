"""Offline preprocessing into verl-format parquet (no downloads; inputs are local files).

    python -m rljob_worker.preprocess.gsm8k --input train.jsonl --output gsm8k-train.parquet
    python -m rljob_worker.preprocess.synthetic --task digit-sum --num-prompts 256 --output ds.parquet

A verl row: `prompt` (chat message list), `data_source`, `ability`,
`reward_model` {style, ground_truth}, `extra_info` {split, index, ...}; the worker reads
these with `spec.data.trainFiles` and scores them with the matching `spec.reward.function`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def write_parquet(rows: Sequence[dict], output: str | Path) -> Path:
    """Write rows as one parquet file (parent folders created) and return its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), out)
    return out
