"""``mcore-rl train RECIPE k=v --in-process``: SFT warm start, RL steps, held-out tests and every log."""

from __future__ import annotations

import json
import os

from mcore_rl.cli import main
from tests.trainer.common import demo_recipe_overrides, tiny_run_config


def test_train_runs_sft_then_rl_and_writes_jsonl_tensorboard_and_the_plot(tmp_path, capsys) -> None:
    data = str(tmp_path / "data")
    tiny_run_config(data)  # writes the small demo splits and the tokenizer
    run = str(tmp_path / "run")
    overrides = [
        *demo_recipe_overrides(data, run),
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",
        "sft.total_steps=4",
        "sft.test_freq=2",
        "sft.train_batch_size=16",
        "sft.micro_batch_size_per_gpu=8",
        "logging.tensorboard=true",
        "logging.plot=true",  # the tiny-run defaults turn it off; this test reads the PNG
    ]
    assert main(["train", "recipes/demo_cpu.yaml", *overrides, "--in-process"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy:" in out and "after 4 SFT steps" in out and "after 2 RL steps" in out
    with open(os.path.join(run, "logs", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    stages = [r["stage"] for r in records]
    assert stages.count("sft") == 4 and stages.count("rl") == 3 and stages.count("test") == 3
    assert [r["when"] for r in records if r["stage"] == "test"] == ["before", "after_sft", "after_rl"]
    sft = [r for r in records if r["stage"] == "sft"]
    assert sft[-1]["loss"] < sft[0]["loss"] and "val_accuracy" in sft[1]
    rl = [r for r in records if r["stage"] == "rl"]
    assert (
        set(rl[0]) == {"stage", "step", "val_accuracy", "val_reward", "time/timestamp"} and rl[0]["step"] == 0
    )  # val_before_train
    rl = rl[1:]
    assert all("val_accuracy" in r and abs(r["token_mult_prob_error"] - 1) < 1e-5 for r in rl)
    phases = ("generate", "update", "sync")  # the demo recipe takes the on-policy shortcut: no log_probs pass
    assert all(r["old_log_probs_recomputed"] == 0.0 and "memory/log_probs_rss_bytes" not in r for r in rl)
    assert all(r[f"memory/{p}_rss_bytes"] > 50e6 for r in rl for p in phases)  # memory per phase in JSONL
    assert os.path.getsize(os.path.join(run, "logs", "reward.png")) > 1000
    assert any(
        n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(run, "logs", "tensorboard"))
    )
    assert os.path.isfile(os.path.join(run, "config.yaml"))
