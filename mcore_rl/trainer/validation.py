"""Sampling and scoring a prompt set on the actor's own engines: a run's validation (``StepBase.evaluate``,
with the samples ``logging.log_val_generations`` logs) and each pass of ``mcore-rl eval``
(:mod:`mcore_rl.trainer.evaluate`).

    PromptBatch [P] --actors.generate(sampling)--> RolloutBatch [P * n, prompt-major] --step.score--> [P * n]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.types import PromptBatch, RolloutBatch, RolloutRequest

if TYPE_CHECKING:
    from mcore_rl.agent.rollout import MultiTurnOutput
    from mcore_rl.data.tokenizer import Tokenizer
    from mcore_rl.engine.rollout.base import SamplingParams
    from mcore_rl.trainer.step import StepBase


PASS_THRESHOLD = 1.0
"""A sample answers right when its reward reaches this: the full score of a 0/1 or +-1 rule (a tool bonus on
top still passes, a partial format score does not); ``mcore-rl eval``'s default ``--pass-threshold``."""


@dataclass(frozen=True)
class Evaluation:
    """A validation or held-out test of a run: its samples' accuracy and mean reward."""

    accuracy: float
    """The share of samples whose reward reaches :data:`PASS_THRESHOLD` (what ``mcore-rl eval`` reports)."""
    reward: float
    """Their mean reward (the accuracy itself only for 0/1 rules: 2 x accuracy - 1 for +-1 rules)."""

    @classmethod
    def of(cls, scores: torch.Tensor) -> Evaluation:
        wide = scores.double()
        return cls(float((wide >= PASS_THRESHOLD).double().mean()), float(wide.mean()))


@dataclass
class ScoredRollout:
    """The scored responses of one generate call over a prompt set."""

    rollout: RolloutBatch
    """[P * n] rows, prompt-major (``rollout.prompt_index`` names each row's prompt)."""
    scores: torch.Tensor
    """[P * n] float32: each response's reward (the rules', as the step scores them)."""
    turns: MultiTurnOutput | None = None
    """The conversations of a multi-turn rollout (``rollout.multi_turn.enable``)."""

    @property
    def mean(self) -> float:
        return float(self.scores.mean())


def scored_parts(
    step: StepBase, prompts: PromptBatch, size: int | None, sampling: SamplingParams
) -> Iterator[tuple[PromptBatch, ScoredRollout]]:
    """``prompts`` sampled and scored ``size`` at a time (``data.val_batch_size``; None: in one call), each
    call with its own seed (``sampling``'s plus the part's index), in order."""
    for i, part in enumerate(prompts.parts(size)):
        seed = None if sampling.seed is None else sampling.seed + i
        yield part, generate_scored(step, part, dataclasses.replace(sampling, seed=seed))


def generate_scored(step: StepBase, prompts: PromptBatch, sampling: SamplingParams) -> ScoredRollout:
    """Sample ``prompts`` on the actor's own engines (current weights) and score every response; with
    ``rollout.multi_turn`` every prompt's conversations, routed to the replicas by row (no padding needed)."""
    if step.multi_turn is not None:
        from mcore_rl.trainer.multi_turn import GroupTurns

        step.actors.sync_weights()
        turns = step.multi_turn.run(
            GroupTurns(step.actors.backend, len(prompts) * sampling.n), prompts, sampling
        )
        scores = step.score(turns.batch, prompts, turns).scores
        step.actors.phase_memory()
        return ScoredRollout(turns.batch, scores, turns)
    # Repeat the last prompt so that every rollout replica gets as many; the repeats are not scored.
    extra = -len(prompts) % step.actors.num_rollout_shards
    ids = prompts.prompt_ids + [prompts.prompt_ids[-1]] * extra
    step.actors.sync_weights()
    rollout = step.actors.generate(RolloutRequest(ids, torch.arange(len(ids))), sampling)
    keep = rollout.prompt_index < len(prompts)
    rows: dict[str, Any] = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(RolloutBatch)}
    kept: dict[str, Any] = {name: None if value is None else value[keep] for name, value in rows.items()}
    rollout = RolloutBatch(**kept)
    scores = step.score(rollout, prompts).scores
    step.actors.phase_memory()  # validation's phases are not the next step's
    return ScoredRollout(rollout, scores)


def generation_samples(
    tokenizer: Tokenizer, prompts: PromptBatch, scored: ScoredRollout, limit: int
) -> list[dict[str, Any]]:
    """The first sample of each of the first ``limit`` prompts as ``{data_source, prompt, response,
    ground_truth, score}`` (``logging.log_val_generations``); a multi-turn sample also holds its
    ``conversation``."""
    first: dict[int, int] = {}
    for row, p in enumerate(scored.rollout.prompt_index.tolist()):
        if p < limit:
            first.setdefault(p, row)
    if scored.turns is not None:
        from mcore_rl.trainer.multi_turn import conversation_samples

        rows = [row for _, row in sorted(first.items())]
        return conversation_samples(tokenizer, scored.turns, scored.scores, limit, rows)
    responses = scored.rollout.responses()
    return [
        {
            "data_source": prompts.data_sources[p],
            "prompt": tokenizer.decode(prompts.prompt_ids[p]),
            "response": tokenizer.decode(responses[row]),
            "ground_truth": _plain(prompts.ground_truths[p]),
            "score": float(scored.scores[row]),
        }
        for p, row in sorted(first.items())
    ]


def _plain(value: Any) -> Any:
    """A JSON-writable ground truth (parquet may hand back numpy values or nested lists)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
