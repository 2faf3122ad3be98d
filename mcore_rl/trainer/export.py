"""The model at the end of a run, as an HF folder (safetensors, ``config.json``, tokenizer files) at
``<trainer.default_local_dir>/model``: what ``model.path`` of a next run, ``mcore-rl eval`` or transformers
load. SFT, RL (here) and DPO (``mcore_rl/dpo/trainer.py``) runs all end with it.

    actor's weights --collective save (any layout)--> megatron model checkpoint --convert, streamed--> model/

The megatron checkpoint is the run's last run checkpoint when it has just written one (``trainer.save_freq``;
a run checkpoint holds the model's keys), SFT's ``sft_checkpoint/``, or else one written for the export and
removed after it. A LoRA run writes ``model/`` merged (``TrainEngine.save_model``; its run checkpoints hold the
adapters only) and its adapter in PEFT format as ``lora_adapter/``. ``model/`` is replaced only when it is an
earlier export of ours
(:func:`~mcore_rl.convert.export.check_export_folder`), checked before anything is saved.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from mcore_rl.config import RunConfig
from mcore_rl.config.run_folder import checkpoint_name, checkpoint_root
from mcore_rl.convert.export import MODEL_DIR, check_export_folder, export_hf_model
from mcore_rl.engine.hf.peft import ADAPTER_DIR

if TYPE_CHECKING:
    from mcore_rl.trainer.trainer import Trainer

EXPORT_CHECKPOINT = ".model_export_checkpoint"
"""The model checkpoint written for an export when the run has none of its last step (removed after)."""


def model_dir(cfg: RunConfig) -> str:
    return os.path.join(cfg.trainer.default_local_dir, MODEL_DIR)


def check_model_dir(cfg: RunConfig) -> None:
    """Refuse a ``model/`` (and with LoRA a ``lora_adapter/``) in the run folder that an export would replace
    but is not ours."""
    check_export_folder(model_dir(cfg))
    if cfg.model.lora_rank:
        check_export_folder(lora_adapter_dir(cfg))


def lora_adapter_dir(cfg: RunConfig) -> str:
    """Where a LoRA run writes its adapter in PEFT format."""
    return os.path.join(cfg.trainer.default_local_dir, ADAPTER_DIR)


def hf_model_from_checkpoint(cfg: RunConfig, checkpoint: str) -> str:
    """Convert the megatron ``checkpoint`` of the run's model into ``<default_local_dir>/model``, with the
    run's ``config.json`` (``model.hf_config`` merged in), its tokenizer and generation files; returns the folder."""
    return export_hf_model(checkpoint, model_dir(cfg), cfg.model.hf_config_dict(), cfg.model.asset_folders())


def export_run_model(cfg: RunConfig, save_model: Callable[[str], None], checkpoint: str | None) -> str:
    """``<default_local_dir>/model`` from ``checkpoint`` (the run checkpoint written at the last step), or
    from a model checkpoint ``save_model(folder)`` writes into the run folder, removed after. Returns it."""
    if checkpoint is not None and os.path.isdir(checkpoint):
        return hf_model_from_checkpoint(cfg, checkpoint)
    check_model_dir(cfg)  # before the save: a refusal costs nothing
    staging = os.path.join(cfg.trainer.default_local_dir, EXPORT_CHECKPOINT)
    try:
        save_model(staging)
        return hf_model_from_checkpoint(cfg, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_rl_model(trainer: Trainer) -> str:
    """The end of an RL run (``Trainer.fit`` at ``total_steps``): the actor as ``model/``, from the run
    checkpoint of the last step when ``trainer.save_freq`` wrote one (it always does at the last step)."""
    cfg = trainer.cfg
    saved = cfg.trainer.save_freq > 0 and not cfg.model.lora_rank  # a LoRA run checkpoint: adapters only
    last = os.path.join(checkpoint_root(cfg), checkpoint_name(trainer.global_step)) if saved else None
    if cfg.model.lora_rank:  # the adapter in PEFT format beside the merged model
        check_model_dir(cfg)
        trainer.actors.save_lora_adapter(lora_adapter_dir(cfg), cfg.model.path)
    return export_run_model(cfg, trainer.actors.save_model, last)
