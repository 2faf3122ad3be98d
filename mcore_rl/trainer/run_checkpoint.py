"""Run checkpoints that appear complete or not at all, carry a manifest, and are verified before a resume.

    <default_local_dir>/checkpoints/
        global_step_<N>/     the actor's weights and optimizer (every rank's shards), PPO's critic/, the driver
                             state, the pending rollout (one-step-off), config.yaml, hf_assets/ (the
                             tokenizer and generation files: the folder alone is a model), manifest.json (last)
        latest               names the newest complete one

A save (:func:`staged_checkpoint`) fills a hidden staging folder beside the target (the ranks write their
shards into it in place), writes ``config.yaml`` and then the manifest (every file's size and SHA-256), and only
then renames it to ``global_step_<N>`` and points ``latest`` at it, both with signals held back: whatever signal
lands whenever, ``global_step_<N>`` is complete or absent and ``latest`` names a complete checkpoint. A save that
fails (a full disk, no permission) removes its staging folder and leaves the previous checkpoint and
``latest`` as they were (:func:`save_failure` says why, in one line; ``trainer.on_save_failure`` decides
whether the run goes on).

Before any worker starts, a resume verifies the checkpoint (:func:`verify_run_checkpoint`): the manifest's sizes
and checksums, megatron's metadata and every data file it names. With ``trainer.resume_mode=auto`` a damaged
newest checkpoint is named and the newest older one that verifies is used instead (:func:`resume_point`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from safetensors.torch import load_file, save_file

from mcore_rl.agent.rollout import MultiTurnOutput
from mcore_rl.config import ConfigError, RunConfig
from mcore_rl.config.run_folder import (
    LATEST,
    checkpoint_root,
    point_latest_at,
    prune_checkpoints,
    resume_checkpoint,
    saved_steps,
)
from mcore_rl.data.prompts import PromptLoader
from mcore_rl.data.rows import DataError
from mcore_rl.engine.checkpoint import HF_ASSETS_DIR
from mcore_rl.io.errors import InputError, OutputError, note
from mcore_rl.io.inputs import input_file
from mcore_rl.io.manifest import has_manifest, verify_manifest, write_manifest
from mcore_rl.io.output import OutputFolder, write_failure
from mcore_rl.io.side_files import copy_model_assets
from mcore_rl.io.signals import signals_deferred
from mcore_rl.types import RolloutBatch

CRITIC_DIR = "critic"  # engine/workers/critic.py writes PPO's critic there


@dataclass(frozen=True)
class ResumePoint:
    """The run checkpoint a run continues from, checked against the run before anything is written."""

    path: str
    step: int
    state: dict[str, Any]
    """The driver state saved beside the weights (``Trainer.save``)."""


def resume_point(cfg: RunConfig, loader: PromptLoader) -> ResumePoint | None:
    """The checkpoint ``trainer.resume_mode`` names, verified, with ``loader`` at its data position; refuses
    one saved for another model or other training data, naming what changed (None: a fresh run). With
    ``resume_mode=auto`` a damaged newest checkpoint is named and the newest older one that verifies is used."""
    path = resume_checkpoint(cfg)
    if path is None:
        return None
    damage = _damage(path, whole=False)
    if damage is None:
        point = _checked_point(cfg, loader, path)  # a changed model or data is refused before the files
        damage = _damage(path, whole=True)
        if damage is None:
            return point
    if cfg.trainer.resume_mode != "auto":
        raise damage
    return _checked_point(cfg, loader, _previous_intact(cfg, path, damage))


def _damage(path: str, whole: bool) -> InputError | None:
    """What makes ``path`` unusable: its driver state unreadable, or (``whole``) any file missing or altered."""
    from mcore_rl.engine.trainer_checkpoint import read_trainer_state

    try:
        verify_run_checkpoint(path) if whole else read_trainer_state(path)
    except InputError as err:
        return err
    return None


def _checked_point(cfg: RunConfig, loader: PromptLoader, path: str) -> ResumePoint:
    """``path``'s driver state, checked against this run (layout, model, data), with ``loader`` at its data
    position."""
    from mcore_rl.engine.trainer_checkpoint import check_lora_matches, read_trainer_state

    step, saved_tp, saved = read_trainer_state(path)
    check_lora_matches(path, cfg.model.lora_spec())  # the same adapters (or none), before any worker starts
    tp = cfg.parallel.tensor_model_parallel_size
    if saved_tp != tp:  # checked here, before any worker starts (the optimizer state is saved per TP shard)
        raise ConfigError(
            f"{path}: saved at parallel.tensor_model_parallel_size={saved_tp}, this run sets {tp}; resume at "
            f"{saved_tp} (data-parallel and pipeline sizes may change), or start a new run in another "
            f"trainer.default_local_dir with model.path={path} (its weights at any layout, a fresh optimizer)"
        )
    _check_run_state(cfg, path, saved)
    model = cfg.model.hf_config_dict()
    changed = sorted(k for k in {**saved["model"], **model} if saved["model"].get(k) != model.get(k))
    if changed:
        raise ConfigError(f"{path}: saved for another model (config.json differs in {changed}); not resuming")
    try:
        loader.load_state_dict(saved["loader"])
    except DataError as err:
        raise DataError(
            f"{path}: {err}; not resuming (resume with the data it was saved with, or start a new run in "
            "another trainer.default_local_dir)"
        ) from None
    return ResumePoint(path, step, saved)


def _check_run_state(cfg: RunConfig, path: str, saved: dict[str, Any]) -> None:
    """The driver state an RL run checkpoint carries (``Trainer.save``), and the algorithm's models and state
    that this run will load from it: refused in one line before any worker starts (a DPO checkpoint, an edited
    ``trainer_state.json``, PPO resumed from a GRPO run or with the KL controller switched on)."""
    from mcore_rl.algo.settings import AdvEstimator
    from mcore_rl.engine.trainer_checkpoint import TRAINER_STATE_FILE

    state_file = os.path.join(path, TRAINER_STATE_FILE)
    for key in ("model", "loader"):
        if not isinstance(saved.get(key), dict):
            raise ConfigError(f"{state_file}: extra.{key} must be an object (not an RL run checkpoint?)")
    algorithm = saved.get("algorithm", {})
    if not isinstance(algorithm, dict):
        raise ConfigError(f"{state_file}: extra.algorithm must be an object, got {algorithm!r}")
    gae = cfg.algorithm.adv_estimator == AdvEstimator.GAE
    if gae and not os.path.isdir(os.path.join(path, CRITIC_DIR)):
        raise ConfigError(
            f"{path}: saved without a critic (not a PPO run), so algorithm.adv_estimator=gae cannot resume it"
        )
    if gae and cfg.algorithm.use_kl_in_reward and "kl_ctrl" not in algorithm:
        raise ConfigError(
            f"{path}: saved without algorithm.use_kl_in_reward's KL controller; resume with "
            "algorithm.use_kl_in_reward=false, or start a new run in another trainer.default_local_dir"
        )


def verify_run_checkpoint(path: str) -> None:
    """A run checkpoint whose files are all there and as saved: its manifest (sizes and SHA-256; checkpoints
    written before manifests have none), megatron's metadata and every data file it names (the critic's too);
    raises an :class:`InputError` naming the first file that is missing, truncated or altered."""
    from mcore_rl.engine.checkpoint import check_checkpoint_folder
    from mcore_rl.engine.trainer_checkpoint import read_trainer_state

    read_trainer_state(path)  # a missing folder names a previous save a killed swap moved aside
    if has_manifest(path):
        verify_manifest(path)
    check_checkpoint_folder(path)
    critic = os.path.join(path, CRITIC_DIR)
    if os.path.isdir(critic):
        check_checkpoint_folder(critic)


def _previous_intact(cfg: RunConfig, damaged: str, err: InputError) -> str:
    """The newest checkpoint older than ``damaged`` that verifies (a note says which and why); ``err`` when
    there is none."""
    newest = next(
        (s for s, p in reversed(saved_steps(cfg)) if os.path.realpath(p) == os.path.realpath(damaged)), None
    )
    for step, path in reversed(saved_steps(cfg)):
        if (newest is not None and step >= newest) or os.path.realpath(path) == os.path.realpath(damaged):
            continue
        if _damage(path, whole=True) is not None:
            continue
        note(f"{damaged} cannot be resumed ({err}); resuming from {path}, the newest intact checkpoint")
        return path
    raise err


@contextlib.contextmanager
def staged_checkpoint(cfg: RunConfig, step: int, path: str) -> Iterator[str]:
    """A staging folder for the run checkpoint of ``step`` at ``path``; when the block ends without error its
    manifest is written, it is renamed to ``path`` and ``latest`` points at it; then older checkpoints beyond
    ``trainer.max_ckpt_to_keep`` are removed, outside the save (a folder that will not go is a note, not a
    failed save). An error removes the staging folder and leaves everything else as it was."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _clean_other_steps(os.path.dirname(path), path)
    output = OutputFolder.plan(path, flag="run checkpoint", replace_ours=True, kind="run-checkpoint")
    staging = output.begin()
    try:
        yield staging
        copy_model_assets(*cfg.model.asset_folders(), os.path.join(staging, HF_ASSETS_DIR))
        write_manifest(staging)
        with signals_deferred():  # the folder and `latest` change together, or neither does
            output.commit()
            point_latest_at(cfg, step)
    except BaseException:
        output.abort()
        raise
    prune_checkpoints(cfg, step)  # signals no longer held: removing gigabytes may take a while


