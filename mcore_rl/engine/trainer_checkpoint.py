"""Resumable training checkpoints: model weights, optimizer state and the step, in megatron's torch_dist format.

A training checkpoint is a model checkpoint (``checkpoint.py``: the same ``model`` keys, so conversion and
:func:`~mcore_rl.engine.checkpoint.load_model` read it too) plus the optimizer's state under ``optimizer``, in
megatron's ``fully_reshardable`` layout: the distributed optimizer's flat shards are written as per-parameter
tensors, so a run can resume at another data-parallel or pipeline size (tested: exact). Changing the tensor
parallel size is refused: the optimizer state does not come back exact across TP (measured 1.3e-2 drift after one
step from TP2 to TP1), so resume at the saved TP, or load the weights alone (``TrainEngine.load_model``). The
step, the layout and the caller's own counters go into ``trainer_state.json``. With LoRA the checkpoint holds the
adapters and their optimizer state only (the frozen base is the run's ``model.path``), and ``trainer_state.json``
records the adapters' shape: a resume with other adapters, or none, is refused naming the file.

Writes are crash-safe and touch nothing but our own folders (:class:`~mcore_rl.io.output.OutputFolder`):
everything goes to a staging folder named ``.<dir>.mcore_rl-staging-<pid>-<token>`` and is renamed into place
only once every rank has finished, so an interrupted save never half-overwrites the previous checkpoint, and
the next save cleans what a killed one left (restoring the previous checkpoint if the kill fell between the
two renames of the swap). A folder at ``<dir>`` that is not one of our checkpoints is never replaced; the
user's ``<dir>.old`` or ``<dir>.tmp-<step>`` are never touched. A staging folder of someone else's
(:func:`~mcore_rl.io.output.is_staging_folder`: the driver assembling a run checkpoint with more beside the
weights) is written in place instead, and its owner publishes it. Loading treats the folder as untrusted data
(restricted unpickling, ``weights_only`` objects; :mod:`mcore_rl.io.checkpoint_read`) and names what is wrong
with it before megatron reads it: a missing folder (pointing at the previous save a killed swap moved aside), a
missing or truncated file, a checkpoint of another model (the field that differs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from mcore_rl.engine.checkpoint import (
    ADAPTERS_ONLY,
    ModelCheckpointInfo,
    StateFilter,
    check_checkpoint_folder,
    check_same_model,
    load_model_state,
    quiet_staging_warning,
    save_strategy,
    sharded_state_dict,
)
from mcore_rl.engine.lora import adapters_only
from mcore_rl.engine.lora_spec import LoRASpec
from mcore_rl.io.checkpoint_read import safe_dcp_loading
from mcore_rl.io.collective import abort_collective, begin_collective, commit_collective
from mcore_rl.io.errors import ConfigError, InputError
from mcore_rl.io.inputs import input_file, read_json_object
from mcore_rl.io.output import OutputFolder, interrupted_swap, is_staging_folder

TRAINER_STATE_FILE = "trainer_state.json"
_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _state(engine: Any, is_loading: bool) -> dict[str, Any]:
    state = sharded_state_dict(engine.chunks, _part(engine))
    model_state = state["model"] if len(state) == 1 else dict(state)  # before "optimizer" joins it
    state["optimizer"] = engine.optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata=_SHARDING
    )
    return state


def save_training_checkpoint(
    engine: Any,
    directory: str,
    step: int,
    extra: dict[str, Any] | None = None,
    side_files: Callable[[str], None] | None = None,
) -> None:
    """Collective: model + optimizer + ``step`` (and ``extra``, JSON) of a
    :class:`~mcore_rl.engine.train_engine.TrainEngine` into ``directory``, replacing it atomically;
    ``side_files(folder)`` runs on rank 0 last, before the folder is published (a config, a manifest)."""
    from megatron.core import dist_checkpointing

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    state = {"step": step, "layout": _layout(engine), "extra": extra or {}}
    lora = engine.options.lora
    if lora is not None:  # the adapters and their optimizer only: the base is model.path's
        state["lora"] = lora.to_json()
    encoded = json.dumps(state, indent=2, sort_keys=True)  # a non-JSON extra fails here, before writing
    quiet_staging_warning()

    def finish(folder: str) -> None:
        extra_info = {ADAPTERS_ONLY: state["lora"]} if lora is not None else {}
        ModelCheckpointInfo.for_arch(engine.arch, engine.config.params_dtype, **extra_info).write(folder)
        with open(os.path.join(folder, TRAINER_STATE_FILE), "w") as f:
            f.write(encoded + "\n")
        if side_files is not None:
            side_files(folder)

    if is_staging_folder(directory):  # the caller's staging folder: filled here, published by its owner
        _materialise_optimizer_state(engine)
        dist_checkpointing.save(_state(engine, is_loading=False), directory, sharded_strategy=save_strategy())
        if engine.ctx.rank == 0:
            finish(directory)
        return
    output, staging = begin_collective(
        lambda: OutputFolder.plan(
            directory, flag="checkpoint folder", replace_ours=True, kind="training-checkpoint"
        ),
        engine.ctx.rank,
    )
    try:
        _materialise_optimizer_state(engine)  # a run may checkpoint before its first step
        dist_checkpointing.save(_state(engine, is_loading=False), staging, sharded_strategy=save_strategy())
    except BaseException:
        abort_collective(output, engine.ctx.rank)
        raise
    commit_collective(output, engine.ctx.rank, lambda: finish(staging))


def _layout(engine: Any) -> dict[str, int]:
    return {"tensor_parallel_size": engine.ctx.tp_size, "pipeline_parallel_size": engine.ctx.pp_size}


def read_trainer_state(directory: str) -> tuple[int, int, dict[str, Any]]:
    """``(step, saved tensor_parallel_size, extra)`` from :data:`TRAINER_STATE_FILE`, every field checked."""
    if not os.path.isdir(directory):
        aside = interrupted_swap(directory)
        if aside is not None:
            raise InputError(
                f"{directory}: missing; a save killed while replacing it left the previous checkpoint at {aside} "
                f"(the next save into {directory} puts it back, or rename it to {directory})"
            )
        raise InputError(f"{directory}: no such checkpoint folder")
    if not os.path.lexists(os.path.join(directory, TRAINER_STATE_FILE)):
        raise InputError(f"{directory}: not a training checkpoint (no {TRAINER_STATE_FILE})")
    path = str(input_file(directory, TRAINER_STATE_FILE))
    state = read_json_object(path)
    step, layout, extra = state.get("step"), state.get("layout"), state.get("extra", {})
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{path}: step must be an integer >= 0, got {step!r}")
    if not isinstance(layout, dict):
        raise ConfigError(f"{path}: layout must be an object, got {layout!r}")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = layout.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{path}: layout.{key} must be a positive integer, got {value!r}")
    if not isinstance(extra, dict):
        raise ConfigError(f"{path}: extra must be an object, got {extra!r}")
    return step, layout["tensor_parallel_size"], extra


def load_training_checkpoint(engine: Any, directory: str) -> tuple[int, dict[str, Any]]:
    """Collective: restore model weights and optimizer state saved by :func:`save_training_checkpoint` (same
    TP, any DP or PP size); returns ``(step, extra)``."""
    from megatron.core import dist_checkpointing

    step, saved_tp, extra = read_trainer_state(directory)
    check_checkpoint_folder(directory)
    check_same_model(directory, engine.arch)
    if saved_tp != engine.ctx.tp_size:
        raise ValueError(
            f"{directory}: saved at tensor_model_parallel_size={saved_tp}, this run has {engine.ctx.tp_size}; resume "
            "at the saved tensor_model_parallel_size (any data-parallel or pipeline size), or load the weights alone "
            "with TrainEngine.load_model"
        )
    check_lora_matches(directory, engine.options.lora)
    _materialise_optimizer_state(engine)
    with safe_dcp_loading(directory):
        loaded = dist_checkpointing.load(_state(engine, is_loading=True), directory)
    load_model_state(engine.chunks, loaded, directory, _part(engine))
    _restore_a_zero_step(loaded["optimizer"])
    engine.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(engine)
    return step, extra


def _restore_a_zero_step(state: Any) -> None:
    """megatron saves torch Adam's per-parameter ``step`` as one ``common_step`` only when it is nonzero
    (``if step:``): a checkpoint saved before the first optimizer step (a PPO actor frozen for the critic's
    warm-up, a preemption then) has moments without steps, which torch's Adam refuses to load (KeyError 'step').
    Their step was 0: each torch optimizer state (``state`` and ``param_groups``) missing it gets it back."""
    if isinstance(state, list | tuple):
        for part in state:
            _restore_a_zero_step(part)
        return
    if not isinstance(state, dict):
        return
    per_param = state.get("state")
    if "param_groups" in state and isinstance(per_param, dict) and "common_step" not in per_param:
        moments = [v for v in per_param.values() if isinstance(v, dict) and "exp_avg" in v]
        if moments and not any("step" in v for v in moments):
            per_param["common_step"] = torch.tensor(0.0)
    for value in state.values():
        if isinstance(value, dict | list | tuple):
            _restore_a_zero_step(value)


def _part(engine: Any) -> StateFilter | None:
    """With LoRA a run checkpoint holds the adapters (and their optimizer) only: the base never changes."""
    return adapters_only if engine.options.lora is not None else None


def check_lora_matches(directory: str, ours: LoRASpec | None) -> None:
    """A resume needs the adapters the checkpoint was saved with (or none on both sides)."""
    path = os.path.join(directory, TRAINER_STATE_FILE)
    saved = read_json_object(path).get("lora")
    if saved is None and ours is None:
        return
    if saved is None:
        raise InputError(
            f"{path}: saved without LoRA, this run has model.lora_rank={ours.rank}; resume it with "  # type: ignore[union-attr]
            "model.lora_rank=0, or start a LoRA run from its model (trainer.resume_mode=disable)"
        )
    if ours is None:
        raise InputError(
            f"{path}: saved with LoRA (model.lora_rank={saved.get('rank')!r}), this run has none"
        )
    mine = ours.to_json()
    for field, key in (("rank", "lora_rank"), ("alpha", "lora_alpha"), ("targets", "target_modules")):
        if saved.get(field) != mine[field]:
            raise InputError(
                f"{path}: saved with model.{key}={saved.get(field)!r}, this run has {mine[field]!r}"
            )


def _unshare_adam_steps(engine: Any) -> None:
    """megatron-core 0.16.1 restores torch AdamW's per-parameter ``step`` (its path without Apex/TE) as ONE
    tensor shared by every parameter; AdamW increments it in place once per parameter, so after a resume
    every later step used a wrong bias correction (measured: 2.6e-3 weight drift after one step at lr 1e-2).
    Each parameter gets its own copy."""
    for optimizer in engine.optimizers:
        for state in optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


@torch.no_grad()
def _materialise_optimizer_state(engine: Any) -> None:
    """torch's AdamW creates its state (moments, step) lazily at the first step, and megatron's checkpointing
    needs it to exist. One step on zero gradients at lr 0 and no weight decay creates it and changes no
    parameter; zero moments with ``step`` reset to 0 are exactly AdamW's fresh state, so a later first step is
    unchanged (and a load overwrites every value anyway)."""
    for optimizer in engine.optimizers:
        inner = optimizer.optimizer
        if inner.state:
            continue
        saved = [(group["lr"], group["weight_decay"]) for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
            for param in group["params"]:
                param.grad = torch.zeros_like(param) if param.numel() else None
        inner.step()
        inner.zero_grad(set_to_none=True)
        for state in inner.state.values():
            state["step"] = torch.zeros_like(state["step"])
        for group, (lr, weight_decay) in zip(inner.param_groups, saved, strict=True):
            group["lr"], group["weight_decay"] = lr, weight_decay
