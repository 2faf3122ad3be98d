"""The PNGs a run leaves next to its logs, drawn from its records (``metrics.jsonl``'s rows)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no plot")
        return None
    return plt


def reward_plot(records: list[dict[str, Any]], log_dir: str) -> str | None:
    """``reward.png``: the RL stage's training reward and the validation accuracy per step."""
    plt = _pyplot()
    if plt is None:
        return None
    rl = [r for r in records if r["stage"] == "rl"]
    val = [r for r in records if "val_accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rl], [r["reward"] for r in rl], label="reward (train samples)", lw=1)
    ax.plot([r["step"] for r in val], [r["val_accuracy"] for r in val], "o-", label="validation accuracy")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(plt, fig, os.path.join(log_dir, "reward.png"))


def dpo_plot(records: list[dict[str, Any]], log_dir: str) -> str | None:
    """``dpo.png``: training loss and reward accuracy per step (TRL's names), and the held-out preference
    accuracy and greedy exact match at each evaluation."""
    plt = _pyplot()
    if plt is None:
        return None
    train = [r for r in records if r["stage"] == "train"]
    evals = [r for r in records if r["stage"] == "eval"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in train]
    left.plot(steps, [r["loss"] for r in train], lw=1, label="loss")
    left.plot(steps, [r["rewards/accuracies"] for r in train], lw=1, label="rewards/accuracies")
    left.set_xlabel("step")
    left.set_title("training batches")
    for key, label in (
        ("eval_rewards/accuracies", "held-out reward accuracy (vs reference)"),
        ("eval_logps/accuracies", "held-out preference accuracy (policy)"),
        ("exact_match", "greedy exact match"),
    ):
        points = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if points:
            right.plot(*zip(*points, strict=True), "o-", label=label)
    right.set_xlabel("step")
    right.set_ylim(-0.02, 1.02)
    right.set_title("held-out")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, os.path.join(log_dir, "dpo.png"))


def _save(plt: Any, fig: Any, path: str) -> str:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
