"""``mcore-rl eval MODEL_OR_CHECKPOINT DATA [DATA ...] [key=value ...]``: greedy accuracy, pass@k and mean
reward of a model on verl-format data, per ``data_source`` (see :mod:`mcore_rl.trainer.evaluate`).

    mcore-rl eval runs/sft/model data/gsm8k/test.parquet                         # an HF folder
    mcore-rl eval runs/grpo data/test.parquet rollout.val_kwargs.n=8 rollout.val_kwargs.temperature=1.0
    mcore-rl eval ckpt/mcore data/test.parquet --recipe recipes/demo_cpu.yaml parallel.tensor_model_parallel_size=2 \\
        trainer.n_gpus_per_node=2 rollout.name=vllm --json results.json
"""

from __future__ import annotations

import argparse
import logging
import os
import re

_KEY = re.compile(r"[+~]?[A-Za-z_]\w*(\.[A-Za-z_][\w-]*)+")
"""The left side of what reads as an override (a key, a typo of one, verl's key): dotted, no path."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="HF folder (model.path), megatron model checkpoint (mcore-rl convert hf-to-mcore), run checkpoint "
        "(checkpoints/global_step_N: its saved config is the recipe) or run folder: its model/ (the export a "
        "finished run ends with) with its config.yaml, else its checkpoints/latest (also when that was "
        "written after model/: a resumed run stopped before its new end)",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="DATA_OR_KEY=VALUE",
        help="verl-format .parquet/.jsonl prompt files, then key=value overrides (e.g. rollout.val_kwargs.n=8); "
        "an argument with '=' is a data file when it exists and its left side is not a config key",
    )
    parser.add_argument(
        "--recipe", default=None, help="YAML recipe under the overrides (default: the schema's)"
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the numbers to this new file")
    parser.add_argument(
        "--pass-threshold",
        type=float,
        default=1.0,
        help="reward at which an answer counts as correct (default 1.0, a 0/1 rule's full score)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the single rank inside this process instead of a Ray worker group (world size 1 only)",
    )


def split_inputs(inputs: list[str]) -> tuple[list[str], list[str]]:
    """DATA files and key=value overrides: an argument is an override when its left side is a key of the
    config, or reads as one (a typo, named by the config load) and is not an existing file; so
    ``data/split=test.parquet`` is a data file, and a missing one is named as missing, not as a key."""
    from mcore_rl.config import RunConfig
    from mcore_rl.config.key_hints import schema_has

    def is_override(arg: str) -> bool:
        key, eq, _ = arg.partition("=")
        if not eq:
            return False
        return schema_has(RunConfig, key) or (_KEY.fullmatch(key) is not None and not os.path.exists(arg))

    return [a for a in inputs if not is_override(a)], [a for a in inputs if is_override(a)]


def check_json_out(path: str) -> None:
    """``--json OUT`` is refused before minutes of generation, not after: an existing file (left as it is),
    a missing folder, or one this user cannot write."""
    from mcore_rl.io.errors import OutputError

    if os.path.lexists(path):
        raise OutputError(f"--json {path} exists; it is left as it is (choose another path)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputError(
            f"--json {path}: folder {folder} does not exist (create it, or choose another path)"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"--json {path}: folder {folder} is not writable (choose another path)")


def run(args: argparse.Namespace) -> int:
    from mcore_rl.trainer.evaluate import evaluate_model, write_report

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.json is not None:
        check_json_out(args.json)
    data, overrides = split_inputs(args.inputs)
    report = evaluate_model(
        args.model,
        data,
        overrides,
        recipe=args.recipe,
        use_ray=not args.in_process,
        pass_threshold=args.pass_threshold,
    )
    print(report.table())
    if args.json is not None:
        write_report(report, args.json)
        print(f"numbers: {args.json}")
    return 0
