"""The embedded engine's token-in/token-out turns (``continue_conversations``): each conversation's KV cache kept
between turns, so a turn computes only the appended tokens, with the same samples and log-probs as an engine
that recomputes every context (and as one no-cache forward over the whole sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.rollout import SamplingParams, SamplingParamsError
from mcore_rl.engine.rollout.base import ConversationEngine
from tests.engine.rollout.common import make_engine, random_full_state, recomputed_log_probs
from tests.models import tiny_arch

PROMPTS = [[3, 17, 42, 8, 99], [5], [200, 13, 77, 40]]
STOPS = tuple(range(0, 250, 7))


def _turns(engine, reference, turns: int = 3, temperature: float = 0.0, seed: int = 0) -> dict:
    """Three turns of six conversations (two per prompt), ragged "tool" tokens appended between turns and one
    conversation leaving after each turn; ``reference`` starts every turn from scratch (fresh ids)."""
    g = torch.Generator().manual_seed(seed)
    ids, contexts = list(range(6)), [PROMPTS[i // 2] for i in range(6)]
    worst, reused, expected_reuse = 0.0, [], []
    for turn in range(turns):
        params = SamplingParams(temperature=temperature, max_new_tokens=1, stop_token_ids=STOPS, seed=turn)
        budgets = [3 + (i + turn) % 4 for i in range(len(ids))]
        out = engine.continue_conversations(ids, contexts, params, budgets)
        ref = reference.continue_conversations([100 * (turn + 1) + i for i in ids], contexts, params, budgets)
        assert torch.equal(out.token_ids, ref.token_ids) and out.finish_reasons == ref.finish_reasons
        assert float((out.log_probs - ref.log_probs).abs().max()) < 1e-5
        assert (out.lengths <= torch.tensor(budgets)).all() and out.prompt_index.tolist() == list(
            range(len(ids))
        )
        reused.append(engine._conversations.reused_tokens)
        for i, response in enumerate(out.responses()):
            exact = recomputed_log_probs(engine, contexts[i], response, temperature)
            worst = max(worst, float((out.log_probs[i, : len(response)] - exact).abs().max()))
        # what the next turn may reuse: each context and its sampled tokens but the last (never decoded)
        grown = [c + r for c, r in zip(contexts, out.responses(), strict=True)]
        contexts = [
            c + torch.randint(0, 250, (1 + (i + turn) % 5,), generator=g).tolist()
            for i, c in enumerate(grown)
        ]
        keep = slice(1, None) if turn % 2 == 0 else slice(0, -1)
        expected_reuse.append(sum(len(c) - 1 for c in grown[keep]))
        ids, contexts = ids[keep], contexts[keep]
    return {"worst": worst, "reused": reused, "expected_reuse": [0, *expected_reuse[:-1]]}


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_turns_reuse_the_cache_and_equal_recomputing(family) -> None:
    """Ragged contexts, per-row budgets, rows stopping and leaving; Mistral's contexts outgrow its window."""
    arch = tiny_arch(family)
    full = random_full_state(arch, seed=1)
    engine, reference = make_engine(arch, full), make_engine(arch, full)
    assert isinstance(engine, ConversationEngine)
    result = _turns(engine, reference)
    assert result["worst"] < 1e-5
    # every token a conversation had computed was reused (nothing re-prefilled): context + samples - 1
    assert result["reused"] == result["expected_reuse"] and result["reused"][1] > 0


@pytest.mark.parametrize(
    "config", [{"stop_check_interval": 3}, {"max_cache_tokens": 60}], ids=["interval3", "waves"]
)
def test_stop_checks_and_waves_do_not_change_the_turns(config) -> None:
    arch = tiny_arch("llama")
    full = random_full_state(arch, seed=2)
    result = _turns(
        make_engine(arch, full, **config), make_engine(arch, full)
    )  # greedy: draws follow the batch
    assert result["worst"] < 1e-5


def test_sampled_turns_of_one_prompt_share_its_prefill_and_differ() -> None:
    arch = tiny_arch("llama")
    engine = make_engine(arch, random_full_state(arch, seed=3))
    params = SamplingParams(temperature=1.0, seed=4)
    out = engine.continue_conversations(list(range(8)), [PROMPTS[0]] * 8, params, [6] * 8)
    assert len({tuple(r) for r in out.token_ids.tolist()}) > 1
    for i, response in enumerate(out.responses()):
        exact = recomputed_log_probs(engine, PROMPTS[0], response)
        assert float((out.log_probs[i, : len(response)] - exact).abs().max()) < 1e-5


def test_an_edited_context_is_recomputed_and_new_weights_drop_the_cache() -> None:
    arch = tiny_arch("llama")
    full = random_full_state(arch, seed=5)
    engine, reference = make_engine(arch, full), make_engine(arch, full)
    greedy = SamplingParams(temperature=0.0)
    first = engine.continue_conversations([0, 1], PROMPTS[:2], greedy, [4, 4])
    edited = [[9, *PROMPTS[0][1:], *first.responses()[0]], PROMPTS[1] + first.responses()[1] + [7]]
    out = engine.continue_conversations([0, 1], edited, greedy, [4, 4])
    assert engine._conversations.reused_tokens == len(PROMPTS[1]) + len(first.responses()[1]) - 1
    assert torch.equal(
        out.token_ids, reference.continue_conversations([5, 6], edited, greedy, [4, 4]).token_ids
    )
    engine.load_weights([("norm.weight", torch.ones(arch.hidden_size))])
    engine.load_weights([])
    engine.continue_conversations([0], [edited[0] + out.responses()[0] + [1]], greedy, [2])
    assert engine._conversations.reused_tokens == 0  # keys and values of the old weights are never reused


def test_bad_turn_requests_are_refused() -> None:
    arch = tiny_arch("llama")
    engine = make_engine(arch, random_full_state(arch, seed=6))
    with pytest.raises(SamplingParamsError, match="n=2"):
        engine.continue_conversations([0], [[1]], SamplingParams(n=2), [3])
    with pytest.raises(ValueError, match="once per call"):
        engine.continue_conversations([0, 0], [[1], [2]], SamplingParams(), [3, 3])
    with pytest.raises(ValueError, match="one entry per conversation"):
        engine.continue_conversations([0, 1], [[1], [2]], SamplingParams(), [3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\]"):
        engine.continue_conversations([0], [[1]], SamplingParams(), [0])
    with pytest.raises(ValueError, match="outside"):
        engine.continue_conversations([0], [[arch.vocab_size]], SamplingParams(), [3])


def _two_turns(engine) -> list:
    contexts, outputs = [PROMPTS[0], PROMPTS[2]], []
    for turn in range(2):
        out = engine.continue_conversations(
            [0, 1], contexts, SamplingParams(seed=turn, stop_token_ids=STOPS), [5, 5]
        )
        outputs.append(out)
        contexts = [c + r + [11, 12] for c, r in zip(contexts, out.responses(), strict=True)]
    return outputs


def _tp2_and_tp1_turns() -> tuple[list, list]:
    arch = tiny_arch("qwen3")
    full = random_full_state(arch, seed=7)
    return _two_turns(make_engine(arch, full, tp_group=dist.group.WORLD)), _two_turns(make_engine(arch, full))


def test_tp2_ranks_agree_and_equal_tp1(run_distributed) -> None:
    (tp2, tp1), (other, _) = run_distributed(_tp2_and_tp1_turns)
    for a, b, c in zip(tp2, other, tp1, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.log_probs, b.log_probs)
        assert torch.equal(a.token_ids, c.token_ids) and float((a.log_probs - c.log_probs).abs().max()) < 1e-5
