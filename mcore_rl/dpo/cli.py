"""``mcore-rl dpo RECIPE [key=value ...]``: a DPO run from a recipe (``dpo.train_files`` set).

One rank runs in this process; a recipe with more ranks spawns them locally, or each rank is started by
torchrun (``torchrun --nproc-per-node N -m mcore_rl.cli dpo RECIPE``)."""

from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (e.g. recipes/dpo_demo_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. dpo.beta=0.2")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def run(args: argparse.Namespace) -> int:
    from mcore_rl.dpo.launch import run_dpo

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary = run_dpo(args.recipe, args.overrides)
    before, after = summary.get("before") or {}, summary.get("after") or {}
    for key, name in (
        ("eval_logps/accuracies", "held-out preference accuracy (policy prefers chosen)"),
        ("eval_rewards/accuracies", "held-out reward accuracy (TRL's, vs the reference)"),
        ("exact_match", "greedy exact match"),
    ):
        if key in before or key in after:
            print(
                f"{name}: {_pct(before.get(key))} before, {_pct(after.get(key))} after {summary['steps']} steps"
            )
    plot = ", dpo.png" if summary.get("plot") else ""
    print(f"logs: {summary['log_dir']} (metrics.jsonl{plot})")
    return 0
