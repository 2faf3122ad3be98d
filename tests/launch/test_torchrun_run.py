"""launch/torchrun.sh runs an SPMD tool for real on this machine: the planner's self-check on 2 CPU ranks
(gloo), which builds the training engine at TP2 and compares every rank's tensor bytes with the planner."""

from __future__ import annotations

import json
import sys

import pytest

from mcore_rl.parallel.launch_env import free_local_port
from tests.launch.conftest import run_script
from tests.models import tiny_hf_config


@pytest.mark.slow
def test_torchrun_sh_runs_the_planner_self_check_on_two_ranks(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_hf_config("llama")))
    env = {
        "PYTHON": sys.executable,
        "MASTER_PORT": str(free_local_port()),
        "GPUS_PER_NODE": "2",
        "TMPDIR": str(tmp_path),  # torchrun's log folder (torchelastic_*) stays with the test
    }
    argv = ["launch/torchrun.sh", "plan", "--self-check", "--model-config", str(config), "--tp", "2"]
    result = run_script(*argv, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "self-check: tp=2 pp=1 dp=1 on 2 ranks" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip().startswith("rank ")]
    assert len(lines) == 2 and all(line.endswith("-> ok") for line in lines)
