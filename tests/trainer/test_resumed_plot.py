"""A resumed RL run's ``reward.png`` covers the whole run (in-process, tiny): the records from before the resumed
step are read back from ``metrics.jsonl``, the SFT warm start whole (it counts its own steps) and the RL steps up
to the checkpoint."""

from __future__ import annotations

from pathlib import Path

from mcore_rl.trainer import trainer as trainer_module
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import tiny_run_config


def test_a_resumed_run_plots_the_whole_run(tmp_path: Path, monkeypatch) -> None:
    drawn: list[list[tuple[str, int]]] = []
    monkeypatch.setattr(
        trainer_module,
        "reward_plot",
        lambda records, log_dir: drawn.append([(r["stage"], r["step"]) for r in records]),
    )
    data = str(tmp_path / "data")
    sft = ["sft.enable=true", f"sft.train_files=[{data}/sft.jsonl]", "sft.total_steps=3"]
    cfg = tiny_run_config(
        data,
        [
            *sft,
            "sft.train_batch_size=8",
            "sft.micro_batch_size_per_gpu=8",
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=-1",
            "logging.progress_bar=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        trainer.fit(stop_after=1)  # an interruption after the checkpoint of RL step 1
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        assert trainer.fit()["resumed_step"] == 1
        assert [(r["stage"], r["step"]) for r in trainer.records] == [("rl", 2)]  # this process's own
    assert drawn[-1] == [("sft", 1), ("sft", 2), ("sft", 3), ("rl", 1), ("rl", 2)]
