"""Where a run writes: its folder (logs, run checkpoints, the resolved config), checked before anything is
written (:func:`check_run_folders`) and claimed once every other start-up check has passed
(:func:`claim_run_folders`), so that a refused run leaves no trace."""

from __future__ import annotations

import os
import shutil

from mcore_rl.config.run import ResumeMode, RunConfig
from mcore_rl.io.errors import OutputError, note
from mcore_rl.io.output import check_run_folder, claim_run_folder, is_ours
from mcore_rl.logs.run_log import previous_log, read_records


def check_run_folders(cfg: RunConfig) -> None:
    """Refuse, writing nothing, a run folder (or a log folder outside it) that would write over what is not
    ours: the current directory, home, an input, or an existing folder another tool wrote (see
    mcore_rl.io.claim_run_folder); and a fresh run over an earlier run's ``metrics.jsonl`` or run checkpoints
    (see :func:`_refuse_replacing_log`, :func:`_refuse_replacing_checkpoints`)."""
    inputs = _inputs(cfg)
    run = check_run_folder(cfg.trainer.default_local_dir, flag="trainer.default_local_dir", inputs=inputs)
    if not is_inside(cfg.logging.log_dir, run):
        check_run_folder(cfg.logging.log_dir, flag="logging.log_dir", inputs=inputs)
    _refuse_replacing_log(cfg)
    _refuse_replacing_checkpoints(cfg)


def claim_run_folders(cfg: RunConfig) -> None:
    """:func:`check_run_folders`, then create the run folder (and a log folder outside it) with our marker."""
    check_run_folders(cfg)
    inputs = _inputs(cfg)
    run = claim_run_folder(cfg.trainer.default_local_dir, flag="trainer.default_local_dir", inputs=inputs)
    if not is_inside(cfg.logging.log_dir, run):
        claim_run_folder(cfg.logging.log_dir, flag="logging.log_dir", inputs=inputs, kind="logs")


def _refuse_replacing_log(cfg: RunConfig) -> None:
    """A run that resumes appends to its ``metrics.jsonl``; one that starts afresh over an earlier run's log is
    refused rather than the log renamed: the folder's ``config.yaml``, plot and TensorBoard events are that run's
    too and a new run would replace or mix with them, so the earlier run stays whole until the user says where
    the new one goes."""
    old = previous_log(cfg.logging)
    if old is None or resume_checkpoint(cfg) is not None:
        return
    sft = finished_sft(cfg)
    if sft is not None:  # an SFT run saves no optimizer state: it cannot resume, only start over
        raise OutputError(
            f"{cfg.trainer.default_local_dir} holds a finished SFT run ({sft[0]} steps, its model in {sft[1]}), "
            "which a new run would replace (an SFT run cannot resume): set trainer.default_local_dir to another "
            f"folder, or move {cfg.trainer.default_local_dir} away"
        )
    disabled = cfg.trainer.resume_mode == ResumeMode.DISABLE.value
    why = (
        "trainer.resume_mode=disable"
        if disabled
        else f"no run checkpoint in {checkpoint_root(cfg)} to resume (trainer.save_freq={cfg.trainer.save_freq})"
    )
    continue_it = (
        "; or trainer.resume_mode=auto to continue it"
        if disabled and os.path.isfile(os.path.join(checkpoint_root(cfg), LATEST))
        else ""
    )
    raise OutputError(
        f"{old} holds an earlier run's log, which a new run would replace ({why}): set trainer.default_local_dir "
        f"(or logging.log_dir) to another folder, or move {cfg.trainer.default_local_dir} away{continue_it}"
    )


def _refuse_replacing_checkpoints(cfg: RunConfig) -> None:
    """A run that does not start from one of this folder's run checkpoints would save its own ``global_step_N``
    over an earlier run's, point ``latest`` at them and prune the rest (all carry our marker, so the writes
    would be allowed): refused, whatever its log folder says (the log check alone missed a run logging
    elsewhere or without ``metrics.jsonl``)."""
    root = checkpoint_root(cfg)
    ours = [os.path.basename(folder) for _, folder in saved_steps(cfg) if is_ours(folder)]
    start = resume_checkpoint(cfg)
    if not ours or (start is not None and is_inside(start, root)):
        return
    if cfg.trainer.resume_mode == ResumeMode.DISABLE.value:
        why = "trainer.resume_mode=disable"
    elif start is None:
        why = f"trainer.resume_mode=auto finds no `{LATEST}` there"
    else:
        why = f"trainer.resume_from_path={start} is not one of them"
    raise OutputError(
        f"{root} holds an earlier run's checkpoints ({', '.join(ours[-3:])}), which a new run would replace "
        f"({why}): set trainer.default_local_dir to another folder, or move {cfg.trainer.default_local_dir} away"
    )


