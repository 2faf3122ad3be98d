"""Supervised fine-tuning as a run of its own (``mcore-rl sft RECIPE``), on the RL run's engines and recipe.

    held-out test -> SFT steps (``sft.*``: loss on response tokens only, validation every ``sft.test_freq``,
    early stop at ``sft.target_val_accuracy``) -> held-out test -> the model, written twice:

    <trainer.default_local_dir>/
        config.yaml          the resolved config
        logs/                metrics.jsonl (stage "sft" and "test"), TensorBoard, plot
        sft_checkpoint/      megatron model checkpoint (any layout loads it; ``mcore-rl convert`` reads it)
        model/               HF folder (safetensors, config.json, tokenizer files): the RL run starts from it
                             with ``mcore-rl train RECIPE model.path=<that folder> sft.enable=false``

It is the same code as the warm start inside ``mcore-rl train`` (:meth:`Trainer.sft`), so a separate SFT
run followed by RL from its ``model/`` equals the warm-started run up to the optimizer state (RL starts a
fresh optimizer from a saved model).

    from mcore_rl.trainer import run_sft
    summary = run_sft("recipes/demo_cpu.yaml", ["sft.total_steps=200"])
    summary.model_dir, summary.test_after
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from mcore_rl.config import ConfigError, RunConfig, load_config
from mcore_rl.logs.plots import reward_plot
from mcore_rl.logs.run_log import RunLog
from mcore_rl.trainer.export import check_model_dir, hf_model_from_checkpoint, lora_adapter_dir
from mcore_rl.trainer.trainer import Trainer

CHECKPOINT_DIR = "sft_checkpoint"


@dataclass(frozen=True)
class SFTSummary:
    """What an SFT run did and where it wrote."""

    steps: int
    """Optimizer steps taken (fewer than ``sft.total_steps`` after an early stop)."""
    first_loss: float
    """Mean response-token loss of the first step."""
    last_loss: float
    """Mean response-token loss of the last step."""
    test_before: float | None
    """Held-out accuracy (``data.test_files``) before SFT; None without test files."""
    test_after: float | None
    """Held-out accuracy after SFT."""
    model_dir: str
    """HF folder of the trained model (``model.path`` of the RL run)."""
    checkpoint_dir: str
    """megatron model checkpoint of the trained model."""
    log_dir: str
    """metrics.jsonl, TensorBoard and the plot."""
    plot: str | None = None
    """The plot written at the end (``logging.plot``); None when off."""


def sft_config(
    config: RunConfig | str | os.PathLike[str], overrides: Sequence[str] = (), max_ranks: int | None = None
) -> RunConfig:
    """The run config of an SFT run: the recipe with ``sft.enable`` on and its RL KL terms off (no RL step
    reads a reference policy, so none is built); refuses one without examples. ``max_ranks``: as
    :func:`~mcore_rl.config.load_config`'s (1 for a run in this process)."""
    if not isinstance(config, RunConfig):
        # loaded as an SFT run, so that an automatic rank count meets the SFT batch rules too
        config = load_config(config, [*overrides, *SFT_RUN], max_ranks=max_ranks)
    if not config.sft.train_files:
        raise ConfigError("sft.train_files: empty; an SFT run needs labelled examples")
    algorithm = dataclasses.replace(config.algorithm, use_kl_loss=False, use_kl_in_reward=False)
    return dataclasses.replace(config, sft=dataclasses.replace(config.sft, enable=True), algorithm=algorithm)


SFT_RUN = ("sft.enable=true", "algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=false")
"""What makes a recipe an SFT run's config (:func:`sft_config`)."""


def fit_sft(trainer: Trainer) -> SFTSummary:
    """Held-out test, SFT, held-out test, then the model (see the module docstring)."""
    cfg = trainer.cfg
    log = RunLog(
        cfg.logging,
        cfg.sft.total_steps,
        progress_stage="sft",
        plot=reward_plot,
        samples=trainer.step.take_val_samples,
    )
    try:
        before = trainer.test(log, "before")
        steps = trainer.sft(log)
        after = trainer.test(log, "after_sft")
        checkpoint_dir, model_dir = export_model(trainer)
    finally:
        plot = log.close()
        trainer.records = log.records
    losses = [float(r["loss"]) for r in log.records if r["stage"] == "sft"]
    return SFTSummary(
        steps, losses[0], losses[-1], before, after, model_dir, checkpoint_dir, cfg.logging.log_dir, plot
    )


def export_model(trainer: Trainer) -> tuple[str, str]:
    """The actor's weights as a megatron checkpoint (collective, any layout) and as an HF folder converted
    from it on the driver (streamed tensor by tensor); returns both paths."""
    checkpoint = os.path.join(trainer.cfg.trainer.default_local_dir, CHECKPOINT_DIR)
    check_model_dir(trainer.cfg)  # before the save: a refusal costs nothing
    trainer.actors.save_model(checkpoint, trainer.cfg.model.asset_folders())  # with LoRA the merged model
    if trainer.cfg.model.lora_rank:  # and the adapter in PEFT format beside it
        trainer.actors.save_lora_adapter(lora_adapter_dir(trainer.cfg), trainer.cfg.model.path)
    return checkpoint, hf_model_from_checkpoint(trainer.cfg, checkpoint)


def run_sft(
    config: RunConfig | str | os.PathLike[str], overrides: Sequence[str] = (), use_ray: bool = True
) -> SFTSummary:
    """An SFT run from a recipe path (+ ``key=value`` overrides) or a checked :class:`RunConfig`."""
    cfg = sft_config(config, overrides, max_ranks=None if use_ray else 1)
    with Trainer.from_config(cfg, use_ray=use_ray) as trainer:
        return fit_sft(trainer)
