"""Sampling on hand-made distributions, and the validation of the rollout records."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.engine.rollout import GenerationOutput, SamplingParams, SamplingParamsError
from mcore_rl.engine.rollout.sampling import filtered_candidates, sample_tokens

# A hand-made next-token distribution: p = [0.5, 0.3, 0.15, 0.05].
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _draw(
    logits: torch.Tensor, params: SamplingParams, rows: int = 20000
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return sample_tokens(logits.expand(rows, -1).contiguous(), params, generator)


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_frequencies_follow_softmax_at_temperature(temperature):
    tokens, log_probs = _draw(LOGITS, SamplingParams(temperature=temperature))
    expected = torch.softmax(LOGITS.double() / temperature, dim=-1)
    # 20000 draws: the standard error of each frequency is below 0.0036; allow ~4 sigma.
    assert torch.allclose(_frequencies(tokens, 4), expected, atol=0.015)
    assert torch.allclose(log_probs.double(), expected.log()[tokens], atol=1e-6)


def test_temperature_zero_is_argmax_with_temperature_one_log_probs():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 3
    tokens, log_probs = sample_tokens(logits, SamplingParams(temperature=0.0), torch.Generator())
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(log_probs, expected, atol=1e-6)


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2)) * 3
    tokens, _ = sample_tokens(logits, SamplingParams(top_k=1, seed=3), torch.Generator().manual_seed(3))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_keeps_the_k_most_likely_renormalised():
    tokens, log_probs = _draw(LOGITS, SamplingParams(top_k=2))
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(
        _frequencies(tokens, 4)[:2], torch.tensor([0.625, 0.375], dtype=torch.double), atol=0.015
    )
    # Reported log-probs are those of the unfiltered distribution (what the actor recomputes).
    assert torch.allclose(log_probs, LOGITS[tokens], atol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    tokens, _ = _draw(LOGITS, SamplingParams(top_p=top_p))
    assert set(tokens.tolist()) == kept
    expected = torch.zeros(4, dtype=torch.double)
    expected[sorted(kept)] = PROBS.double()[sorted(kept)] / PROBS.double()[sorted(kept)].sum()
    assert torch.allclose(_frequencies(tokens, 4), expected, atol=0.015)


def test_top_k_then_top_p_and_unsorted_vocab():
    perm = torch.tensor([2, 0, 3, 1])  # the likely tokens are not at the front of the vocab
    logits = LOGITS[perm]
    candidates, ids = filtered_candidates(logits[None], top_k=3, top_p=0.75)
    assert ids is not None and ids[0, :2].tolist() == [1, 3]
    assert torch.isinf(candidates[0, 2:]).all()
    tokens, _ = _draw(logits, SamplingParams(top_k=3, top_p=0.75))
    assert set(tokens.tolist()) == {1, 3}


def test_filtered_tokens_are_never_drawn_even_with_tiny_probabilities():
    logits = torch.tensor([0.0, -30.0, -1e4, float("-inf")])
    tokens, _ = _draw(logits, SamplingParams(top_k=2), rows=5000)
    assert set(tokens.tolist()) <= {0, 1}
    tokens, _ = _draw(logits, SamplingParams(), rows=5000)
    assert 3 not in set(tokens.tolist())


@pytest.mark.skipif(not hasattr(torch.ops.mcore_rl, "sample_unfiltered"), reason="native extension not built")
def test_the_sampling_kernel_draws_what_its_reference_draws() -> None:
    from mcore_rl.engine.rollout.sampling import draw_unfiltered_reference

    gen = torch.Generator().manual_seed(4)
    z = torch.randn(257, 1000, generator=gen) * 3
    z[0] = -30.0
    z[0, 7] = 30.0  # one token takes all the mass
    u = torch.rand(257, 1, generator=gen, dtype=torch.float64)
    u[1] = 1.0 - 1e-17  # rounds u * total up to total: the clamp keeps the last token
    tokens, log_probs = torch.ops.mcore_rl.sample_unfiltered(z, u)
    want_tokens, want_log_probs = draw_unfiltered_reference(z, u)
    assert torch.equal(tokens, want_tokens) and tokens[0] == 7
    torch.testing.assert_close(log_probs, want_log_probs, rtol=0, atol=1e-6)


def test_same_generator_seed_same_draws():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(4))
    a, _ = sample_tokens(logits, SamplingParams(), torch.Generator().manual_seed(5))
    b, _ = sample_tokens(logits, SamplingParams(), torch.Generator().manual_seed(5))
    c, _ = sample_tokens(logits, SamplingParams(), torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("n", 0),
        ("max_new_tokens", 0),
        ("max_new_tokens", 1.5),
        ("stop_token_ids", [-1]),
        ("seed", -1),
        ("pad_token_id", -1),
    ],
)
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_store_stop_ids_as_tuple():
    params = SamplingParams(stop_token_ids=[3, 7], temperature=0)
    assert params.stop_token_ids == (3, 7) and params.greedy
    assert math.isclose(SamplingParams().temperature, 1.0)


def test_generation_output_checks_shapes_and_helpers():
    out = GenerationOutput(
        prompt_index=torch.tensor([0, 0]),
        token_ids=torch.tensor([[5, 6, 0], [7, 0, 0]]),
        log_probs=torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]]),
        lengths=torch.tensor([2, 1]),
        finish_reasons=["stop", "length"],
    )
    assert out.responses() == [[5, 6], [7]]
    assert out.response_mask().tolist() == [[True, True, False], [True, False, False]]
    with pytest.raises(ValueError, match="log_probs"):
        GenerationOutput(torch.tensor([0]), torch.zeros(1, 3), torch.zeros(2, 3), torch.tensor([1]), ["stop"])
    with pytest.raises(ValueError, match="finish_reasons"):
        GenerationOutput(torch.tensor([0]), torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([1]), [])


def test_derived_seeds_of_consecutive_step_seeds_never_meet():
    """Step seeds are consecutive (base + step): ``seed + index`` gave step s + 1's conversation c the draws of
    step s's conversation c + 1 (vLLM's continued conversations), and ``seed + 7919 * turn`` step s + 7919's
    first turn the draws of step s's second; mixed, no two (step, index) pairs share a seed."""
    from mcore_rl.engine.rollout.base import derived_seed

    seeds = [derived_seed(step, index) for step in range(600) for index in range(300)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert derived_seed(5, 0) != derived_seed(5, 1) != derived_seed(6, 0)
