"""A trained model as an HF folder at the end of a run (SFT, RL, DPO): a megatron model checkpoint converted
with the run's ``config.json`` and tokenizer files, into a folder that is replaced only when it is an earlier
export of ours.

    export_hf_model(checkpoint, "<run>/model", hf_config, cfg.model.asset_folders())   # -> "<run>/model"

The drivers choose the checkpoint and the folder (``mcore_rl/trainer/export.py``, ``mcore_rl/dpo/trainer.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from mcore_rl.convert.mcore_to_hf import McoreToHfOptions, convert_mcore_to_hf
from mcore_rl.io.errors import OutputError
from mcore_rl.io.output import is_ours
from mcore_rl.io.side_files import copy_model_assets

MODEL_DIR = "model"
"""The HF folder of a run, under ``trainer.default_local_dir``."""


def check_export_folder(out: str) -> None:
    """Refuse ``out`` when an export would replace something that is not an earlier export of ours."""
    if os.path.lexists(out) and not (os.path.isdir(out) and (is_ours(out) or not os.listdir(out))):
        raise OutputError(
            f"{out}: exists and is not a model this tool exported; the run's model is written there at the "
            "end: move it away"
        )


def export_hf_model(
    checkpoint: str, out: str, hf_config: dict[str, Any], asset_folders: tuple[str | None, str | None]
) -> str:
    """Convert the megatron ``checkpoint`` into the HF folder ``out`` with ``hf_config`` as its
    ``config.json``, the tokenizer files of ``asset_folders``' tokenizer folder and the model's
    ``generation_config.json`` (its stop ids: from the model folder when the tokenizer folder has none), the
    pair ``ModelConfig.asset_folders`` gives; returns ``out``'s path."""
    check_export_folder(out)
    with tempfile.TemporaryDirectory(prefix="mcore_rl_model_assets_") as assets:
        # config.json of the run's model, its tokenizer and generation files, so that model.path alone
        # describes it.
        with open(os.path.join(assets, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        copy_model_assets(*asset_folders, assets)
        options = McoreToHfOptions(ckpt=checkpoint, out=out, hf_config_from=assets, overwrite=True)
        return convert_mcore_to_hf(options)
