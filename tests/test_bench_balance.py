"""bench/bench_balance.py's synthetic batch: prompt-major groups whose samples share the prompt, responses of
the drawn lengths behind it, and lengths that differ between prompts more than within one (what the balance
is measured on)."""

from __future__ import annotations

import argparse

import torch

from bench.bench_balance import PROMPT_LEN, synthetic_batch
from mcore_rl.engine.packing.token_batching import row_lengths


def test_the_batch_has_groups_of_alike_answers_to_different_prompts() -> None:
    args = argparse.Namespace(prompts=8, samples=4, median=48, max_response=256)
    batch = synthetic_batch(args, seed=3, vocab=1000)
    assert batch.tokens.shape[0] == 32
    prompts = batch.tokens[:, :PROMPT_LEN].reshape(8, 4, PROMPT_LEN)
    assert torch.equal(prompts, prompts[:, :1].expand_as(prompts))  # one prompt per group of 4 rows
    assert not torch.equal(prompts[0, 0], prompts[1, 0])
    answers = batch.response_mask.sum(dim=1)
    assert answers.min() >= 4 and answers.max() <= 256
    # each response token is predicted from the position before it, and nothing follows the response
    lengths = row_lengths(batch.response_mask)
    assert torch.equal(lengths, (PROMPT_LEN + answers).long())
    assert all(int(batch.tokens[r, PROMPT_LEN + int(a) :].abs().sum()) == 0 for r, a in enumerate(answers))
    per_group = answers.reshape(8, 4)
    spread_within = (per_group.max(1).values / per_group.min(1).values).median()
    spread_between = per_group.mean(1).max() / per_group.mean(1).min()
    assert spread_within < 2.0 < spread_between
