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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="HF folder (model.path), megatron model checkpoint (mcore-rl convert hf-to-mcore), run checkpoint "
        "(checkpoints/global_step_N: its saved config is the recipe) or run folder (its latest checkpoint)",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="DATA_OR_KEY=VALUE",
        help="verl-format .parquet/.jsonl prompt files, then key=value overrides (e.g. rollout.val_kwargs.n=8)",
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


def run(args: argparse.Namespace) -> int:
    from mcore_rl.io.errors import OutputError
    from mcore_rl.trainer.evaluate import evaluate_model, write_report

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.json is not None and os.path.lexists(args.json):  # before minutes of generation, not after
        raise OutputError(f"--json {args.json} exists; it is left as it is (choose another path)")
    data = [a for a in args.inputs if "=" not in a]
    overrides = [a for a in args.inputs if "=" in a]
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
