"""Where a DPO run's metrics go (rank 0 only): ``metrics.jsonl``, TensorBoard scalars, a progress bar, and at
the end ``dpo.png``: training loss and reward accuracy per step, and the held-out preference accuracy and
greedy exact match at each evaluation.

The RL trainer's ``RunLog`` is built around reward curves; this one reads TRL's DPO names."""

from __future__ import annotations

import logging
import os
from typing import Any

from mcore_rl.logs.config import LoggingConfig
from mcore_rl.logs.run_log import emit_record

log = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"
"""Record stages: one optimizer step; one evaluation (held-out pairs and greedy answers)."""


class DPORunLog:
    """Writes records of ``{"stage": ..., "step": ..., metrics...}``; :meth:`close` draws the plot."""

    def __init__(
        self, cfg: LoggingConfig, total_steps: int, start_step: int = 0, enabled: bool = True
    ) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._jsonl: Any = None
        self._tb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        os.makedirs(cfg.log_dir, exist_ok=True)
        if cfg.jsonl:
            self._jsonl = open(os.path.join(cfg.log_dir, "metrics.jsonl"), "a" if start_step else "w")  # noqa: SIM115
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(cfg.log_dir, "tensorboard"))
        if cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="dpo", unit="step", mininterval=2.0)

    def write(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(emit_record(self._jsonl, self._tb, stage, step, metrics))
        if self._bar is not None and stage == TRAIN:
            self._bar.update(step - self._bar.n)
            shown = {"loss": "loss", "acc": "rewards/accuracies", "margin": "rewards/margins"}
            self._bar.set_postfix(
                {k: f"{metrics[v]:.3f}" for k, v in shown.items() if v in metrics}, refresh=False
            )

    def close(self) -> str | None:
        """Flush everything; returns the plot's path (None when off, on other ranks or without matplotlib)."""
        for handle in (self._bar, self._jsonl, self._tb):
            if handle is not None:
                handle.close()
        return self._plot() if self.enabled and self.cfg.plot else None

    def _plot(self) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("matplotlib is not installed; no DPO plot")
            return None
        train = [r for r in self.records if r["stage"] == TRAIN]
        evals = [r for r in self.records if r["stage"] == EVAL]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="loss")
        left.plot(
            [r["step"] for r in train],
            [r["rewards/accuracies"] for r in train],
            lw=1,
            label="rewards/accuracies",
        )
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
        path = os.path.join(self.cfg.log_dir, "dpo.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path
