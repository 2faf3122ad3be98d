"""``algorithm.policy_loss``: the worker's actor loss dispatches to GSPO, and summed over micro-batches (each
divided by the mini-batch's global sequence count) it is GSPO's loss of the whole batch, gradients included;
the config resolves GSPO's clip ranges and names a bad value."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algo import gspo_policy_loss, ppo_policy_loss
from mcore_rl.config import ConfigError, load_config
from mcore_rl.engine.packing.micro_batches import slice_rows
from mcore_rl.engine.workers.losses import PolicyLossSettings, PolicyMicroBatch, policy_loss
from mcore_rl.trainer.step import loss_settings
from mcore_rl.types import TrainBatch

ROWS, SEQ = 6, 12
DEMO = "recipes/demo_cpu.yaml"


class _Head:
    """The LM head's interface over a leaf tensor of log-probs (rows ``rows`` of it)."""

    def __init__(self, log_probs: torch.Tensor, rows: slice) -> None:
        self.log_probs, self.rows = log_probs, rows

    def token_log_probs(self, tokens, keep, vocab_size, temperature):
        log_probs = self.log_probs[self.rows]
        return torch.where(keep, log_probs, torch.zeros_like(log_probs)), torch.zeros_like(log_probs)


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(ROWS, SEQ)
    for row, (start, stop) in enumerate([(2, 11), (4, 6), (1, 12), (3, 4), (0, 9), (5, 10)]):
        mask[row, start:stop] = 1.0  # responses of different lengths: seq-mean differs from token-mean
    advantages = torch.randn(ROWS, 1, generator=g).expand(ROWS, SEQ) * mask
    return TrainBatch(
        tokens=torch.zeros(ROWS, SEQ, dtype=torch.long),
        response_mask=mask,
        old_log_probs=(-torch.rand(ROWS, SEQ, generator=g) - 0.5) * mask,
        advantages=advantages.contiguous(),
        ref_log_probs=torch.zeros(ROWS, SEQ),
    )


def _micro_batched(settings: PolicyLossSettings, batch: TrainBatch, log_probs: torch.Tensor) -> torch.Tensor:
    """The worker's loss over three two-row micro-batches, summed as the engine accumulates them."""
    loss = policy_loss(settings, batch.response_mask.sum(), torch.tensor(float(ROWS)))
    total = torch.zeros(())
    for start in range(0, ROWS, 2):
        rows = slice(start, start + 2)
        micro = PolicyMicroBatch(batch.tokens[rows], batch.tokens[rows], train=slice_rows(batch, rows))
        total = total + loss.fn(_Head(log_probs, rows), micro)[0]
    return total


def test_gspo_over_micro_batches_is_gspo_of_the_whole_batch() -> None:
    batch = _batch()
    start = batch.old_log_probs + 0.05 * torch.randn(ROWS, SEQ, generator=torch.Generator().manual_seed(1))
    settings = PolicyLossSettings(
        vocab_size=10, temperature=1.0, loss_mode="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4
    )
    ours = start.clone().requires_grad_()
    loss = _micro_batched(settings, batch, ours)
    loss.backward()
    whole = start.clone().requires_grad_()
    expected = gspo_policy_loss(
        whole,
        batch.old_log_probs,
        batch.advantages,
        batch.response_mask,
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
    ).loss
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert ours.grad is not None and whole.grad is not None
    assert torch.allclose(ours.grad, whole.grad, atol=1e-7)
    vanilla = ppo_policy_loss(whole.detach(), batch.old_log_probs, batch.advantages, batch.response_mask).loss
    assert abs(vanilla.item() - expected.item()) > 1e-3  # not the token-ratio loss under another name


def test_the_config_resolves_gspo_and_names_a_bad_loss() -> None:
    vanilla = load_config(DEMO, ["algorithm.clip_ratio_low=null", "algorithm.clip_ratio_high=null"])
    assert vanilla.algorithm.policy_loss == "vanilla" and vanilla.algorithm.clip_range == (0.2, 0.2)
    gspo = load_config(
        DEMO,
        ["algorithm.policy_loss=gspo", "algorithm.clip_ratio_low=null", "algorithm.clip_ratio_high=null"],
    )
    settings = loss_settings(gspo)
    assert (settings.loss_mode, settings.clip_ratio_low, settings.clip_ratio_high) == ("gspo", 3e-4, 4e-4)
    explicit = load_config(DEMO, ["algorithm.policy_loss=gspo", "algorithm.clip_ratio_high=1e-3"])
    assert explicit.algorithm.clip_range == (0.2, 1e-3)  # the recipe's clip_ratio_low: 0.2, as it says
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss='gpso'.*gspo"):
        load_config(DEMO, ["algorithm.policy_loss=gpso"])
    with pytest.raises(ConfigError, match=r"verl's policy_loss\.loss_mode is our algorithm\.policy_loss"):
        load_config(DEMO, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
