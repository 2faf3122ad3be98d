"""The synthetic addition task (:mod:`mcore_rl.data.arithmetic`) as verl-format data, so the demo job reads
prompts, a tokenizer and rewards the way a real run does.

Written files (each where the config names it; ``.parquet`` or ``.jsonl`` by suffix):

* train / validation / held-out test prompts: ``prompt`` is one user message ``"123+456="``,
  ``data_source`` is :data:`DATA_SOURCE` (scored by exact match), ``reward_model.ground_truth`` the sum
  (``579``; reversed, ``975``, for the task ``arithmetic_reversed``: see :mod:`mcore_rl.data.arithmetic`);
* SFT examples: the same columns plus ``response`` (the sum), for the warm start;
* a tokenizer folder: ``tokenizer.json`` (a character-level WordLevel model with the ids of
  :class:`~mcore_rl.data.arithmetic.CharTokenizer`: PAD 0, EOS 1) and ``tokenizer_config.json`` whose
  chat template renders a conversation as its contents, so the model sees ``123+456=``.

Validation and test prompts never appear among the training or SFT prompts.

    python -m mcore_rl.data.demo_task OUT_DIR [--format jsonl] [--reversed]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from mcore_rl.data.arithmetic import AdditionProblem, CharTokenizer, make_problems
from mcore_rl.data.config import GENERATED_TASKS, DataConfig
from mcore_rl.data.rows import write_rows
from mcore_rl.data.tokenizer import write_tokenizer_config
from mcore_rl.io.errors import note

DATA_SOURCE = "mcore_rl/arithmetic"
"""``data_source`` of the demo rows; the scorer registry maps it to exact match."""
SPLIT_SIZES = {"test": 1000, "val": 200, "train": 20_000, "sft": 40_000}
"""Rows per split; the held-out test and validation sets match the old demo's."""
PAD_TOKEN, EOS_TOKEN = "<pad>", "</s>"


