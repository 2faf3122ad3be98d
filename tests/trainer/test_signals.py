"""Signals during a training run (#31, points 2 and 6): SIGTERM to a local Ray run ends the step, saves a run
checkpoint and exits 75 (Ray's own native handler does not take it); SIGINT landing anywhere in a save leaves
``global_step_<N>`` complete or absent and ``latest`` naming a complete checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest

from mcore_rl.io.errors import Interrupted
from mcore_rl.io.manifest import verify_manifest
from mcore_rl.io.signals import raise_on_signals
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, demo_recipe_overrides, tiny_run_config

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def _train_command(data: str, run: str, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "mcore_rl.cli", "train", "recipes/demo_cpu.yaml"),
        *demo_recipe_overrides(data, run),
        *("sft.enable=false", "data.test_files=[]", "trainer.test_freq=-1", "trainer.val_before_train=false"),
        *("trainer.total_training_steps=500", "trainer.num_cpus=2", *extra),
    ]


def _rl_steps(run: str) -> list[int]:
    path = os.path.join(run, "logs", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r["step"] for r in (json.loads(x) for x in f if x.strip()) if r["stage"] == "rl"]


def _wait_for_steps(proc: subprocess.Popen, run: str, steps: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_rl_steps(run)) < steps:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no RL step {steps} within {timeout_s} s"
        time.sleep(0.2)


def _assert_consistent(run: str) -> list[str]:
    """Every ``global_step_<N>`` is complete (its manifest verifies, config.yaml inside), nothing staged is
    left, and ``latest`` names one of them; returns the checkpoint names."""
    root = os.path.join(run, "checkpoints")
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    assert all(n == "latest" or n.startswith("global_step_") for n in names), names  # no staging leftovers
    saved = [n for n in names if n != "latest"]
    for name in saved:
        verify_manifest(os.path.join(root, name))
        assert os.path.isfile(os.path.join(root, name, "config.yaml"))
    if saved:
        with open(os.path.join(root, "latest")) as f:
            assert f.read().strip() in saved
    return saved


@pytest.mark.slow
@pytest.mark.sweep  # a local Ray run in a process of its own (~25 s): `make test-sweep`; in make test the same
# SIGTERM reaches a Ray driver in tests/trainer/test_recovery.py, and test_cli.py checks the exit code
def test_sigterm_to_a_local_ray_run_ends_the_step_saves_and_exits_75(tmp_path) -> None:
    """The probe's case: SIGTERM to the driver alone was taken by Ray's C++ handler (a stack dump, exit 15)
    and left a half-written step folder. Now the step ends, its checkpoint is saved and the run exits 75."""
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    tiny_run_config(data)
    proc = subprocess.Popen(
        _train_command(data, run, "trainer.save_freq=-1"), stderr=subprocess.PIPE, text=True, env=ENV
    )
    try:
        _wait_for_steps(proc, run, 1, 240)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    step = _rl_steps(run)[-1]
    checkpoint = os.path.join(run, "checkpoints", f"global_step_{step}")
    assert proc.returncode == 75, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"mcore-rl train: stopped by SIGTERM after step {step}; run checkpoint {checkpoint} saved; the same "
        "command resumes it"
    )
    assert "SIGTERM received" not in err and "Traceback" not in err  # not Ray's handler, not a crash
    assert _assert_consistent(run) == [f"global_step_{step}"]
    print(f"SIGTERM -> exit 75 in {time.monotonic() - sent:.1f} s, checkpoint of step {step}")


def _interrupt_inside(target: str):
    """SIGINT to this process from inside ``target`` (a step of the save), as a user's Ctrl-C landing there."""
    original = _resolve(target)

    def landing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    return mock.patch(target, side_effect=landing)


def _resolve(target: str):
    module, name = target.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


SAVE_POINTS = {
    "ranks-start": "mcore_rl.engine.trainer_checkpoint.save_strategy",
    "ranks-writing": "torch.distributed.checkpoint.filesystem._write_item",  # inside torch's writer
    "config": "mcore_rl.trainer.trainer.save_config",
    "manifest": "mcore_rl.trainer.run_checkpoint.write_manifest",
    "publish": "mcore_rl.trainer.run_checkpoint.point_latest_at",  # signals held: lands after `latest`
}


@pytest.mark.parametrize(
    "point",
    [
        pytest.param(p, marks=pytest.mark.sweep) if p in ("ranks-start", "manifest") else p
        for p in SAVE_POINTS
    ],
)
def test_an_interrupt_anywhere_in_a_save_leaves_the_checkpoint_complete_or_absent(tmp_path, point) -> None:
    """Found by a probe: SIGINT between publishing ``global_step_6`` and writing its config.yaml left the folder
    without it while ``latest`` named step 5. Here SIGINT lands inside step 2's save at each of its parts: step
    1's checkpoint stays as it was, and step 2's is whole (the interrupt held back until after the rename and
    ``latest``) or not there at all."""
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    overrides = [MIXED_REWARD, f"trainer.default_local_dir={run}", "trainer.save_freq=1"]
    overrides += ["trainer.total_training_steps=3", "logging.progress_bar=false", "logging.plot=false"]
    cfg = tiny_run_config(data, overrides)
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        step_save = trainer.save

        def save(required: bool = False):
            if trainer.global_step != 2:
                return step_save(required)
            with _interrupt_inside(SAVE_POINTS[point]):
                return step_save(required)

        trainer.save = save  # type: ignore[method-assign]
        with raise_on_signals(), pytest.raises(Interrupted, match="SIGINT"):  # the CLI's handlers
            trainer.fit()
    saved = _assert_consistent(run)
    assert saved == (["global_step_1", "global_step_2"] if point == "publish" else ["global_step_1"])


@pytest.mark.slow
@pytest.mark.sweep  # several local Ray runs (minutes): `make test-sweep`; the in-process points run in make test
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_signals_at_random_times_of_a_run_saving_every_step_leave_it_consistent(tmp_path, signum) -> None:
    """The probe's run (``trainer.save_freq=1``, a signal some seconds in), at random moments: exit 128+n (a
    second SIGTERM for SIGTERM) or 75, and every checkpoint folder complete, ``latest`` naming one."""
    rng = random.Random(signum)
    data = str(tmp_path / "data")
    tiny_run_config(data)
    for attempt in range(3):
        run = str(tmp_path / f"run{attempt}")
        proc = subprocess.Popen(
            _train_command(data, run, "trainer.save_freq=1"), stderr=subprocess.PIPE, text=True, env=ENV
        )
        try:
            _wait_for_steps(proc, run, 1, 240)
            time.sleep(rng.uniform(0.0, 2.0))
            proc.send_signal(signum)
            if signum == signal.SIGTERM:
                time.sleep(rng.uniform(0.0, 0.5))
                proc.send_signal(signum)  # a second one: at once, wherever the first left it
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode in (128 + signum, 75), err[-3000:]
        assert "Traceback" not in err and "received at time" not in err, err[-3000:]
        _assert_consistent(run)
