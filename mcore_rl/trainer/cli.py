"""``mcore-rl train RECIPE [key=value ...]``: an RL run (with its SFT warm start) from a recipe."""

from __future__ import annotations

import argparse
import logging


def add_arguments(
    parser: argparse.ArgumentParser, override_example: str = "trainer.total_training_steps=20"
) -> None:
    """``RECIPE [key=value ...] [--in-process]``; ``override_example`` shows the command's own step count
    (``mcore-rl sft`` counts ``sft.total_steps``)."""
    parser.add_argument(
        "recipe", help="YAML recipe (e.g. recipes/demo_cpu.yaml) or a project recipe's name (demo_cpu)"
    )
    parser.add_argument(
        "overrides", nargs="*", default=[], help=f"key=value overrides, e.g. {override_example}"
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
    if "already_complete" in summary:  # a finished run run again: nothing trained or logged
        done = summary["already_complete"]
        print(f"already complete at step {done} ({summary['checkpoint']}); nothing to train")
        return 0
    after = summary.get("test_after_rl")
    held_out = [f"{_pct(summary['test_before'])} before"] if "test_before" in summary else []
    if "test_after_sft" in summary:
        held_out.append(f"{_pct(summary['test_after_sft'])} after {summary['sft_steps']} SFT steps")
    held_out.append(f"{_pct(after)} after {trainer.global_step} RL steps")
    if trainer.data.test is None:
        print("held-out accuracy: none (set data.test_files to score a held-out set)")
    else:
        print("held-out accuracy: " + ", ".join(held_out))
    if after is not None and "test_after_sft" in summary:
        print(f"RL gain over the SFT checkpoint: {100 * (after - summary['test_after_sft']):+.1f} points")
    if summary.get("model"):
        print(f"model: {summary['model']} (HF folder: model.path of a next run, or mcore-rl eval MODEL DATA)")
    print(f"logs: {log_dir} (metrics.jsonl{', reward.png' if summary.get('plot') else ''})")
    return 0
