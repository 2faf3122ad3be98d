"""``mcore-rl data prepare {gsm8k,math} --input [SPLIT=]FILE_OR_DIR ... --out DIR [--split train|test]``:
a local copy of a public dataset into verl-format parquet (see :mod:`mcore_rl.data.prepare`).

    mcore-rl data prepare gsm8k --input gsm8k/main --out data/gsm8k       # train-*.parquet, test-*.parquet
    mcore-rl data prepare math --input train=math_train.jsonl --input test=math_test.jsonl --out data/math
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    prepare = sub.add_parser(
        "prepare", help="a local GSM8K or MATH copy (jsonl/parquet) -> verl-format <out>/<split>.parquet"
    )
    from mcore_rl.data.prepare import SPLITS, TASKS

    prepare.add_argument("dataset", choices=sorted(TASKS), help="the public layout of the input")
    prepare.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="[SPLIT=]PATH",
        help="a .parquet/.jsonl file or a folder of them; repeat for more files. The split: SPLIT=, else "
        "--split, else the file name (train*, test*)",
    )
    prepare.add_argument("--out", required=True, help="folder to create (never written over)")
    prepare.add_argument("--split", choices=SPLITS, default=None, help="the split of inputs not named")


def run(args: argparse.Namespace) -> int:
    from mcore_rl.data.prepare import prepare_dataset

    prepared = prepare_dataset(args.dataset, args.input, args.out, args.split)
    for split, path in prepared.files.items():
        print(f"{split}: {path} ({prepared.num_rows[split]} rows)")
    files = prepared.files
    keys = [f"data.train_files=[{files['train']}]"] if "train" in files else []
    keys += [f"data.val_files=[{files['test']}]"] if "test" in files else []
    print(f"use it: mcore-rl train RECIPE model.path=MODEL {' '.join(keys)}")
    return 0
