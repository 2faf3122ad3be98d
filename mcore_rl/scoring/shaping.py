"""Reward shaping applied to a step's training rewards after the scorers (validation reads the rules alone).

DAPO's soft overlong punishment (Yu et al. 2025; verl's ``DAPORewardManager`` with
``reward_model.overlong_buffer``): a response up to ``response_length - len`` tokens keeps its reward; past
it the reward falls linearly, reaching ``-penalty_factor`` at the response budget, so a response that runs
into the budget is discouraged without the cliff of a hard truncation penalty::

    penalty = min(0, -(length - (response_length - len)) / len * penalty_factor)
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, response_length: int, buffer: int, factor: float) -> Tensor:
    """[N] float32 penalties (<= 0) of responses of ``lengths`` tokens (everything after the prompt, a
    multi-turn rollout's tool turns included, as verl counts the valid response)."""
    if not 0 < buffer < response_length:
        raise ValueError(
            f"overlong buffer of {buffer} tokens must be in (0, response_length={response_length})"
        )
    exceed = lengths.float() - (response_length - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)
