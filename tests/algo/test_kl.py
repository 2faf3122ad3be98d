"""KL estimators, KL in the reward and as a loss, and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algo import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    LossAggregation,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
    parse_kl_estimator,
)

NAN = float("nan")

# d = logp - logp_ref = (0.5, -1.0); the third token is masked out and holds NaN.
LOGP = torch.tensor([[-1.0, -2.0, NAN]])
REF = torch.tensor([[-1.5, -1.0, NAN]])
MASK = torch.tensor([[1.0, 1.0, 0.0]])
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # exp(-d) + d - 1


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("k1", "kl"), [0.5, -1.0, 0.0]),
        (("abs",), [0.5, 1.0, 0.0]),
        (("k2", "mse"), [0.125, 0.5, 0.0]),
        (("k3", "low_var_kl"), [*K3, 0.0]),
    ],
)
def test_estimator_values(names: tuple[str, ...], expected: list[float]) -> None:
    for name in names:
        for suffix in ("", "+"):  # straight-through keeps the forward value
            out = kl_penalty(LOGP, REF, MASK, name + suffix)
            torch.testing.assert_close(out, torch.tensor([expected]), msg=f"{name}{suffix}")


@pytest.mark.parametrize(
    ("name", "expected_grad"),
    [
        ("k1", [1.0, 1.0, 0.0]),  # d/dlogp of d
        ("k3", [1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0]),  # 1 - exp(-d)
        ("k2", [0.5, -1.0, 0.0]),  # d
        ("k1+", [0.5, -1.0, 0.0]),  # straight-through: the gradient of k2
        ("k3+", [0.5, -1.0, 0.0]),
        ("low_var_kl+", [0.5, -1.0, 0.0]),
    ],
)
def test_estimator_gradients(name: str, expected_grad: list[float]) -> None:
    log_probs = LOGP.clone().requires_grad_()
    kl_penalty(log_probs, REF, MASK, name).sum().backward()
    assert log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, torch.tensor([expected_grad]))


def test_k3_clamps() -> None:
    # d = -30: exp(30) clamped to exp(20) -> huge -> value clamped to 10; d = +30: exp(-20) + 20 - 1 -> 10.
    out = kl_penalty(torch.tensor([[-31.0, -1.0]]), torch.tensor([[-1.0, -31.0]]), torch.ones(1, 2), "k3")
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0]]))


def test_parse_and_errors() -> None:
    assert parse_kl_estimator("low_var_kl+") == (KLEstimator.K3, True)
    assert parse_kl_estimator(KLEstimator.ABS) == (KLEstimator.ABS, False)
    with pytest.raises(ValueError, match=r"unknown kl estimator 'k4'.*low_var_kl"):
        kl_penalty(LOGP, REF, MASK, "k4")
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_penalty(LOGP, torch.zeros(1, 2), MASK, "k1")


def test_kl_in_reward() -> None:
    # Row 0: rewards 0 - 0.1 * 0.5, 1 - 0.1 * -1; row 1 is fully masked. mean_kl: row means (-0.25, 0) -> -0.125.
    scores = torch.tensor([[0.0, 1.0, NAN], [NAN, NAN, NAN]])
    log_probs, ref = torch.cat([LOGP, torch.full((1, 3), NAN)]), torch.cat([REF, torch.zeros(1, 3)])
    out = apply_kl_penalty(scores, log_probs, ref, torch.cat([MASK, torch.zeros(1, 3)]), kl_coef=0.1)
    torch.testing.assert_close(out.rewards, torch.tensor([[-0.05, 1.1, 0.0], [0.0, 0.0, 0.0]]))
    assert out.mean_kl == pytest.approx(-0.125)


def test_kl_as_loss() -> None:
    torch.testing.assert_close(kl_loss(LOGP, REF, MASK), torch.tensor(sum(K3) / 2))
    by_seq = kl_loss(LOGP, REF, MASK, "k2", LossAggregation("seq-mean-token-sum", global_num_seqs=2))
    torch.testing.assert_close(by_seq, torch.tensor(0.625 / 2))


def test_adaptive_controller_follows_ziegler() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    ctrl.update(current_kl=1.0, n_steps=10)  # error 1 clipped to 0.2 -> x (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.25, n_steps=50)  # error -0.5 clipped to -0.2 -> x 0.9
    assert ctrl.value == pytest.approx(0.0918)
    ctrl.update(current_kl=0.55, n_steps=100)  # error 0.1 -> x 1.1
    assert ctrl.value == pytest.approx(0.10098)


def test_fixed_controller_and_validation() -> None:
    ctrl = FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.0, horizon=10)
