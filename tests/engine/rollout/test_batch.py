"""Rollout output as position-aligned records (``engine/rollout/batch.py``), against hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.rollout import GenerationOutput
from mcore_rl.engine.rollout.batch import common_width, rollout_batch


def _two_prompts() -> tuple[list[list[int]], GenerationOutput]:
    out = GenerationOutput(
        prompt_index=torch.tensor([0, 0, 1]),
        token_ids=torch.tensor([[20, 21, 22], [23, 9, 9], [30, 31, 9]]),
        log_probs=torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 5.0, 5.0], [-0.5, -0.6, 5.0]]),
        lengths=torch.tensor([3, 1, 2]),
        finish_reasons=["length", "stop", "stop"],
    )
    return [[5, 6, 7], [8, 9]], out


def test_rollout_batch_puts_each_response_quantity_on_the_position_that_predicts_it() -> None:
    prompts, out = _two_prompts()
    batch = rollout_batch(prompts, torch.tensor([10, 11]), out, pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 20, 21, 22], [5, 6, 7, 23, 0, 0], [8, 9, 30, 31, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0]]
    assert torch.allclose(batch.rollout_log_probs[0, 2:5], torch.tensor([-0.1, -0.2, -0.3]))
    assert batch.rollout_log_probs[1].tolist() == pytest.approx(
        [0, 0, -0.4, 0, 0, 0]
    )  # padding's 5.0 dropped
    assert batch.prompt_index.tolist() == [10, 10, 11]
    assert batch.responses() == [[20, 21, 22], [23], [30, 31]]


def test_replica_shards_of_other_widths_are_padded_to_concatenate_with_their_rows_intact() -> None:
    from mcore_rl.controller import concat_records

    prompts, out = _two_prompts()
    wide = rollout_batch(prompts, torch.tensor([0, 1]), out, pad_id=0)  # S = 3 + 3, T = 3
    short = GenerationOutput(
        prompt_index=torch.tensor([0]),
        token_ids=torch.tensor([[40]]),
        log_probs=torch.tensor([[-0.7]]),
        lengths=torch.tensor([1]),
        finish_reasons=["stop"],
    )
    narrow = rollout_batch([[11]], torch.tensor([2]), short, pad_id=0)  # S = 2, T = 1
    joined = concat_records(common_width([wide, narrow], pad_id=0))
    assert joined.tokens.shape == (4, 6) and joined.response_ids.shape == (4, 3)
    assert joined.tokens[3].tolist() == [11, 40, 0, 0, 0, 0]
    assert joined.response_mask[3].tolist() == [1.0, 0, 0, 0, 0, 0]
    assert joined.rollout_log_probs[3, 0].item() == pytest.approx(-0.7)
    assert joined.responses() == [*wide.responses(), [40]]
    assert torch.equal(joined.tokens[:3], wide.tokens) and joined.prompt_index.tolist() == [0, 0, 1, 2]
