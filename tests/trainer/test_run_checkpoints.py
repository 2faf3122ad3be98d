"""Run checkpoints under faults, in-process: SIGTERM / SIGUSR1 end the step and save (``Preempted``), a save
the filesystem refuses leaves the previous checkpoint intact and stops or goes on as configured, and a damaged
checkpoint is named before anything loads it (or an older intact one is used, saying so)."""

from __future__ import annotations

import os
import resource
import shutil
import signal

import pytest

from mcore_rl.io.errors import CheckpointIntegrityError, CheckpointSaveError, Preempted
from mcore_rl.io.manifest import MANIFEST_FILE, verify_manifest
from mcore_rl.trainer.run_checkpoint import resume_point
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

OVERRIDES = [
    MIXED_REWARD,
    "trainer.total_training_steps=4",
    "trainer.test_freq=-1",
    "logging.progress_bar=false",
    "logging.plot=false",
    "data.train_batch_size=4",
    "algorithm.ppo_mini_batch_size=2",
]


def _at_step(trainer: Trainer, step: int, action) -> None:
    """Run ``action`` while step ``step`` scores its rollout (this step object only)."""
    scores = trainer.step.training_scores

    def hooked(rollout, prompts):
        if trainer.global_step == step:
            action()
        return scores(rollout, prompts)

    trainer.step.training_scores = hooked  # type: ignore[method-assign]


def _checkpoints(run) -> list[str]:
    return sorted(os.listdir(os.path.join(run, "checkpoints")))


@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.sweep)],  # one path: CI time
)
def test_a_stop_signal_ends_the_step_saves_it_and_the_next_run_resumes_there(tmp_path, signum) -> None:
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={run}", "trainer.save_freq=-1"])
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        _at_step(trainer, 2, lambda: os.kill(os.getpid(), signum))
        with pytest.raises(Preempted) as info:
            trainer.fit()
        assert [r["step"] for r in trainer.records if r["stage"] == "rl"] == [1, 2]  # step 2 was finished
    checkpoint = os.path.join(run, "checkpoints", "global_step_2")
    assert str(info.value) == (
        f"stopped by {signal.Signals(signum).name} after step 2; run checkpoint {checkpoint} saved; the same "
        "command resumes it"
    )
    assert _checkpoints(run) == ["global_step_2", "latest"]  # complete, nothing staged left beside it
    verify_manifest(checkpoint)
    with Trainer.from_config(cfg, use_ray=False) as resumed:
        summary = resumed.fit()
        assert summary["resumed_step"] == 2
        assert [r["step"] for r in resumed.records if r["stage"] == "rl"] == [3, 4]


def test_a_second_signal_interrupts_at_once(tmp_path) -> None:
    from mcore_rl.io.errors import Interrupted

    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    cfg = tiny_run_config(data, [*OVERRIDES, f"trainer.default_local_dir={run}", "trainer.save_freq=-1"])
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        _at_step(trainer, 1, lambda: [os.kill(os.getpid(), signal.SIGTERM) for _ in range(2)])
        with pytest.raises(Interrupted, match="SIGTERM"):
            trainer.fit()
    assert not os.path.exists(os.path.join(run, "checkpoints"))


class _FileSizeLimit:
    """Writes past ``limit`` bytes per file fail (EFBIG), as a full disk fails them: torch's writer then
    raises its own RuntimeError, as it does on a full disk."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.saved: tuple[int, int] | None = None

    def set(self) -> None:
        self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved[1]))

    def reset(self) -> None:
        if self.saved is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)


class _NoSpace:
    """The filesystem's ENOSPC on the first file DCP writes (a full disk at the Python level, named)."""

    def set(self) -> None:
        import errno
        from unittest import mock

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", "__0_0.distcp")

        self.patch = mock.patch("torch.distributed.checkpoint.filesystem._write_item", side_effect=full)
        self.patch.start()

    def reset(self) -> None:
        if hasattr(self, "patch"):
            self.patch.stop()


