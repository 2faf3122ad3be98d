"""A run's lifecycle as ``mcore-rl train`` shows it (in-process, tiny): ``trainer.val_before_train`` scores the
held-out and validation sets before step 1 (validation logged at RL step 0) or skips both; a finished run run
again says it is complete and trains nothing; a resume says where it continues from; without
``data.test_files`` the held-out line says what it needs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mcore_rl.cli import main
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import QUIET, demo_recipe_overrides, tiny_run_config


def _train(data: str, run: str, *extra: str, in_process: bool = True) -> int:
    overrides = [*demo_recipe_overrides(data, run), "sft.enable=false", "trainer.test_freq=-1", *extra]
    return main(["train", "recipes/demo_cpu.yaml", *overrides, *(["--in-process"] if in_process else [])])


def _records(run: str) -> list[dict]:
    with open(os.path.join(run, "logs", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_validate_before_training_then_complete_then_resume(tmp_path: Path, capsys) -> None:
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    tiny_run_config(data)  # the small demo splits and the tokenizer
    steps = ["trainer.save_freq=1", "trainer.val_before_train=true"]
    assert _train(data, run, "trainer.total_training_steps=2", *steps) == 0
    out = capsys.readouterr().out
    assert re.search(r"held-out accuracy: \d+\.\d% before, \d+\.\d% after 2 RL steps", out), out
    records = _records(run)
    assert [(r["stage"], r["step"]) for r in records] == [
        ("test", 0),
        ("rl", 0),
        ("rl", 1),
        ("rl", 2),
        ("test", 2),
    ]
    assert set(records[1]) == {
        "stage",
        "step",
        "val_accuracy",
        "val_reward",
        "time/timestamp",
    }  # val_files scored before step 1

    logged = Path(run, "logs", "metrics.jsonl").read_bytes()
    assert _train(data, run, "trainer.total_training_steps=2", *steps) == 0  # the same run again
    captured = capsys.readouterr()
    checkpoint = os.path.join(run, "checkpoints", "global_step_2")
    assert f"already complete at step 2 ({checkpoint}); nothing to train" in captured.out
    assert "held-out" not in captured.out and "resuming" not in captured.err
    assert Path(run, "logs", "metrics.jsonl").read_bytes() == logged  # nothing trained, nothing logged
    saved = Path(run, "config.yaml").read_bytes()
    overrides = [*demo_recipe_overrides(data, run), "sft.enable=false", "trainer.test_freq=-1"]
    with Trainer.from_config(
        "recipes/demo_cpu.yaml", [*overrides, "trainer.total_training_steps=2", *steps], use_ray=False
    ) as complete:
        assert complete._actors is None and complete._step is None  # no workers for a finished run
        assert complete.fit()["already_complete"] == 2
    assert Path(run, "config.yaml").read_bytes() == saved

    assert _train(data, run, "trainer.total_training_steps=3", *steps) == 0  # one step more: resumes
    captured = capsys.readouterr()
    assert f"resuming from {checkpoint} (step 2)" in captured.err
    assert re.search(r"held-out accuracy: \d+\.\d% after 3 RL steps\n", captured.out), captured.out
    assert [(r["stage"], r["step"]) for r in _records(run)][5:] == [("resume", 2), ("rl", 3), ("test", 3)]

    logged = Path(run, "logs", "metrics.jsonl").read_bytes()
    at_tp2 = [
        "trainer.total_training_steps=4",
        "parallel.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=2",
    ]
    # refused on the driver, before any worker (or Ray) starts; two ranks: not an in-process run
    assert _train(data, run, *at_tp2, *steps, in_process=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mcore-rl train: error: ") and "internal" not in err[0], err
    assert "saved at parallel.tensor_model_parallel_size=1, this run sets 2" in err[0]
    assert "model.path=" in err[0] and Path(run, "logs", "metrics.jsonl").read_bytes() == logged


def test_no_validation_before_training_and_no_test_files(tmp_path: Path, capsys) -> None:
    data = str(tmp_path / "data")
    cfg = tiny_run_config(
        data,
        [
            *QUIET,
            "trainer.val_before_train=false",
            f"data.test_files=[{data}/test.jsonl]",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path / 'quiet'}",
        ],
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        summary = trainer.fit()
        stages = [(r["stage"], r["step"], r.get("when")) for r in trainer.records]
    assert stages == [("rl", 1, None), ("test", 1, "after_rl")]  # no held-out test, no validation before
    assert "test_before" not in summary and "val_before" not in summary

    run = str(tmp_path / "run")
    assert _train(data, run, "trainer.total_training_steps=1", "data.test_files=[]") == 0
    out = capsys.readouterr().out
    assert "held-out accuracy: none (set data.test_files to score a held-out set)" in out and "n/a" not in out
