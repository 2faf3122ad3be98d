"""``mcore-rl train`` (in-process) on a NaN/inf loss: it stops naming the step, exit 1, or with
``trainer.on_nonfinite_loss=skip`` skips those updates and finishes. The loss overflows for real: a reward
function returns finite but huge rewards, and unnormalised GRPO advantages carry them into the loss."""

from __future__ import annotations

import json
import os

from mcore_rl.cli import main
from tests.trainer.common import OVERFLOWING_REWARD, demo_recipe_overrides, tiny_run_config


def _args(data: str, run: str) -> list[str]:
    return [
        *demo_recipe_overrides(data, run),
        OVERFLOWING_REWARD,
        "algorithm.norm_adv_by_std_in_grpo=false",
        "sft.enable=false",
        "data.test_files=[]",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=2",
    ]


def test_an_overflowing_loss_stops_the_run_naming_the_step_or_is_skipped(tmp_path, capsys) -> None:
    data = str(tmp_path / "data")
    tiny_run_config(data)
    assert main(["train", "recipes/demo_cpu.yaml", *_args(data, str(tmp_path / "stop")), "--in-process"]) == 1
    err = capsys.readouterr().err
    assert "NonFiniteLossError: step 1: NaN/inf loss or gradient, the update was not applied" in err

    run = str(tmp_path / "skip")
    args = [*_args(data, run), "trainer.on_nonfinite_loss=skip"]
    assert main(["train", "recipes/demo_cpu.yaml", *args, "--in-process"]) == 0
    with open(os.path.join(run, "logs", "metrics.jsonl")) as f:
        rl = [r for r in map(json.loads, f) if r["stage"] == "rl"]
    assert [(r["num_skipped"], r["num_optimizer_steps"]) for r in rl] == [(1, 0), (1, 0)]


def failing_scorer(data_source: str, solution_str: str, ground_truth: object, extra_info: object) -> float:
    """A user scorer with a bug: it raises on the first answer it sees."""
    raise ZeroDivisionError("division by zero in the user's scorer")


def test_a_scorer_that_raises_stops_the_run_in_one_line_naming_it_or_scores_zero(tmp_path, capsys) -> None:
    """``reward.on_error=raise``: one ``error:`` line naming the scorer and the row, exit 1 (it was an internal
    error with a traceback hint); the default ``zero`` scores such answers 0 and counts them."""
    data = str(tmp_path / "data")
    tiny_run_config(data)
    scorer = f"reward.custom_function={os.path.abspath(__file__)}:failing_scorer"
    args = [*_args(data, str(tmp_path / "raise"))[:-1], "trainer.total_training_steps=1", scorer]
    assert main(["train", "recipes/demo_cpu.yaml", *args, "reward.on_error=raise", "--in-process"]) == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mcore-rl train")]
    assert len(lines) == 1 and lines[0].startswith(f"mcore-rl train: error: {scorer} failed on row 0 (")
    assert "ZeroDivisionError: division by zero in the user's scorer" in lines[0]

    run = str(tmp_path / "zero")
    args = [*_args(data, run)[:-1], "trainer.total_training_steps=1", scorer]
    assert main(["train", "recipes/demo_cpu.yaml", *args, "--in-process"]) == 0
    with open(os.path.join(run, "logs", "metrics.jsonl")) as f:
        (rl,) = [r for r in map(json.loads, f) if r["stage"] == "rl"]
    assert rl["reward"] == 0.0 and rl["reward/scorer_errors"] == 16
