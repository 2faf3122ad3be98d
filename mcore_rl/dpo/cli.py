"""``mcore-rl dpo RECIPE [key=value ...]``: a DPO run from a recipe (``dpo.train_files`` set).

One rank runs in this process; a recipe with more ranks spawns them locally, or each rank is started by
torchrun (``torchrun --nproc-per-node N -m mcore_rl.cli dpo RECIPE``)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mcore_rl.config import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe",
        help="YAML recipe (e.g. recipes/dpo_demo_cpu.yaml) or a project recipe's name (dpo_demo_cpu)",
    )
    parser.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. dpo.beta=0.2")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def scorer_names(cfg: RunConfig) -> str:
    """The scorers that score ``data.test_files`` (the greedy metric the trainer logs as ``exact_match``:
    the mean score of each row's ``data_source`` scorer, e.g. verl's GSM8K rule, not an exact match)."""
    from mcore_rl.data.rows import read_rows
    from mcore_rl.scoring.registry import default_scorer_name

    if cfg.reward.custom_function:
        return cfg.reward.custom_function
    sources: set[str] = set()
    for file in cfg.data.test_files:
        sources.update(
            str(row.get(cfg.data.reward_fn_key)) for _, row in read_rows(file) if isinstance(row, dict)
        )
    names = {cfg.reward.sources.get(s) or default_scorer_name(s) or f"none for {s!r}" for s in sources}
    return ", ".join(sorted(names)) or "data_source"


def run(args: argparse.Namespace) -> int:
    from mcore_rl.config import load_config
    from mcore_rl.dpo.launch import run_dpo

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.recipe, args.overrides)
    summary = run_dpo(cfg)
    if "already_complete" in summary:  # a finished run run again: nothing loaded, trained or logged
        print(
            f"already complete at step {summary['already_complete']} ({summary['checkpoint']}); nothing to train"
        )
        return 0
    before, after = summary.get("before") or {}, summary.get("after") or {}
    for key, name in (
        ("eval_logps/accuracies", "held-out preference accuracy (policy prefers chosen)"),
        ("eval_rewards/accuracies", "held-out reward accuracy (TRL's, vs the reference)"),
        ("exact_match", "held-out greedy accuracy"),
    ):
        if key in before or key in after:
            name += f" ({scorer_names(cfg)} scorer)" if key == "exact_match" else ""
            print(
                f"{name}: {_pct(before.get(key))} before, {_pct(after.get(key))} after {summary['steps']} steps"
            )
    plot = ", dpo.png" if summary.get("plot") else ""
    if summary.get("model"):
        print(f"model: {summary['model']} (HF folder: model.path of a next run, or mcore-rl eval MODEL DATA)")
    print(f"logs: {summary['log_dir']} (metrics.jsonl{plot})")
    return 0
