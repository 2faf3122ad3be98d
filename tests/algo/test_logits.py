"""Log-probs and entropy from plain logits: hand cases, temperature, accuracy for peaked bf16 logits."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algo import entropy_from_logits, log_probs_and_entropy_from_logits, log_probs_from_logits

# softmax(0, ln 3) = (1/4, 3/4): entropy -(1/4 ln 1/4 + 3/4 ln 3/4).
TWO_WAY = torch.tensor([[[0.0, math.log(3.0)]]])
TWO_WAY_ENTROPY = 0.25 * math.log(4.0) + 0.75 * math.log(4.0 / 3.0)


def test_hand_case() -> None:
    log_probs, entropy = log_probs_and_entropy_from_logits(TWO_WAY.expand(1, 2, 2), torch.tensor([[1, 0]]))
    torch.testing.assert_close(log_probs, torch.tensor([[math.log(0.75), math.log(0.25)]]))
    torch.testing.assert_close(entropy, torch.tensor([[TWO_WAY_ENTROPY] * 2]))
    uniform = entropy_from_logits(torch.full((2, 3, 4), 7.0))
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(4.0)))


def test_temperature_divides_logits() -> None:
    logits = TWO_WAY * 2
    torch.testing.assert_close(
        log_probs_from_logits(logits, torch.tensor([[1]]), temperature=2.0), torch.tensor([[math.log(0.75)]])
    )
    torch.testing.assert_close(
        entropy_from_logits(logits, temperature=2.0), torch.tensor([[TWO_WAY_ENTROPY]])
    )


def peaked_entropy_fp64(peak: float, vocab: int) -> float:
    """Closed form for one logit `peak` and vocab-1 zeros: p_top = 1 / (1 + tail), p_other = e^-peak / (1 + tail)."""
    tail = (vocab - 1) * math.exp(-peak)
    log_top = -math.log1p(tail)
    log_other = -peak + log_top
    return -(math.exp(log_top) * log_top + (vocab - 1) * math.exp(log_other) * log_other)


def naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`logsumexp(z) - sum p z`, the formula that cancels (verl's `entropy_from_logits`)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


@pytest.mark.parametrize(("peak", "vocab"), [(12.0, 128), (20.0, 1000), (30.0, 32000)])
def test_peaked_bf16_entropy_is_accurate(peak: float, vocab: int) -> None:
    logits = torch.zeros(1, vocab, dtype=torch.bfloat16)
    logits[0, 0] = peak  # exactly representable in bf16, so the fp64 closed form is the exact answer
    expected = peaked_entropy_fp64(peak, vocab)

    ours = entropy_from_logits(logits)
    assert ours.dtype == torch.float32
    ours_err = abs(ours.item() - expected) / expected
    assert ours_err < 1e-5

    naive_fp32_err = abs(naive_entropy(logits.float()).item() - expected) / expected
    naive_bf16_err = abs(naive_entropy(logits).float().item() - expected) / expected
    assert naive_bf16_err > 0.5  # bf16 cancellation loses the entropy entirely
    assert naive_fp32_err > 100 * ours_err

    # The top token's log-prob is -log1p(tail), not rounded to 0.
    top = log_probs_from_logits(logits.unsqueeze(0), torch.tensor([[0]]))
    torch.testing.assert_close(
        top, torch.tensor([[-math.log1p((vocab - 1) * math.exp(-peak))]]), rtol=1e-5, atol=0
    )


def test_random_bf16_logits_match_fp64() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(3, 5, 50, generator=gen) * 6).to(torch.bfloat16)
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    log_probs, entropy = log_probs_and_entropy_from_logits(logits, targets)
    ref_logp = torch.log_softmax(logits.double(), dim=-1)
    ref_entropy = -(ref_logp.exp() * ref_logp).sum(-1)
    torch.testing.assert_close(log_probs.double(), ref_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-6)


def test_gradients_match_log_softmax() -> None:
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 7, (2, 3), generator=gen)
    weights = torch.randn(2, 3, generator=gen, dtype=torch.float64)

    def both(x: torch.Tensor) -> torch.Tensor:
        log_probs, entropy = log_probs_and_entropy_from_logits(x, targets, temperature=0.7)
        return (log_probs * weights).sum() + (entropy * weights).sum()

    def reference(x: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(x / 0.7, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return (logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * weights).sum() + (
            entropy * weights
        ).sum()

    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    (ours_grad,) = torch.autograd.grad(both(ours_in), ours_in)
    (ref_grad,) = torch.autograd.grad(reference(ref_in), ref_in)
    torch.testing.assert_close(ours_grad, ref_grad)


def test_minus_inf_logits_are_excluded_without_nan() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0), -math.inf]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    torch.testing.assert_close(entropy, torch.tensor([[TWO_WAY_ENTROPY]]))
    entropy.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_errors() -> None:
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(torch.zeros(1, 2, 3), temperature=0.0)
    with pytest.raises(ValueError, match="targets"):
        log_probs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        log_probs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2))
