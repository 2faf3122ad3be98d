"""Where a run writes: its folder (logs, run checkpoints, the resolved config) claimed before anything runs."""

from __future__ import annotations

import os
import shutil

from mcore_rl.config.run import RunConfig
from mcore_rl.io.output import claim_run_folder, is_ours


def claim_run_folders(cfg: RunConfig) -> None:
    """Refuse a run folder (or a log folder outside it) that would write over what is not ours: the current
    directory, home, an input, or an existing folder another tool wrote (see mcore_rl.io.claim_run_folder)."""
    inputs = [
        cfg.model.path,
        cfg.model.tokenizer_path,
        cfg.reward_model.path,
        *cfg.data.train_files,
        *cfg.data.val_files,
        *cfg.data.test_files,
        *cfg.sft.train_files,
        *cfg.dpo.train_files,
        *cfg.dpo.val_files,
    ]
    run = claim_run_folder(cfg.trainer.default_local_dir, flag="trainer.default_local_dir", inputs=inputs)
    log_dir = os.path.realpath(cfg.logging.log_dir)
    if not (log_dir == run or log_dir.startswith(run + os.sep)):
        claim_run_folder(cfg.logging.log_dir, flag="logging.log_dir", inputs=inputs, kind="logs")


# --- run checkpoints: <default_local_dir>/checkpoints/global_step_<N>, and `latest` naming the newest ----------
LATEST = "latest"


def checkpoint_root(cfg: RunConfig) -> str:
    return os.path.join(cfg.trainer.default_local_dir, "checkpoints")


def checkpoint_name(step: int) -> str:
    return f"global_step_{step}"


def publish_checkpoint(cfg: RunConfig, step: int) -> None:
    """After a complete save: point ``latest`` at it (atomically), then drop checkpoints beyond the last
    ``trainer.max_ckpt_to_keep`` -- only folders carrying our marker, never a user's own ``global_step_N``."""
    root = checkpoint_root(cfg)
    staging = os.path.join(root, f".{LATEST}.tmp")
    with open(staging, "w") as f:
        f.write(checkpoint_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, os.path.join(root, LATEST))
    keep = cfg.trainer.max_ckpt_to_keep
    names = [n for n in os.listdir(root) if n.startswith("global_step_") and n[12:].isdigit()]
    for old in sorted(names, key=lambda n: int(n[12:]))[:-keep] if keep else []:
        folder = os.path.join(root, old)
        if is_ours(folder):
            shutil.rmtree(folder)


def resume_checkpoint(cfg: RunConfig) -> str | None:
    """The checkpoint ``trainer.resume_mode`` names: ``resume_from_path``, the one ``latest`` names (auto), or
    None (disable, or auto with nothing saved yet)."""
    mode = cfg.trainer.resume_mode
    if mode == "resume_path":
        return cfg.trainer.resume_from_path
    latest = os.path.join(checkpoint_root(cfg), LATEST)
    if mode == "auto" and os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(checkpoint_root(cfg), f.read().strip())
    return None
