"""The PNGs a run leaves next to its logs, drawn from its records (``metrics.jsonl``'s rows)."""

from __future__ import annotations

import logging
import math
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


def reward_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """The (step, value) series ``reward.png`` draws, each stage on its own step axis: the SFT loss and
    greedy validation accuracy (``sft``), the RL stage's sampled training reward and greedy validation
    accuracy (``rl``), and the held-out test accuracy before training, after SFT and after RL (``test``)."""
    sft = [r for r in records if r["stage"] == "sft"]
    rl = [r for r in records if r["stage"] == "rl"]
    tests = {
        r["when"]: r["accuracy"] for r in records if r["stage"] == "test" and r.get("accuracy") is not None
    }
    last_sft = sft[-1]["step"] if sft else 0
    last_rl = rl[-1]["step"] if rl else 0
    return {
        "sft_loss": [(r["step"], r["loss"]) for r in sft if "loss" in r],
        "sft_val_accuracy": [(r["step"], r["val_accuracy"]) for r in sft if "val_accuracy" in r],
        "rl_reward": [(r["step"], r["reward"]) for r in rl if "reward" in r],
        "rl_val_accuracy": [(r["step"], r["val_accuracy"]) for r in rl if "val_accuracy" in r],
        # held-out marks on the axis of the stage they close: before (SFT step 0, or RL step 0 without SFT),
        # after SFT (its last step), after RL (its last step)
        "test_sft": [
            (p, tests[w]) for w, p in (("before", 0), ("after_sft", last_sft)) if w in tests and sft
        ],
        "test_rl": [
            (p, tests[w])
            for w, p in (("before", 0), ("after_sft", 0), ("after_rl", last_rl))
            if w in tests and (w != "before" or not sft)
        ],
    }


def reward_plot(records: list[dict[str, Any]], log_dir: str) -> str | None:
    """``reward.png``: the SFT warm start and the RL stage side by side, each on its own step axis (an RL step
    is not an SFT step): SFT loss and greedy validation accuracy; RL's sampled training reward (at the rollout
    temperature, the verifier's mean score of the samples it trained on) and greedy validation accuracy;
    the held-out test accuracy as marks where each stage starts and ends. A panel with nothing to draw is left
    out, and so is the legend entry of a series without points."""
    plt = _pyplot()
    if plt is None:
        return None
    series = reward_series(records)
    panels = [
        name
        for name in ("sft", "rl")
        if any(series[k] for k in series if k.startswith(name) or k == f"test_{name}")
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        _draw_stage(ax, name, series)
    fig.tight_layout()
    return _save(plt, fig, os.path.join(log_dir, "reward.png"))


def _draw_stage(ax: Any, stage: str, series: dict[str, list[tuple[float, float]]]) -> None:
    # one colour per quantity in both panels
    styles: dict[str, dict[str, Any]] = {
        "rl_reward": dict(fmt="-", color="C0", lw=0.8, label="sampled reward (training batches)"),
        "sft_val_accuracy": dict(
            fmt="o-", color="C1", lw=1, markersize=3, label="greedy validation accuracy"
        ),
        "rl_val_accuracy": dict(fmt="o-", color="C1", lw=1, markersize=3, label="greedy validation accuracy"),
        f"test_{stage}": dict(fmt="*", color="black", markersize=11, label="held-out test accuracy"),
    }
    drawn: list[float] = [0.0, 1.0]
    for key, style in styles.items():
        if key.startswith((stage, "test_")) and series.get(key):
            options = dict(style)
            fmt = options.pop("fmt")
            ax.plot(*zip(*series[key], strict=True), fmt, **options)
            drawn += [y for _, y in series[key] if math.isfinite(y)]
    handles, labels = ax.get_legend_handles_labels()
    if stage == "sft" and series["sft_loss"]:
        loss = ax.twinx()
        (line,) = loss.plot(*zip(*series["sft_loss"], strict=True), color="grey", lw=0.8, alpha=0.6)
        loss.set_ylabel("SFT loss (token mean)")
        handles, labels = [*handles, line], [*labels, "loss (right axis)"]
    ax.set_xlabel("SFT step" if stage == "sft" else "RL step")
    _whole_steps(ax)
    ax.set_ylabel("accuracy / reward")
    # [0, 1] for accuracies, widened to every reward drawn (a +-1 rule's, a reward model's)
    low, high = min(drawn), max(drawn)
    ax.set_ylim(low - 0.02 * (high - low), high + 0.02 * (high - low))
    ax.set_title("SFT warm start" if stage == "sft" else "RL")
    ax.grid(alpha=0.3)
    if handles:  # below the axes: inside, it hid the held-out mark at the end of RL
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)


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
        _whole_steps(ax)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run without held-out pairs plots nothing on the right
            ax.legend()
    return _save(plt, fig, os.path.join(log_dir, "dpo.png"))


def _whole_steps(ax: Any) -> None:
    """Steps are counted: no 0.5 tick on a 3-step run's axis."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


def _save(plt: Any, fig: Any, path: str) -> str:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
