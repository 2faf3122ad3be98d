"""``mcore-rl demo`` around its training: the run folder appears complete, and a missed gain is a warning."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

from mcore_rl.cli import main


def _fake_run(after_sft: float, after: float):
    def run(args, run_dir: str) -> tuple[float, float]:
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"stage": "sft", "step": 1}) + "\n")
        return after_sft, after

    return run


@pytest.mark.parametrize("after, warned", [(0.5, False), (0.3, True)], ids=["gain", "no-gain"])
def test_a_missed_gain_is_a_warning_not_a_failure(tmp_path, capsys, after, warned):
    out = str(tmp_path / "runs" / "demo")
    with mock.patch("mcore_rl.demo._run", _fake_run(0.4, after)):
        assert main(["demo", "--out", out]) == 0
        assert ("warning: GRPO did not raise" in capsys.readouterr().out) == warned
        assert main(["demo", "--out", out]) == 0  # replaces its own previous run folder
    assert sorted(os.listdir(out)) == [".mcore_rl-output.json", "metrics.jsonl"]
    assert os.listdir(tmp_path / "runs") == ["demo"]


def test_a_failed_run_leaves_no_folder(tmp_path, capsys):
    with mock.patch("mcore_rl.demo._run", side_effect=RuntimeError("boom")):
        assert main(["demo", "--out", str(tmp_path / "demo")]) == 1
    assert os.listdir(tmp_path) == []
    assert capsys.readouterr().err.strip().endswith("RuntimeError: boom (run with --debug for the traceback)")