def write_tokenizer(folder: str) -> None:
    """The demo tokenizer as a HF folder, id for id the same as :class:`CharTokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = CharTokenizer()
    vocab = {PAD_TOKEN: chars.PAD, EOS_TOKEN: chars.EOS}
    vocab.update({ch: chars.encode(ch)[0] for ch in chars.SYMBOLS})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    tokenizer.decoder = decoders.Fuse()  # join characters without spaces
    tokenizer.add_special_tokens([PAD_TOKEN, EOS_TOKEN])
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    write_tokenizer_config(
        folder,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template="{% for message in messages %}{{ message['content'] }}{% endfor %}",
    )


def rows(problems: list[AdditionProblem], split: str, with_response: bool = False) -> list[dict[str, Any]]:
    out = []
    for index, p in enumerate(problems):
        row: dict[str, Any] = {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": index},
        }
        if with_response:
            row["response"] = p.answer
        out.append(row)
    return out


def splits(
    seed: int, sizes: dict[str, int] | None = None, reverse: bool = False
) -> dict[str, list[AdditionProblem]]:
    """Problems per split; training and SFT prompts exclude every validation and test prompt."""
    sizes = {**SPLIT_SIZES, **(sizes or {})}
    test = make_problems(sizes["test"], seed=10_000 + seed, reverse=reverse)
    val = make_problems(sizes["val"], seed=20_000 + seed, reverse=reverse)
    held_out = {p.prompt for p in test + val}
    out = {"test": test, "val": val}
    for offset, name in ((30_000, "train"), (40_000, "sft")):
        pool = make_problems(sizes[name] + len(held_out), seed=offset + seed, reverse=reverse)
        out[name] = [p for p in pool if p.prompt not in held_out][: sizes[name]]
    return out


def write_demo_dataset(
    paths: dict[str, str], seed: int, sizes: dict[str, int] | None = None, reverse: bool = False
) -> None:
    """Write the splits named in ``paths`` (keys: train, val, test, sft, tokenizer) to those paths."""
    problems = splits(seed, sizes, reverse)
    for split, path in paths.items():
        if split == "tokenizer":
            write_tokenizer(path)
        else:
            write_rows(path, rows(problems[split], split, with_response=split == "sft"))


def prepare_data(
    data: DataConfig, sft_files: Sequence[str] = (), tokenizer_path: str | None = None
) -> list[str]:
    """Run ``data.generate`` for the files the run names that are missing (``data.*_files``, ``sft_files``
    and the tokenizer folder); returns those written."""
    if data.generate is None:
        return []
    if data.generate not in GENERATED_TASKS:
        known = ", ".join(GENERATED_TASKS)
        raise ValueError(f"data.generate={data.generate!r}: unknown task; known: {known}")
    reverse = GENERATED_TASKS[data.generate]
    wanted = {
        "train": data.train_files[:1],
        "val": data.val_files[:1],
        "test": data.test_files[:1],
        "sft": list(sft_files)[:1],
        "tokenizer": [tokenizer_path] if tokenizer_path else [],
    }

    def present(split: str, path: str) -> bool:
        return _holds_a_tokenizer(path) if split == "tokenizer" else os.path.isfile(path)

    missing = {split: paths[0] for split, paths in wanted.items() if paths and not present(split, paths[0])}
    if data.generate == "tool_calc":
        from mcore_rl.data.tool_task import write_tool_dataset

        write_tool_dataset(missing, data.seed)
        return announce_generated(data.generate, missing)
    for split in ("test", "sft"):  # files kept from an earlier run must hold this task's answers
        if wanted[split] and split not in missing:
            check_task(wanted[split][0], data.generate, reverse)
    write_demo_dataset(missing, data.seed, reverse=reverse)
    return announce_generated(data.generate, missing)


def announce_generated(task: str, written: dict[str, str]) -> list[str]:
    """One console line naming the files ``data.generate`` wrote because they were missing (a mistyped path
    would otherwise train on generated data without a word); returns their paths."""
    if written:
        files = ", ".join(f"{path} ({split})" for split, path in written.items())
        note(
            f"data.generate={task}: generated {files}, which did not exist; the run trains on what it generated"
        )
    return list(written.values())


def _holds_a_tokenizer(path: str) -> bool:
    """A tokenizer file, or a folder with any tokenizer in it (a user's sentencepiece ``.model`` and its
    ``tokenizer_config.json`` included): the demo tokenizer is written only where none is, never over one."""
    if os.path.isfile(path):
        return True
    names = os.listdir(path) if os.path.isdir(path) else []
    return any(n in ("tokenizer.json", "tokenizer_config.json") or n.endswith(".model") for n in names)


def check_task(path: str, task: str, reverse: bool) -> None:
    """Refuse an existing generated file whose first row answers the other way round (a data folder kept
    from a run of the other task would otherwise train and score against the wrong answers)."""
    from mcore_rl.data.rows import read_rows

    first = next(read_rows(path), None)
    try:
        row = first[1]  # type: ignore[index]
        messages = row["prompt"]
        prompt = str(messages[0]["content"] if isinstance(messages, list) else messages)
        a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        found = str(row["reward_model"]["ground_truth"])
    except (TypeError, KeyError, IndexError, ValueError):
        return  # not this task's rows at all: the data loader names the bad row and column
    expected = str(a + b)[::-1] if reverse else str(a + b)
    if found != expected:
        raise ValueError(
            f"data.generate={task}: {path} holds another task's answers ({prompt}{found}, expected "
            f"{expected}); name other data files for this task or remove that file"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_rl.data.demo_task", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reversed", action="store_true", help="answers least-significant digit first")
    args = parser.parse_args(argv)
    paths = {s: os.path.join(args.out_dir, f"{s}.{args.format}") for s in ("train", "val", "test", "sft")}
    write_demo_dataset(
        {**paths, "tokenizer": os.path.join(args.out_dir, "tokenizer")}, args.seed, reverse=args.reversed
    )
    print(f"wrote {', '.join(sorted(paths.values()))} and {args.out_dir}/tokenizer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