def _clean_other_steps(root: str, path: str) -> None:
    """What killed saves of *other* steps left in ``root`` (a staging folder, a moved-aside checkpoint to put
    back), cleaned as each step's own next save would: a run resumed from an earlier checkpoint may never save
    that step again, and a staging folder can hold a whole checkpoint's bytes."""
    steps = {m.group(1) for m in map(_STALE_STEP.match, os.listdir(root)) if m is not None}
    for step in sorted(steps - {os.path.basename(path)}):
        try:
            OutputFolder.plan(
                os.path.join(root, step), replace_ours=True, kind="run-checkpoint"
            ).clean_stale()
        except (OutputError, OSError):  # a folder that is not ours to touch: left as it is
            continue


_STALE_STEP = re.compile(r"^\.(global_step_\d+)\.mcore_rl-(?:staging|old)-\d+-[0-9a-f]{8}$")


def save_failure(err: BaseException, folder: str) -> str | None:
    """Why a save into ``folder`` failed, in one line, when the run can go on without it: the filesystem refused
    a write (a full disk, a quota, no permission) on the driver or on every rank alike, so the ranks are still
    usable. None when it cannot (a lost or hung worker, a rank that failed alone, a bug: raised as it is)."""
    from mcore_rl.io.checkpoint_read import checkpoint_failure

    cause: BaseException | None = err
    if hasattr(err, "kind"):  # controller.WorkerError
        if getattr(err, "kind", None) != "raised" or not getattr(err, "group_alive", False):
            return None
        cause = getattr(err, "cause", None)
    if cause is not None and type(cause).__name__ == "CheckpointException":
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(cause, "failures", {}).values()]
        cause = checkpoint_failure(cause) or (failures[0] if failures else cause)
    if isinstance(cause, OutputError):  # a folder we may not replace
        return str(cause)
    return None if cause is None else write_failure(cause, folder)


