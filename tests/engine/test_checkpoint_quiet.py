"""Saving a checkpoint prints no false alarm: megatron warns of an "old incomplete / corrupted checkpoint" in any
non-empty folder, and our staging folder always holds its ownership marker (it did, once per save)."""

from __future__ import annotations

import logging

import pytest

from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.trainer_checkpoint import save_training_checkpoint
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import tiny_arch


def test_saving_twice_into_our_folder_warns_of_nothing(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="megatron.core.dist_checkpointing")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(tiny_arch("llama"), ctx)
        for step in (1, 2):  # the second replaces the first (ours)
            save_training_checkpoint(engine, str(tmp_path / "ckpt"), step=step)
    assert not [r for r in caplog.records if "Overwriting old incomplete" in r.getMessage()]
