"""launch/local.sh runs a few RL steps of the tiny recipe on this machine: local Ray, `mcore-rl train`."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.launch.conftest import run_script


@pytest.mark.slow
@pytest.mark.sweep  # ~40 s of a 2-core CI; the dry runs (test_dry_runs.py) check every command it composes
def test_local_sh_runs_two_steps_of_the_tiny_recipe(tmp_path):
    data = tmp_path / "data"
    overrides = [
        "trainer.total_training_steps=2",
        "sft.enable=false",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "logging.progress_bar=false",
        "logging.plot=false",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"model.tokenizer_path={data / 'tokenizer'}",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'val.parquet'}]",
        "data.test_files=[]",
        f"sft.train_files=[{data / 'sft.parquet'}]",
    ]
    env = {"PYTHON": sys.executable, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.update({k: v for k, v in os.environ.items() if k in ("TMPDIR", "VIRTUAL_ENV")})
    result = run_script("launch/local.sh", "recipes/demo_cpu.yaml", *overrides, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "local run: " in result.stderr  # the script's phase line, then the driver's own output
    records = [
        json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r["step"] for r in records if r.get("stage") == "rl"]
    assert steps == [1, 2]
    assert all(r["num_optimizer_steps"] >= 1 for r in records if r.get("stage") == "rl")
