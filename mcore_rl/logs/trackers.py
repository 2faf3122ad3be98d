"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases (``logging.wandb``) and MLflow
(``logging.mlflow``), each fed every record :class:`~mcore_rl.logs.run_log.RunLog` writes.

A record ``{"stage": s, "step": n, **metrics}`` goes to a tracker as its finite numbers named ``s/key`` at
step ``n``. Stages count steps of their own (SFT steps, then RL steps from 1 again; held-out tests at the
step they follow), so W&B gets one step axis per stage (``define_metric("s/*", step_metric="s/step")``):
its global step must only grow. MLflow keeps a step per metric and takes them as they come.

Neither needs a network by default: W&B runs ``offline`` (``logging.wandb_mode``; ``wandb sync`` uploads
later) into ``<log_dir>/wandb``, MLflow writes a file store at ``<log_dir>/mlruns`` (``logging.
mlflow_tracking_uri``; ``mlflow ui --backend-store-uri <log_dir>/mlruns`` shows it). Both are optional
imports (``pip install wandb`` / ``pip install mlflow-skinny``); the config check names the key and the
command when one is on and absent.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from typing import Any, Protocol

from mcore_rl.io.errors import ConfigError
from mcore_rl.logs.config import LoggingConfig


class Tracker(Protocol):
    """A sink of records: :meth:`log` each one, :meth:`close` at the end of the run."""

    def log(self, stage: str, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def numbers(stage: str, metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, named ``stage/key`` (text, lists and NaN stay in metrics.jsonl)."""
    return {
        f"{stage}/{key}": float(value)
        for key, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def _module(name: str, key: str, package: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"{key}=true needs {name}: pip install {package}") from None


class WandbTracker:
    """One W&B run (``logging.wandb``), in ``<log_dir>/wandb``."""

    def __init__(self, cfg: LoggingConfig) -> None:
        wandb = _module("wandb", "logging.wandb", "wandb")
        self._stages: set[str] = set()
        self.run = wandb.init(
            project=cfg.tracker_project, name=cfg.tracker_run_name, dir=cfg.log_dir, mode=cfg.wandb_mode
        )

    def log(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        if stage not in self._stages:  # each stage on its own step axis (see the module docstring)
            self._stages.add(stage)
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
        self.run.log({**numbers(stage, metrics), f"{stage}/step": step})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run (``logging.mlflow``) of the experiment ``logging.tracker_project``, through a client of
    its own (no process-wide active run)."""

    def __init__(self, cfg: LoggingConfig) -> None:
        tracking = _module("mlflow.tracking", "logging.mlflow", "mlflow-skinny")
        uri = cfg.mlflow_tracking_uri
        if "://" not in uri or uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode behind this opt-in; a local run log needs
            # no database or server (give a sqlite:// or http:// URI for one).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.tracker_project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(cfg.tracker_project)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.tracker_run_name).info.run_id
        self._metric = importlib.import_module("mlflow.entities").Metric

    def log(self, stage: str, step: int, metrics: dict[str, Any]) -> None:
        now_ms = int(time.time() * 1000)
        batch = [self._metric(k, v, now_ms, step) for k, v in numbers(stage, metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(cfg: LoggingConfig) -> list[Tracker]:
    """The trackers ``cfg`` turns on (none by default). A resumed run opens a new tracker run of the same
    name, whose steps continue where the checkpoint left off."""
    trackers: list[Tracker] = []
    try:
        if cfg.wandb:
            trackers.append(WandbTracker(cfg))
        if cfg.mlflow:
            trackers.append(MlflowTracker(cfg))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
