"""The driver's side of multi-turn rollouts (``rollout.multi_turn.enable``): the agent loop
(``mcore_rl/agent/rollout.py``) built from the run config, over the rollout replicas of a worker group.

    MultiTurnRollout.run(GroupTurns(backend, N), prompts, sampling)
        each turn: the open conversations routed to the replica that holds them (row r of N -> replica
        r * R // N, the split a single-turn rollout uses), one ``generate_turn`` on every rank, the owners'
        outputs joined back in request order; at the end ``end_conversations`` frees the engines' caches.

A conversation stays on one replica for all its turns, so the embedded engine finds its KV cache there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mcore_rl.agent.chat import load_parser
from mcore_rl.agent.config import MultiTurnConfig
from mcore_rl.agent.executor import ToolExecutor
from mcore_rl.agent.records import conversation_record
from mcore_rl.agent.rollout import MultiTurnOutput, MultiTurnRollout
from mcore_rl.agent.tools import load_tools
from mcore_rl.config import RunConfig
from mcore_rl.controller.backend import Backend
from mcore_rl.controller.dispatch import rollout_owners
from mcore_rl.data.chat_format import WithTools, chat_format_of
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.engine.rollout.base import FINISH_LENGTH, FINISH_STOP, GenerationOutput, SamplingParams
from mcore_rl.scoring.process_pool import TaskLimits
from mcore_rl.types import TurnRequest


def route_turns(conversations: Sequence[int], num_conversations: int, num_replicas: int) -> list[list[int]]:
    """For each replica, the positions in ``conversations`` of those it holds: conversation r of
    ``num_conversations`` lives on replica ``r * num_replicas // num_conversations`` (contiguous blocks)."""
    routed: list[list[int]] = [[] for _ in range(num_replicas)]
    for position, row in enumerate(conversations):
        if not 0 <= row < num_conversations:
            raise ValueError(f"conversation {row} is not one of the rollout's {num_conversations}")
        routed[row * num_replicas // num_conversations].append(position)
    return routed


class GroupTurns:
    """A :class:`~mcore_rl.engine.rollout.base.ConversationEngine` over a worker group's rollout replicas (the
    actor's colocated engines or a rollout pool's), for one rollout of ``num_conversations``."""

    def __init__(self, backend: Backend, num_conversations: int) -> None:
        self.backend = backend
        self.num_conversations = num_conversations
        self.owners = rollout_owners(backend.infos)

    def continue_conversations(
        self,
        conversations: Sequence[int],
        contexts: Sequence[Sequence[int]],
        params: SamplingParams,
        max_new_tokens: Sequence[int],
    ) -> GenerationOutput:
        routed = route_turns(conversations, self.num_conversations, len(self.owners))
        shards = [
            TurnRequest(
                [conversations[i] for i in part],
                [list(contexts[i]) for i in part],
                [max_new_tokens[i] for i in part],
            )
            for part in routed
        ]
        results = self.backend.submit("generate_turn", shards, "rollout", params)()
        return _joined([results[o] for o in self.owners], routed, len(conversations), params.pad_token_id)

    def end_conversations(self) -> None:
        self.backend.submit("end_conversations", None, "")()


def _joined(
    outputs: list[GenerationOutput | None], routed: list[list[int]], num: int, pad_id: int
) -> GenerationOutput:
    """The replicas' outputs (None where a replica had nothing to sample) in request order."""
    width = max((o.token_ids.shape[1] for o in outputs if o is not None), default=1)
    token_ids = torch.full((num, width), pad_id, dtype=torch.long)
    log_probs = torch.zeros(num, width)
    lengths = torch.zeros(num, dtype=torch.long)
    reasons = [FINISH_STOP] * num
    for out, part in zip(outputs, routed, strict=True):
        if out is None:
            continue
        index = torch.tensor(part, dtype=torch.long)
        token_ids[index, : out.token_ids.shape[1]] = out.token_ids
        log_probs[index, : out.log_probs.shape[1]] = out.log_probs
        lengths[index] = out.lengths
        for i, reason in zip(part, out.finish_reasons, strict=True):
            reasons[i] = reason if reason in (FINISH_STOP, FINISH_LENGTH) else FINISH_STOP
    return GenerationOutput(torch.arange(num), token_ids, log_probs, lengths, reasons)


def check_multi_turn(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    """What refuses a multi-turn run before any worker starts: tools that do not load or have no schema, an
    environment or parser that does not load, a chat template that cannot append tool turns (probed: else
    the run dies at the first tool call, after every worker started and sampled a turn). ``tokenizer``: the
    one the rollout renders with (:func:`prompt_tokenizer`'s)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    load_tools(mt.tools)
    load_parser(mt.tool_parser)
    # tool answers are tool turns; an environment's observations are user turns unless it says tool
    roles = [*(["tool"] if mt.tools else []), *(["user"] if mt.environment else [])]
    chat_format_of(tokenizer).check_appendable(roles)
    if mt.environment:
        from mcore_rl.agent.environment import load_environment

        load_environment(mt.environment)


def prompt_tokenizer(cfg: RunConfig, tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer a run encodes its prompts with: with multi-turn tools (``tools_in_prompt``), one whose
    chat template lists them in every prompt."""
    mt = cfg.rollout.multi_turn
    if not (mt.enable and mt.tools and mt.tools_in_prompt):
        return tokenizer
    return WithTools(tokenizer, [t.schema() for t in load_tools(mt.tools)])


def build_multi_turn(cfg: RunConfig, tokenizer: Tokenizer) -> MultiTurnRollout | None:
    """The run's multi-turn rollout (its tool workers start at the first call); None when off."""
    mt: MultiTurnConfig = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    limits = TaskLimits(mt.num_workers, mt.timeout_s, mt.memory_limit_bytes, what="tool")
    executor = ToolExecutor(load_tools(mt.tools), mt.environment, limits)
    return MultiTurnRollout(
        mt, chat_format_of(tokenizer), load_parser(mt.tool_parser), executor, cfg.rollout.response_length
    )


def conversation_samples(
    tokenizer: Tokenizer,
    output: MultiTurnOutput,
    scores: torch.Tensor,
    limit: int,
    rows: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """The first ``limit`` conversations (of ``rows``, default all) as ``generations.jsonl`` rows: the usual
    columns (the response is everything after the prompt, special tokens kept so the turns show) and the
    conversation itself."""
    samples = []
    for row in list(range(len(output.conversations)) if rows is None else rows)[:limit]:
        c, score = output.conversations[row], float(scores[row])
        response = [t for s in c.segments for t in s.ids]
        samples.append(
            {
                "data_source": c.extra_info.get("data_source"),
                "prompt": tokenizer.decode(c.prompt, skip_special_tokens=False),
                "response": tokenizer.decode(response, skip_special_tokens=False),
                "ground_truth": _plain(c.extra_info.get("ground_truth")),
                "score": score,
                "conversation": conversation_record(c, score),
            }
        )
    return samples


def _plain(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


class TurnsAhead:
    """One-step-off on a rollout pool: the next step's multi-turn rollout driven from a thread of the driver
    while the actor updates (the pool's ranks are not the actor's, and each group runs its calls in order).
    Joined where its conversations are read and before the pool's weights change (``StepBase``); an error of
    the rollout is raised there."""

    def __init__(self, sample: Callable[[], MultiTurnOutput]) -> None:
        self._started = time.perf_counter()
        self._result: MultiTurnOutput | None = None
        self._error: BaseException | None = None
        self.seconds: float | None = None
        """Wall seconds the rollout took, once it has ended."""
        self._thread = threading.Thread(
            target=self._run, args=(sample,), name="mcore-rl-turns-ahead", daemon=True
        )
        self._thread.start()

    def _run(self, sample: Callable[[], MultiTurnOutput]) -> None:
        try:
            self._result = sample()
        except BaseException as err:  # raised where the rollout is awaited, in the driver's main thread
            self._error = err
        finally:
            self.seconds = time.perf_counter() - self._started

    def turns(self) -> MultiTurnOutput:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
