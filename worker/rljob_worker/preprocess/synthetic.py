"""Write a synthetic task (rljob_worker.data.synthetic) as verl-format parquet.

    python -m rljob_worker.preprocess.synthetic --task digit-sum --num-prompts 256 --seed 0 --output ds.parquet

The same rows `spec.data.synthetic` generates on the fly, as a file for `spec.data.trainFiles`
(score them with `spec.reward.function` set to the task's name).
"""
from __future__ import annotations

import argparse
import sys

from rljob_worker.data.synthetic import generate_rows
from rljob_worker.preprocess import write_parquet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rljob_worker.preprocess.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--task", required=True, choices=["target-token", "digit-sum", "tool-secret"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="verl-format parquet file to write")
    args = parser.parse_args(argv)
    out = write_parquet(generate_rows(args.task, args.num_prompts, args.seed), args.output)
    print(f"wrote {args.num_prompts} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
