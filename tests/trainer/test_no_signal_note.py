"""A step whose advantages are all zero (every prompt's samples scored alike) is named once per run."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mcore_rl.trainer.grpo import GRPOStep


def test_all_zero_advantages_are_noted_once(capsys) -> None:
    step = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(n=8)), _noted_no_signal=False)
    GRPOStep.note_no_signal(step, torch.tensor([[0.5, -0.5]]), 1)  # a mixed group: signal
    assert capsys.readouterr().err == ""
    GRPOStep.note_no_signal(step, torch.zeros(2, 3), 2)
    err = capsys.readouterr().err
    assert err.startswith("mcore-rl: note: RL step 2: every advantage is 0 (each prompt's 8 samples scored")
    assert "rollout.n" in err and "reward.*" in err
    GRPOStep.note_no_signal(step, torch.zeros(2, 3), 3)
    assert capsys.readouterr().err == ""  # once per run