def latest_checkpoint(cfg: RunConfig) -> str | None:
    """The checkpoint ``latest`` names now (the one a failed save leaves intact), or None."""
    latest = os.path.join(checkpoint_root(cfg), LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return os.path.join(checkpoint_root(cfg), f.read().strip())


# --- one-step-off: the rollout generated ahead --------------------------------------------------------------
PENDING_ROLLOUT_FILE = "pending_rollout.safetensors"
PENDING_TURNS_FILE = "pending_turns.json"
"""Beside a multi-turn pending rollout: its conversations, tool rewards and score texts (JSON data)."""


def save_pending(folder: str, rollout: RolloutBatch, turns: MultiTurnOutput | None) -> None:
    """The next step's rollout, generated before this checkpoint's update (safetensors: data only), and a
    multi-turn rollout's conversations beside it."""
    tensors = {k: v for k, v in dataclasses.asdict(rollout).items() if v is not None}
    save_file(tensors, os.path.join(folder, PENDING_ROLLOUT_FILE))
    if turns is not None:
        with open(os.path.join(folder, PENDING_TURNS_FILE), "w") as f:
            json.dump(turns.state(), f, default=str)  # a message's odd value is only logged: kept as text


def load_pending(folder: str, multi_turn: bool) -> tuple[RolloutBatch, MultiTurnOutput | None]:
    """:func:`save_pending`'s files back; one that is missing, or a link out of the folder, is refused naming it."""
    rollout_file = input_file(folder, PENDING_ROLLOUT_FILE, required=False)
    if rollout_file is None:
        raise ValueError(f"{folder}: the checkpoint names pending prompts but has no {PENDING_ROLLOUT_FILE}")
    rollout = RolloutBatch(**load_file(rollout_file))
    if not multi_turn:
        return rollout, None
    turns_file = input_file(folder, PENDING_TURNS_FILE, required=False)
    if turns_file is None:
        raise ValueError(
            f"{folder}: a multi-turn run's pending rollout has no {PENDING_TURNS_FILE} (its conversations); "
            "was the checkpoint saved with rollout.multi_turn.enable=false?"
        )
    with open(turns_file) as f:
        try:
            return rollout, MultiTurnOutput.from_state(json.load(f), rollout)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{turns_file}: not the conversations of the pending rollout ({err})") from None
