"""Saving a checkpoint prints no false alarm: megatron warns of an "old incomplete / corrupted checkpoint" in any
non-empty folder, and our staging folder always holds its ownership marker (it did, once per save)."""

from __future__ import annotations

import logging

import pytest

from mcore_rl.engine import trainer_checkpoint
from mcore_rl.engine.checkpoint import _OwnStagingFolder
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.trainer_checkpoint import save_training_checkpoint
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.models import tiny_arch

WARNING = "Overwriting old incomplete"


def _warnings_of_two_saves(engine: TrainEngine, folder: str, caplog: pytest.LogCaptureFixture) -> int:
    caplog.clear()
    for step in (1, 2):  # the second replaces the first (ours)
        save_training_checkpoint(engine, folder, step=step)
    return sum(WARNING in r.getMessage() for r in caplog.records)


def test_saving_twice_into_our_folder_warns_of_nothing(
    tmp_path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="megatron.core.dist_checkpointing")
    megatron_log = logging.getLogger("megatron.core.dist_checkpointing.serialization")
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(tiny_arch("llama"), ctx)
        # Control: without our filter megatron warns once per save, so the saves below do reach its check
        # (and the message is still the one the filter drops); an earlier save in this process installed it.
        with monkeypatch.context() as unfiltered:
            unfiltered.setattr(trainer_checkpoint, "quiet_staging_warning", lambda: None)
            kept = [f for f in megatron_log.filters if not isinstance(f, _OwnStagingFolder)]
            unfiltered.setattr(megatron_log, "filters", kept)
            assert _warnings_of_two_saves(engine, str(tmp_path / "control"), caplog) == 2
        assert _warnings_of_two_saves(engine, str(tmp_path / "ckpt"), caplog) == 0
