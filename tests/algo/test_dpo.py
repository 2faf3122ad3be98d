"""DPO losses: hand-computed values per loss type, gradients, reference-free mode, bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algo import DPOSettings, dpo_loss, sequence_log_probs


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# One pair: policy chosen -2, rejected -5; reference chosen -3, rejected -4 -> Δ = (1) - (-1) = 2.
PAIR = (t([-2.0]), t([-5.0]), t([-3.0]), t([-4.0]))


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (DPOSettings(beta=0.5), -log_sigmoid(1.0)),
        # cDPO: (1-ε)·(-logσ(βΔ)) + ε·(-logσ(-βΔ))
        (DPOSettings(beta=0.5, label_smoothing=0.1), 0.9 * -log_sigmoid(1.0) + 0.1 * -log_sigmoid(-1.0)),
        # rDPO: [-(1-ε)·logσ(βΔ) + ε·logσ(-βΔ)] / (1-2ε)
        (
            DPOSettings(beta=0.5, loss_type="robust", label_smoothing=0.1),
            (-0.9 * log_sigmoid(1.0) + 0.1 * log_sigmoid(-1.0)) / 0.8,
        ),
        (DPOSettings(beta=0.5, loss_type="robust"), -log_sigmoid(1.0)),  # ε = 0: plain DPO
        (DPOSettings(beta=0.5, loss_type="hinge"), 0.0),  # relu(1 - 1)
        (DPOSettings(beta=0.25, loss_type="hinge"), 0.5),  # relu(1 - 0.5)
        (DPOSettings(beta=0.5, reference_free=True), -log_sigmoid(0.5 * 3.0)),  # Δ = -2 - (-5)
    ],
)
def test_hand_computed_losses(settings: DPOSettings, expected: float) -> None:
    out = dpo_loss(*PAIR, settings)
    torch.testing.assert_close(out.losses, t([expected]))


def test_rewards_are_beta_times_log_ratios() -> None:
    out = dpo_loss(*PAIR, DPOSettings(beta=0.5))
    torch.testing.assert_close(out.chosen_rewards, t([0.5 * 1.0]))
    torch.testing.assert_close(out.rejected_rewards, t([0.5 * -1.0]))
    free = dpo_loss(*PAIR, DPOSettings(beta=0.5, reference_free=True))
    torch.testing.assert_close(free.chosen_rewards, t([-1.0]))
    torch.testing.assert_close(free.rejected_rewards, t([-2.5]))


def test_ipo_averages_log_probs_per_token() -> None:
    # Lengths 2 and 5: averages chosen -1 (ref -1.5), rejected -1 (ref -0.8) -> Δ_avg = 0.5 + 0.2 = 0.7.
    out = dpo_loss(*PAIR, DPOSettings(beta=0.5, loss_type="ipo"), t([2.0]), t([5.0]))
    torch.testing.assert_close(out.losses, t([(0.7 - 1 / (2 * 0.5)) ** 2]))
    torch.testing.assert_close(out.chosen_rewards, t([0.5 * 0.5]))
    torch.testing.assert_close(out.rejected_rewards, t([0.5 * -0.2]))
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(*PAIR, DPOSettings(loss_type="ipo"))


def test_sigmoid_gradient_matches_closed_form() -> None:
    chosen = t([-2.0, -1.0]).requires_grad_()
    rejected = t([-5.0, -0.5]).requires_grad_()
    out = dpo_loss(chosen, rejected, t([-3.0, -1.0]), t([-4.0, -1.0]), DPOSettings(beta=0.5))
    out.losses.sum().backward()
    # d/dc -logσ(βΔ) = -β·σ(-βΔ); Δ = 2 and -0.5.
    expected = t([-0.5 / (1 + math.exp(1.0)), -0.5 / (1 + math.exp(-0.25))])
    assert chosen.grad is not None and rejected.grad is not None
    torch.testing.assert_close(chosen.grad, expected)
    torch.testing.assert_close(rejected.grad, -expected)
    assert not out.chosen_rewards.requires_grad


def test_batch_is_elementwise() -> None:
    settings = DPOSettings(beta=0.3, loss_type="robust", label_smoothing=0.2)
    gen = torch.Generator().manual_seed(0)
    logps = [torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(4)]
    batch = dpo_loss(*logps, settings).losses
    single = torch.cat([dpo_loss(*(x[i : i + 1] for x in logps), settings).losses for i in range(5)])
    torch.testing.assert_close(batch, single)


def test_sequence_log_probs_ignore_masked_nan() -> None:
    token = t([[-1.0, -2.0, float("nan")], [-0.5, float("inf"), -0.25]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 0, 1]])
    total, length = sequence_log_probs(token, mask)
    torch.testing.assert_close(total, t([-3.0, -0.75]))
    torch.testing.assert_close(length, t([2.0, 2.0]))
    total.sum().backward()
    assert token.grad is not None
    torch.testing.assert_close(token.grad, mask)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.0}, "beta must be > 0"),
        ({"loss_type": "kto"}, "'kto' is not a valid DPOLossType"),
        ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, "sigmoid and robust only, not hinge"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "not ipo"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DPOSettings(**kwargs)


def test_shape_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match="ref_rejected_logps has shape"):
        dpo_loss(t([1.0]), t([1.0]), t([1.0]), t([1.0, 2.0]), DPOSettings())
