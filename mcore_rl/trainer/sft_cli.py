"""``mcore-rl sft RECIPE [key=value ...]``: supervised fine-tuning on the RL run's engines, recipe and logs;
writes the model an RL run starts from (``model.path``). See ``mcore_rl/trainer/sft.py``."""

from __future__ import annotations

import argparse
import logging

from mcore_rl.trainer.cli import add_arguments as add_train_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser, override_example="sft.total_steps=20")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def run(args: argparse.Namespace) -> int:
    from mcore_rl.trainer.sft import run_sft

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary = run_sft(args.recipe, args.overrides, use_ray=not args.in_process)
    loss = f"loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}"
    if summary.test_after is None:
        print(
            f"{summary.steps} SFT steps ({loss}); held-out accuracy: none (set data.test_files to score one)"
        )
    else:
        print(
            f"held-out accuracy: {_pct(summary.test_before)} before, {_pct(summary.test_after)} after "
            f"{summary.steps} SFT steps ({loss})"
        )
    print(f"model: {summary.model_dir} (megatron checkpoint: {summary.checkpoint_dir})")
    print(f"start RL from it: mcore-rl train {args.recipe} model.path={summary.model_dir} sft.enable=false")
    print(f"logs: {summary.log_dir} (metrics.jsonl{', reward.png' if summary.plot else ''})")
    return 0