@pytest.mark.parametrize(
    ("policy", "failure", "reason"),
    [
        ("stop", _FileSizeLimit(200 << 10), "a write failed in torch's checkpoint writer"),
        ("continue", _NoSpace(), "No space left on device"),
    ],
    ids=["stop-file-too-large", "continue-disk-full"],
)
def test_a_save_the_disk_refuses_leaves_the_previous_checkpoint_and_stops_or_goes_on(
    tmp_path, policy, failure, reason, capfd
) -> None:
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    overrides = [*OVERRIDES, f"trainer.default_local_dir={run}", "trainer.save_freq=1"]
    cfg = tiny_run_config(data, [*overrides, f"trainer.on_save_failure={policy}"])
    try:
        with Trainer.from_config(cfg, use_ray=False) as trainer:
            _at_step(trainer, 3, failure.set)  # steps 1 and 2 are saved, step 3's save is refused ...
            _at_step(trainer, 4, failure.reset)  # ... and the disk has room again for step 4's
            if policy == "stop":
                with pytest.raises(CheckpointSaveError) as info:
                    trainer.fit()
                line = str(info.value)
            else:
                trainer.fit()
                line = capfd.readouterr().err
    finally:
        failure.reset()
    previous = os.path.join(run, "checkpoints", "global_step_2")
    assert f"step 3: run checkpoint not saved ({reason}" in line or f"__0_0.distcp: {reason}" in line, line
    assert f"the previous checkpoint {previous} is intact" in line
    verify_manifest(previous)
    with open(os.path.join(run, "checkpoints", "latest")) as f:
        latest = f.read().strip()
    if policy == "stop":
        assert "(trainer.on_save_failure=continue trains on without it)" in line
        assert _checkpoints(run) == [
            "global_step_1",
            "global_step_2",
            "latest",
        ]  # no partial step 3, no staging
        assert latest == "global_step_2"
    else:
        assert len([x for x in line.splitlines() if "run checkpoint not saved" in x]) == 1
        assert "training on (trainer.on_save_failure=continue)" in line
        assert [r["step"] for r in trainer.records if r["stage"] == "rl"] == [1, 2, 3, 4]
        assert _checkpoints(run) == ["global_step_1", "global_step_2", "global_step_4", "latest"]
        assert latest == "global_step_4"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[str, str]:
    """A run with checkpoints at steps 1, 2 and 3 (``latest`` -> 3)."""
    root = tmp_path_factory.mktemp("saved")
    data, run = str(root / "data"), str(root / "run")
    cfg = tiny_run_config(
        data,
        [
            *OVERRIDES,
            f"trainer.default_local_dir={run}",
            "trainer.save_freq=1",
            "trainer.total_training_steps=3",
        ],
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        trainer.fit()
    return data, run


def _damaged(tmp_path, saved_run, damage, mode: str = "auto"):
    """A copy of ``saved_run`` with ``damage(checkpoint_3)`` applied -> (config resuming it, checkpoint_3)."""
    data, source = saved_run
    run = str(tmp_path / "run")
    shutil.copytree(source, run)
    newest = os.path.join(run, "checkpoints", "global_step_3")
    damage(newest)
    extra = [f"trainer.resume_from_path={newest}"] if mode == "resume_path" else []
    cfg = tiny_run_config(
        data,
        [*OVERRIDES, f"trainer.default_local_dir={run}", f"trainer.resume_mode={mode}", *extra],
    )
    return cfg, newest


def _loader(cfg):
    from mcore_rl.trainer.trainer import load_run_data

    return load_run_data(cfg).loader


def _truncate(folder: str) -> None:
    os.truncate(os.path.join(folder, "__0_0.distcp"), 1000)


def _alter(folder: str) -> None:
    with open(os.path.join(folder, "__0_0.distcp"), "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_truncate, "__0_0.distcp: truncated (1000 bytes,"),
        (_alter, "__0_0.distcp: altered since it was saved"),
        (lambda f: os.remove(os.path.join(f, "common.pt")), "common.pt: missing"),
        (lambda f: os.remove(os.path.join(f, "__0_0.distcp")), "__0_0.distcp: missing"),
        (
            lambda f: os.remove(os.path.join(f, MANIFEST_FILE)) or _truncate(f),
            "__0_0.distcp: truncated (1000",
        ),
    ],
    ids=["truncated", "altered", "common-pt-deleted", "shard-deleted", "no-manifest-truncated"],
)
def test_a_damaged_checkpoint_is_named_before_any_worker_and_auto_resumes_the_previous(
    tmp_path, saved_run, capfd, damage, named
) -> None:
    cfg, newest = _damaged(tmp_path, saved_run, damage, mode="resume_path")
    with pytest.raises(CheckpointIntegrityError, match=named.replace("(", r"\(")):
        resume_point(cfg, _loader(cfg))
    shutil.rmtree(os.path.dirname(os.path.dirname(newest)))
    cfg, newest = _damaged(tmp_path, saved_run, damage)
    point = resume_point(cfg, _loader(cfg))
    assert point is not None and point.step == 2
    note = capfd.readouterr().err
    assert f"{newest} cannot be resumed (" in note and named in note and "resuming from" in note
    assert os.path.isdir(newest)  # the damaged one is left for the user to look at


def test_the_checkpoint_loader_names_what_is_wrong_before_megatron_reads(tmp_path, saved_run) -> None:
    """The probe's findings for ``load_training_checkpoint``: a truncated ``.distcp`` and a missing ``common.pt``
    were raw tracebacks (a CheckpointException, "'str' object has no attribute 'iterdir'"), a checkpoint of
    another model shape a raw CheckpointException, and a kill between the two renames of a swap left
    ``.<dir>.mcore_rl-old-*`` only, loading ``<dir>`` saying "not a training checkpoint" without pointing at it."""
    from mcore_rl.engine.trainer_checkpoint import load_training_checkpoint, read_trainer_state
    from mcore_rl.io.errors import InputError

    data, source = saved_run
    run = str(tmp_path / "run")
    shutil.copytree(source, run)
    root = os.path.join(run, "checkpoints")
    cfg = tiny_run_config(
        data,
        [
            *OVERRIDES,
            f"trainer.default_local_dir={tmp_path / 'other'}",
            "model.hf_config.intermediate_size=128",
        ],
    )
    with Trainer.from_config(cfg, use_ray=False) as other:
        engine = other.actors.backend.worker.engine  # type: ignore[attr-defined]
        with pytest.raises(
            InputError, match=r"global_step_3: saved for another model \(ffn_hidden_size=96 saved, 128"
        ):
            load_training_checkpoint(engine, os.path.join(root, "global_step_3"))
        _truncate(os.path.join(root, "global_step_2"))
        with pytest.raises(
            CheckpointIntegrityError, match=r"global_step_2/__0_0.distcp: truncated \(1000 bytes"
        ):
            load_training_checkpoint(engine, os.path.join(root, "global_step_2"))
        os.remove(os.path.join(root, "global_step_1", "common.pt"))
        with pytest.raises(InputError, match=r"global_step_1: common.pt is missing"):
            load_training_checkpoint(engine, os.path.join(root, "global_step_1"))
    newest = os.path.join(root, "global_step_3")
    aside = os.path.join(
        root, ".global_step_3.mcore_rl-old-999999-0123abcd"
    )  # what a kill between renames leaves
    os.rename(newest, aside)
    with pytest.raises(
        InputError,
        match=rf"global_step_3: missing; a save killed while replacing it left the previous checkpoint at {aside}",
    ):
        read_trainer_state(newest)


def _fake_run_checkpoint(folder, extra: dict, critic: bool = False) -> str:  # type: ignore[no-untyped-def]
    """A run checkpoint's driver state alone (``trainer_state.json``), as ``Trainer.save`` writes it."""
    import json

    os.makedirs(folder)
    if critic:
        os.makedirs(os.path.join(folder, "critic"))
    state = {"step": 2, "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}, "extra": extra}
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump(state, f)
    return str(folder)


PPO_KL = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"]
SAME = object()  # stands for the run's own model config


@pytest.mark.parametrize(
    "overrides, extra, critic, message",
    [  # a DPO run's checkpoint: its data position is a sampler's, not a prompt loader's
        ([], {"sampler": {}, "model": SAME}, False, r"extra\.loader must be an object \(not an RL run"),
        ([], {"loader": {}}, False, r"extra\.model must be an object"),
        ([], {"loader": {}, "model": SAME, "algorithm": [1]}, False, r"extra\.algorithm must be an object"),
        (PPO_KL[:1], {"loader": {}, "model": SAME}, False, r"saved without a critic .*adv_estimator=gae"),
        (PPO_KL, {"loader": {}, "model": SAME, "algorithm": {}}, True, r"use_kl_in_reward's KL controller"),
    ],
)
def test_a_checkpoint_this_run_cannot_continue_is_refused_in_one_line_before_any_worker(
    tmp_path, overrides, extra, critic, message
) -> None:
    from mcore_rl.io.errors import ConfigError
    from mcore_rl.trainer.run_data import load_run_data

    folder = tmp_path / "elsewhere" / "global_step_2"
    cfg = tiny_run_config(
        str(tmp_path / "data"),
        [*overrides, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={folder}"],
    )
    extra = {key: cfg.model.hf_config_dict() if value is SAME else value for key, value in extra.items()}
    _fake_run_checkpoint(folder, extra, critic)
    with pytest.raises(ConfigError, match=message):
        resume_point(cfg, load_run_data(cfg).loader)
