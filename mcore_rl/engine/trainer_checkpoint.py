"""Resumable training checkpoints: model weights, optimizer state and the step, in megatron's torch_dist format.

A training checkpoint is a model checkpoint (``checkpoint.py``: the same ``model`` keys, so conversion and
:func:`~mcore_rl.engine.checkpoint.load_model` read it too) plus the optimizer's state under ``optimizer``, in
megatron's ``fully_reshardable`` layout: the distributed optimizer's flat shards are written as per-parameter
tensors, so a run can resume at another data-parallel or pipeline size (tested: exact). Changing the tensor
parallel size is refused: the optimizer state does not come back exact across TP (measured 1.3e-2 drift after one
step from TP2 to TP1), so resume at the saved TP, or load the weights alone (``TrainEngine.load_model``). The
step, the layout and the caller's own counters go into ``trainer_state.json``.

Writes are crash-safe: everything goes to ``<dir>.tmp-<step>`` first and is renamed into place only once every
rank has finished, so an interrupted save never half-overwrites the previous checkpoint (killed during the
final swap, the previous one is left at ``<dir>.old``).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.engine.checkpoint import (
    ModelCheckpointInfo,
    load_model_state,
    save_strategy,
    sharded_state_dict,
)

TRAINER_STATE_FILE = "trainer_state.json"
_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _state(engine: Any, is_loading: bool) -> dict[str, Any]:
    state = sharded_state_dict(engine.chunks)
    model_state = state["model"] if len(state) == 1 else dict(state)  # before "optimizer" joins it
    state["optimizer"] = engine.optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata=_SHARDING
    )
    return state


def save_training_checkpoint(
    engine: Any, directory: str, step: int, extra: dict[str, Any] | None = None
) -> None:
    """Collective: model + optimizer + ``step`` (and ``extra``, JSON) of a
    :class:`~mcore_rl.engine.train_engine.TrainEngine` into ``directory``, replacing it atomically."""
    from megatron.core import dist_checkpointing

    staging = f"{directory.rstrip('/')}.tmp-{step}"
    if engine.ctx.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    _materialise_optimizer_state(engine)  # a run may checkpoint before its first step
    dist_checkpointing.save(_state(engine, is_loading=False), staging, sharded_strategy=save_strategy())
    if engine.ctx.rank == 0:
        ModelCheckpointInfo.for_arch(engine.arch, engine.config.params_dtype).write(staging)
        with open(os.path.join(staging, TRAINER_STATE_FILE), "w") as f:
            layout = {
                "tensor_parallel_size": engine.ctx.tp_size,
                "pipeline_parallel_size": engine.ctx.pp_size,
            }
            json.dump({"step": step, "layout": layout, "extra": extra or {}}, f, indent=2, sort_keys=True)
        _replace(staging, directory)
    dist.barrier()


def _replace(staging: str, directory: str) -> None:
    """``staging`` becomes ``directory``; an existing one is moved aside first and removed only afterwards."""
    previous = f"{directory.rstrip('/')}.old"
    if os.path.exists(directory):
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(directory, previous)
    os.rename(staging, directory)
    shutil.rmtree(previous, ignore_errors=True)


def load_training_checkpoint(engine: Any, directory: str) -> tuple[int, dict[str, Any]]:
    """Collective: restore model weights and optimizer state saved by :func:`save_training_checkpoint` (same
    TP, any DP or PP size); returns ``(step, extra)``."""
    from megatron.core import dist_checkpointing

    state_file = os.path.join(directory, TRAINER_STATE_FILE)
    if not os.path.isfile(state_file):
        raise FileNotFoundError(f"{directory}: not a training checkpoint (no {TRAINER_STATE_FILE})")
    with open(state_file) as f:
        trainer_state = json.load(f)
    saved_tp = trainer_state["layout"]["tensor_parallel_size"]
    if saved_tp != engine.ctx.tp_size:
        raise ValueError(
            f"{directory}: saved at tensor_parallel_size={saved_tp}, this run has {engine.ctx.tp_size}; resume at "
            "the saved tensor_parallel_size (any data-parallel or pipeline size), or load the weights alone "
            "with TrainEngine.load_model"
        )
    _materialise_optimizer_state(engine)
    loaded = dist_checkpointing.load(_state(engine, is_loading=True), directory)
    load_model_state(engine.chunks, loaded, directory)
    engine.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(engine)
    return int(trainer_state["step"]), dict(trainer_state["extra"])


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
