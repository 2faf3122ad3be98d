"""``mcore-rl sft RECIPE [key=value ...]``: supervised fine-tuning on the RL run's engines, recipe and logs;
writes the model an RL run starts from (``model.path``). See ``mcore_rl/trainer/sft.py``."""

from __future__ import annotations

import argparse
import logging
import os
import shlex

from mcore_rl.config.run_folder import is_inside
from mcore_rl.trainer.cli import add_arguments as add_train_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser, override_example="sft.total_steps=20")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


RUN_KEYS = ("model.path", "sft.enable", "trainer.default_local_dir", "logging.log_dir")
"""Overrides of the SFT run that the RL command sets itself (a repeated one would name the SFT run folder,
which holds the RL run's input and is refused as its output)."""


def rl_command(args: argparse.Namespace, model_dir: str, log_dir: str) -> str:
    """The ``mcore-rl train`` line that starts RL from the SFT model, as a shell reads it back (shlex): the
    recipe and the user's other overrides repeated, ``model.path`` the model, and a run folder of its own
    beside the SFT run's (``<run>_rl``, ``<run>_rl2``.. : the first that does not exist)."""
    run = os.path.dirname(os.path.normpath(model_dir))
    rl_dir, n = f"{run}_rl", 2
    while os.path.lexists(rl_dir):  # an earlier RL run from this model: its folder is left to it
        rl_dir, n = f"{run}_rl{n}", n + 1
    kept = [o for o in args.overrides if o.split("=", 1)[0].strip() not in RUN_KEYS]
    keys = [*kept, f"model.path={model_dir}", "sft.enable=false", f"trainer.default_local_dir={rl_dir}"]
    if not is_inside(log_dir, run):  # the recipe logs outside its run folder: the RL run's logs go in its own
        keys.append(f"logging.log_dir={os.path.join(rl_dir, 'logs')}")
    flags = ["--in-process"] if args.in_process else []
    return shlex.join(["mcore-rl", "train", args.recipe, *keys, *flags])


def run(args: argparse.Namespace) -> int:
    from mcore_rl.config.run_folder import finished_sft
    from mcore_rl.trainer.sft import run_sft, sft_config

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = sft_config(args.recipe, args.overrides, max_ranks=1 if args.in_process else None)
    done = finished_sft(cfg)
    if done is not None and (done[0] >= cfg.sft.total_steps or cfg.sft.target_val_accuracy is not None):
        # a finished run run again, as `train` and `dpo` answer one: nothing trained or written
        print(f"already complete at step {done[0]} ({done[1]}); nothing to train")
        print(f"start RL from it: {rl_command(args, done[1], cfg.logging.log_dir)}")
        return 0
    summary = run_sft(cfg, use_ray=not args.in_process)
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
    print(f"start RL from it: {rl_command(args, summary.model_dir, summary.log_dir)}")
    print(f"logs: {summary.log_dir} (metrics.jsonl{', reward.png' if summary.plot else ''})")
    return 0
