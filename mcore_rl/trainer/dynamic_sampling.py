"""DAPO's dynamic sampling (``algorithm.filter_groups``; Yu et al. 2025, verl's ``filter_groups``): a prompt
group whose ``rollout.n`` responses all got the same value has a GRPO advantage of zero and only dilutes the
step, so it is dropped, and more prompts are drawn and sampled (with the same weights: still on-policy)
until ``data.train_batch_size`` groups with signal are kept; the first that many train.

    prompts ──► generate ──► score ──► keep the mixed groups ──┐
       ▲                                                       │ fewer than train_batch_size kept
       └────────── draw the next prompts ◄─────────────────────┘ (at most max_num_gen_batches rollouts)

The kept groups of every rollout are joined into one batch of exactly ``train_batch_size`` groups (rows
padded to the longest, prompt indices renumbered), so the update sees the shape it always does. The data
loader moves on by every batch drawn; its position is in each run checkpoint, so a resumed run draws what
the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.agent.rollout import MultiTurnOutput
from mcore_rl.algo.settings import FilterGroups, FilterMetric
from mcore_rl.controller.dispatch import concat_records
from mcore_rl.engine.packing.token_batching import select_rows
from mcore_rl.engine.rollout.batch import common_width
from mcore_rl.types import PromptBatch, RolloutBatch, ScoredBatch


@dataclass
class Sampled:
    """One rollout with its prompts and scores (a step's, or the kept part of several)."""

    rollout: RolloutBatch
    prompts: PromptBatch
    scored: ScoredBatch
    turns: MultiTurnOutput | None = None
    """A multi-turn rollout's conversations (their metrics and logged samples), row for row."""


def mixed_groups(values: Tensor, n: int) -> list[int]:
    """The groups (``n`` adjacent rows each) whose values are not all equal, in order."""
    groups = values.view(-1, n)
    return torch.nonzero((groups != groups[:, :1]).any(dim=1)).flatten().tolist()


def take_groups(sampled: Sampled, groups: Sequence[int], n: int) -> Sampled:
    """The rows of ``groups`` (in that order), their prompts renumbered 0..len(groups)-1."""
    kept = [g * n + k for g in groups for k in range(n)]
    rows = torch.tensor(kept, dtype=torch.long)
    rollout = select_rows(sampled.rollout, kept)
    rollout.prompt_index = torch.arange(len(groups)).repeat_interleave(n)
    index = torch.tensor(list(groups), dtype=torch.long)
    prompts = dataclasses.replace(
        sampled.prompts,
        prompt_ids=[sampled.prompts.prompt_ids[g] for g in groups],
        indices=sampled.prompts.indices[index],
        **{
            name: [getattr(sampled.prompts, name)[g] for g in groups]
            for name in _PROMPT_LISTS
            if getattr(sampled.prompts, name)
        },
    )
    scored = sampled.scored
    scored = dataclasses.replace(
        scored,
        scores=scored.scores[rows],
        rule_scores=scored.rule_scores[rows],
        model_scores=None if scored.model_scores is None else scored.model_scores[rows],
        extras={k: v[rows] for k, v in scored.extras.items()},
        overlong_penalty=None if scored.overlong_penalty is None else scored.overlong_penalty[rows],
    )
    turns = sampled.turns
    if turns is not None:
        turns = MultiTurnOutput(
            rollout,
            turns.tool_rewards[rows],
            [turns.score_texts[r] for r in kept],
            [turns.conversations[r] for r in kept],
        )
    return Sampled(rollout, prompts, scored, turns)


def join(parts: Sequence[Sampled], pad_id: int) -> Sampled:
    """The parts as one batch, rows in order (padded to the widest), prompt indices continued."""
    rollouts, offset = common_width([p.rollout for p in parts], pad_id), 0
    for rollout, part in zip(rollouts, parts, strict=True):
        rollout.prompt_index = rollout.prompt_index + offset
        offset += len(part.prompts)
    rollout = concat_records(rollouts)
    prompts = dataclasses.replace(
        parts[0].prompts,
        prompt_ids=[ids for p in parts for ids in p.prompts.prompt_ids],
        indices=torch.cat([p.prompts.indices for p in parts]),
        **{name: [x for p in parts for x in getattr(p.prompts, name)] for name in _PROMPT_LISTS},
    )
    turns = None
    conversations = [p.turns for p in parts if p.turns is not None]
    if len(conversations) == len(parts):
        turns = MultiTurnOutput(
            rollout,
            torch.cat([t.tool_rewards for t in conversations]),
            [text for t in conversations for text in t.score_texts],
            [c for t in conversations for c in t.conversations],
        )
    return Sampled(rollout, prompts, _joined_scores([p.scored for p in parts]), turns)


def sample_mixed_groups(
    first: Sampled,
    more: Callable[[], Sampled],
    settings: FilterGroups,
    batch_size: int,
    n: int,
    pad_id: int,
) -> tuple[Sampled, dict[str, float]]:
    """Exactly ``batch_size`` mixed groups: ``first``'s, then those of rollouts of further prompts from ``more``
    (sample and score), and the step's ``filter_groups/*`` metrics. A step that reaches
    ``max_num_gen_batches`` rollouts short of ``batch_size`` stops the run naming the shortfall."""
    kept, rollouts, seen, parts, failures = 0, 0, 0, [], [0, 0, 0]
    sampled = first
    while True:
        rollouts += 1
        seen += len(sampled.prompts)
        failures = [a + b for a, b in zip(failures, _failures(sampled.scored), strict=True)]
        values = _metric(sampled.scored, settings.metric)
        groups = mixed_groups(values, n)[: batch_size - kept]
        if groups:
            parts.append(take_groups(sampled, groups, n))
            kept += len(groups)
        if kept == batch_size:
            break
        if settings.max_num_gen_batches and rollouts >= settings.max_num_gen_batches:
            raise ValueError(
                f"algorithm.filter_groups: {rollouts} rollouts of {batch_size} prompts found only {kept} groups "
                f"whose {n} responses' {settings.metric} differ, short of data.train_batch_size={batch_size}: "
                "the prompts are too easy or too hard for the model (raise "
                "algorithm.filter_groups.max_num_gen_batches, 0 for no limit, or change the data)"
            )
        sampled = more()
    metrics = {
        "filter_groups/num_gen_batches": float(rollouts),
        "filter_groups/kept_frac": batch_size / seen,
    }
    joined = join(parts, pad_id)
    # the scorers' failures of every rollout the step sampled, kept groups or not
    joined.scored.num_errors, joined.scored.num_nonfinite, joined.scored.num_timeouts = failures
    return joined, metrics


def _metric(scored: ScoredBatch, metric: str) -> Tensor:
    """Each response's value that must vary within a kept group (``algorithm.filter_groups.metric``)."""
    if metric == FilterMetric.SEQ_REWARD:
        return scored.scores
    acc = scored.extras.get("acc")
    if metric == FilterMetric.ACC and acc is not None and not bool(torch.isnan(acc).any()):
        return acc
    return scored.rule_scores


def _failures(scored: ScoredBatch) -> list[int]:
    return [scored.num_errors, scored.num_nonfinite, scored.num_timeouts]


_PROMPT_LISTS = ("data_sources", "ground_truths", "extra_infos", "origins", "messages")
"""PromptBatch's per-prompt lists besides ``prompt_ids`` (``messages`` may be empty: not known)."""


def _joined_scores(parts: Sequence[ScoredBatch]) -> ScoredBatch:
    """The parts' rows in order (the scorers' failure counts are set by the caller)."""

    def cat(name: str) -> Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    names = parts[0].extras.keys()
    return ScoredBatch(
        scores=torch.cat([p.scores for p in parts]),
        rule_scores=torch.cat([p.rule_scores for p in parts]),
        model_scores=cat("model_scores"),
        extras={
            k: torch.cat([p.extras[k] for p in parts]) for k in names if all(k in p.extras for p in parts)
        },
        overlong_penalty=cat("overlong_penalty"),
    )
