"""``mcore-rl train RECIPE [key=value ...]``: an RL run (with its SFT warm start) from a recipe."""

from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (e.g. recipes/demo_cpu.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. trainer.total_training_steps=20"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the single rank inside this process instead of a Ray worker group (world size 1 only)",
    )


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def run(args: argparse.Namespace) -> int:
    from mcore_rl.trainer.trainer import Trainer

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with Trainer.from_config(args.recipe, args.overrides, use_ray=not args.in_process) as trainer:
        summary = trainer.fit()
        log_dir = trainer.cfg.logging.log_dir
    before, after = summary.get("test_before"), summary.get("test_after_rl")
    line = f"held-out accuracy: {_pct(before)} before"
    if "test_after_sft" in summary:
        line += f", {_pct(summary['test_after_sft'])} after {summary['sft_steps']} SFT steps"
    print(f"{line}, {_pct(after)} after {trainer.global_step} RL steps")
    if after is not None and "test_after_sft" in summary:
        print(f"RL gain over the SFT checkpoint: {100 * (after - summary['test_after_sft']):+.1f} points")
    print(f"logs: {log_dir} (metrics.jsonl{', reward.png' if summary.get('plot') else ''})")
    return 0