SFT_CHECKPOINT = "sft_checkpoint"
"""The megatron checkpoint an SFT run saves at its end (``mcore_rl/trainer/sft.py``), beside its ``model/``."""


def finished_sft(cfg: RunConfig) -> tuple[int, str] | None:
    """``(steps, model folder)`` of a finished SFT run in the run folder, or None. An SFT run writes no run
    checkpoint; it is finished once its model is exported (``model/`` ours with its ``config.json``, after
    ``sft_checkpoint/``), and its steps are those of the last ``sft`` record of its ``metrics.jsonl``."""
    from mcore_rl.convert.export import MODEL_DIR

    run = cfg.trainer.default_local_dir
    model, log = os.path.join(run, MODEL_DIR), previous_log(cfg.logging)
    if log is None or not os.path.isdir(os.path.join(run, SFT_CHECKPOINT)) or not is_ours(model):
        return None
    if not os.path.isfile(os.path.join(model, "config.json")):
        return None
    steps = [record["step"] for record in read_records(log) if record["stage"] == "sft"]
    return (steps[-1], model) if steps else None


def is_inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies under it, links resolved."""
    real, folder = os.path.realpath(path), os.path.realpath(folder)
    return real == folder or real.startswith(folder + os.sep)


def _inputs(cfg: RunConfig) -> list[str | None]:
    return [
        cfg.model.path,
        cfg.model.tokenizer_path,
        cfg.reward_model.path,
        *cfg.data.train_files,
        *cfg.data.val_files,
        *cfg.data.test_files,
        *cfg.sft.train_files,
        *cfg.sft.val_files,
        *cfg.dpo.train_files,
        *cfg.dpo.val_files,
    ]


# --- run checkpoints: <default_local_dir>/checkpoints/global_step_<N>, and `latest` naming the newest ----------
LATEST = "latest"


def checkpoint_root(cfg: RunConfig) -> str:
    return os.path.join(cfg.trainer.default_local_dir, "checkpoints")


def checkpoint_name(step: int) -> str:
    return f"global_step_{step}"


def publish_checkpoint(cfg: RunConfig, step: int) -> None:
    """After a complete save: point ``latest`` at it (:func:`point_latest_at`), then drop what
    ``trainer.max_ckpt_to_keep`` no longer keeps (:func:`prune_checkpoints`)."""
    point_latest_at(cfg, step)
    prune_checkpoints(cfg, step)


def point_latest_at(cfg: RunConfig, step: int) -> None:
    """``latest`` names the checkpoint of ``step``: written beside, then renamed over it (atomic), the folder
    synced so the rename survives a power loss."""
    root = checkpoint_root(cfg)
    staging = os.path.join(root, f".{LATEST}.tmp")
    with open(staging, "w") as f:
        f.write(checkpoint_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, os.path.join(root, LATEST))
    folder = os.open(root, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def prune_checkpoints(cfg: RunConfig, step: int) -> None:
    """Keep the checkpoint of ``step`` and the ``trainer.max_ckpt_to_keep - 1`` newest of ours before it. Only
    folders carrying our marker are counted or dropped, never a user's own ``global_step_N``, and none of a
    later step than this one (left by a run this one resumed from an earlier checkpoint): pruning by number
    alone would drop the checkpoint just saved. A folder the filesystem will not remove (busy on NFS while
    another job reads it, no permission) is left with a note: the save it follows has succeeded."""
    keep = cfg.trainer.max_ckpt_to_keep
    if not keep:
        return
    earlier = [folder for saved, folder in saved_steps(cfg) if saved < step and is_ours(folder)]
    for folder in earlier[: max(len(earlier) - (keep - 1), 0)]:
        try:
            shutil.rmtree(folder)
        except OSError as err:
            note(f"{folder} not removed (trainer.max_ckpt_to_keep={keep}): {err}")


def saved_steps(cfg: RunConfig) -> list[tuple[int, str]]:
    """``(step, folder)`` of every ``global_step_N`` folder in the run's checkpoint folder (ours or a user's),
    oldest first."""
    root = checkpoint_root(cfg)
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(
        (int(n[12:]), os.path.join(root, n))
        for n in names
        if n.startswith("global_step_") and n[12:].isdigit()
    )


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
