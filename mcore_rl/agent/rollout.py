"""The multi-turn rollout: every sample's conversation in flight together, turn by turn, over a token-in /
token-out engine (``ConversationEngine``: the embedded engine keeps each conversation's KV cache, vLLM its
prefix cache; on the driver, the actor's engines behind their worker group).

    prompts x n ──► engine.continue_conversations(every open conversation, its whole context)   (one batch)
        ▲                   │ model turns (tokens + log-probs)
        │                   ▼
        │           parse each turn (tool_parser) ── no call ──► environment step, or the conversation ends
        │                   │ calls
        │                   ▼
        │           tools and environment steps, all of the turn's at once, in sandboxed workers
        │                   │ answers (cut to max_tool_response_length tokens)
        └── append the template's tool turn (chat.py) ◄┘   ... until max_assistant_turns / response_length
                            ▼
          conversations ──► RolloutBatch (model-token mask), tool rewards, metrics (records.py)

A model turn that reaches the response budget ends its conversation (``length``); a tool turn that would not
fit the budget ends it too (``truncated``, logged with the sample). Malformed calls (bad JSON, an unknown tool,
wrong arguments), tools that raise and calls past their time limit are answered with an error message in the
conversation and counted; none stops the rollout.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.agent.chat import BadCall, ToolParser
from mcore_rl.agent.config import MultiTurnConfig, ScoreText
from mcore_rl.agent.executor import EnvAnswer, EnvTask, ToolExecutor, ToolTask
from mcore_rl.agent.records import Conversation, Segment, rollout_records, turn_metrics
from mcore_rl.agent.tools import ToolAnswer, ToolCall
from mcore_rl.data.chat_format import ChatFormat
from mcore_rl.engine.rollout.base import FINISH_LENGTH, ConversationEngine, SamplingParams, derived_seed
from mcore_rl.types import PromptBatch, RolloutBatch

log = logging.getLogger(__name__)


@dataclass
class MultiTurnOutput:
    """A multi-turn rollout: the batch training reads and what the step scores and logs."""

    batch: RolloutBatch
    """[N] rows, prompt-major; ``response_mask`` marks the model's own tokens."""
    tool_rewards: torch.Tensor
    """[N] float32: the rewards tools and the environment returned, summed per conversation."""
    score_texts: list[str]
    """[N] what the reward rules read (``rollout.multi_turn.score_text``)."""
    conversations: list[Conversation]

    def metrics(self) -> dict[str, float]:
        return turn_metrics(self.conversations)

    def state(self) -> dict[str, Any]:
        """What a run checkpoint keeps beside the batch (one-step-off's pending rollout), as JSON data: the
        tool rewards, the texts the rules read and the conversations (their dataset ``extra_info`` left out:
        only the environment read it, during the rollout)."""
        return {
            "tool_rewards": self.tool_rewards.tolist(),
            "score_texts": list(self.score_texts),
            "conversations": [{**dataclasses.asdict(c), "extra_info": {}} for c in self.conversations],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], batch: RolloutBatch) -> MultiTurnOutput:
        """:meth:`state` back, with the ``batch`` saved beside it; a state of another rollout is refused."""
        conversations = [
            Conversation(**{**c, "segments": [Segment(**s) for s in c["segments"]]})
            for c in state["conversations"]
        ]
        if (
            not len(conversations)
            == len(state["score_texts"])
            == len(state["tool_rewards"])
            == len(batch.tokens)
        ):
            raise ValueError(f"{len(conversations)} conversations for a rollout of {len(batch.tokens)} rows")
        tool_rewards = torch.tensor(state["tool_rewards"], dtype=torch.float32)
        return cls(batch, tool_rewards, list(state["score_texts"]), conversations)


class MultiTurnRollout:
    """Runs multi-turn rollouts with one chat format, parser and tool executor (module docstring)."""

    def __init__(
        self,
        cfg: MultiTurnConfig,
        chat: ChatFormat,
        parser: ToolParser,
        executor: ToolExecutor,
        response_length: int,
    ) -> None:
        self.cfg = cfg
        self.chat = chat
        self.parser = parser
        self.executor = executor
        self.response_length = response_length
        """Tokens after the prompt, the model's and the tools' together (``rollout.response_length``)."""

    def run(
        self, engine: ConversationEngine, prompts: PromptBatch, params: SamplingParams
    ) -> MultiTurnOutput:
        """``params.n`` conversations per prompt, prompt-major, to their ends."""
        conversations = [
            self._open(row, p, prompts)
            for p in range(len(prompts))
            for row in [p * params.n + k for k in range(params.n)]
        ]
        one = dataclasses.replace(params, n=1)
        self._truncated: list[str] = []
        try:
            for turn in range(self.cfg.max_assistant_turns):
                active = [c for c in conversations if not c.done]
                if not active:
                    break
                self._model_turn(engine, active, one, turn)
                self._answer(active, last_turn=turn + 1 == self.cfg.max_assistant_turns)
        finally:
            engine.end_conversations()
        if self._truncated:
            log.warning(
                "%d conversation(s) ended where the next tool or environment turn would not fit "
                "rollout.response_length=%d; first: %s",
                len(self._truncated),
                self.response_length,
                self._truncated[0],
            )
        tokenizer = self.chat.tokenizer
        batch = rollout_records(conversations, tokenizer.pad_token_id)
        if self.cfg.score_text == ScoreText.RESPONSE:
            texts = [tokenizer.decode(r) for r in batch.responses()]
        else:
            texts = [self.chat.answer_text(c.last_model_turn()) for c in conversations]
        rewards = torch.tensor([c.reward for c in conversations], dtype=torch.float32)
        return MultiTurnOutput(batch, rewards, texts, conversations)

    def _open(self, row: int, p: int, prompts: PromptBatch) -> Conversation:
        origin = prompts.origins[p] if prompts.origins else f"prompt {p}"
        extra = {
            **(prompts.extra_infos[p] if prompts.extra_infos else {}),
            "ground_truth": prompts.ground_truths[p] if prompts.ground_truths else None,
            "data_source": prompts.data_sources[p] if prompts.data_sources else None,
        }
        ids = list(prompts.prompt_ids[p])
        if prompts.messages:  # the row's own messages; copies: an environment may edit what it is given
            opening = copy.deepcopy(prompts.messages[p])
        else:  # a batch of token ids alone: the decoded prompt (template text and all) as one user message
            opening = [{"role": "user", "content": self.chat.answer_text(ids)}]
        return Conversation(row, p, ids, extra, f"sample {row} ({origin})", messages=opening)

    def _model_turn(
        self, engine: ConversationEngine, active: list[Conversation], params: SamplingParams, turn: int
    ) -> None:
        """One turn of every open conversation, in one engine call; a turn that used up the response budget
        ends its conversation."""
        if params.seed is not None:  # each turn its own draws, reproducible from the step's seed
            params = dataclasses.replace(params, seed=derived_seed(params.seed, turn))
        budgets = [self.response_length - c.response_len for c in active]
        out = engine.continue_conversations(
            [c.row for c in active], [c.context for c in active], params, budgets
        )
        for i, c in enumerate(active):
            n = int(out.lengths[i])
            ids, log_probs = out.token_ids[i, :n].tolist(), out.log_probs[i, :n].tolist()
            c.segments.append(Segment(ids, True, log_probs))
            c.messages.append({"role": "assistant", "content": self.chat.turn_text(ids)})
            c.turns += 1
            if out.finish_reasons[i] == FINISH_LENGTH:
                c.finish = "length"

    def _answer(self, active: list[Conversation], last_turn: bool) -> None:
        """Parse the turns just sampled, run their calls (or environment steps) together, and append what
        came back; conversations with nothing to run end. On the last turn nothing more may be sampled: the
        tool calls it asked for are not run, but the environment still judges a turn without one (its reward
        counts; an answer given on the last turn is scored like any other)."""
        tasks: list[ToolTask | EnvTask] = []
        owners: list[tuple[Conversation, list[ToolCall | BadCall]]] = []  # conversation, its calls in order
        spans: list[tuple[int, int]] = []
        for c in active:
            if c.done:
                continue
            calls = self._calls(c.messages[-1]["content"])
            c.bad_calls += sum(isinstance(call, BadCall) for call in calls)
            new: list[ToolTask | EnvTask]
            if not calls:
                if self.executor.environment is None:
                    c.finish = "answered"
                    continue
                # the environment's own copy with num_workers=0 too, as a worker's is (pickled)
                new = [EnvTask(copy.deepcopy(c.messages), c.extra_info, c.where)]
            else:
                c.tool_calls += len(calls)
                if last_turn:
                    c.finish = "max_turns"
                    continue
                new = [ToolTask(call, c.where) for call in calls if isinstance(call, ToolCall)]
            owners.append((c, calls))
            spans.append((len(tasks), len(tasks) + len(new)))
            tasks += new
        if not owners:
            return
        answers = self.executor.run(tasks)
        for (c, calls), (first, last) in zip(owners, spans, strict=True):
            if last_turn:
                answer = answers[first]
                assert isinstance(answer, EnvAnswer)  # a last turn runs environment steps only
                self._judge_last(c, answer)
            elif not calls:
                self._append(c, answers[first:last])
            else:
                self._append(c, _in_call_order(calls, answers[first:last]))

    def _calls(self, text: str) -> list[ToolCall | BadCall]:
        """A model turn's call blocks in the order written; the well-formed ones past
        ``max_tool_calls_per_turn`` become bad calls in their place."""
        calls: list[ToolCall | BadCall] = []
        runnable = 0
        for call in self.parser.parse(text).calls:
            if isinstance(call, ToolCall):
                runnable += 1
                if runnable > self.cfg.max_tool_calls_per_turn:
                    limit = self.cfg.max_tool_calls_per_turn
                    call = BadCall(f"{call.name}: more than {limit} tool calls in one turn")
            calls.append(call)
        return calls

    @staticmethod
    def _judge_last(c: Conversation, answer: EnvAnswer) -> None:
        """The environment's step on a conversation's last model turn: its reward counts and nothing is
        appended (no model turn would read it)."""
        c.reward += answer.step.reward
        if answer.status != "ok":
            c.env_errors += 1
            c.finish = "env_error"
        elif answer.step.done or answer.step.observation is None:
            c.finish = "env_done"
        else:
            c.finish = "max_turns"

    def _append(self, c: Conversation, answers: Sequence[ToolAnswer | EnvAnswer | BadCall]) -> None:
        """The answers of one conversation's turn (its calls' in call order, or its environment step) as the
        template's next turn(s), within the budgets."""
        messages: list[dict[str, str]] = []
        for answer in answers:
            if isinstance(answer, BadCall):  # counted when the turn was read
                messages.append({"role": "tool", "content": f"Error: {answer.message}"})
                continue
            if isinstance(answer, EnvAnswer):
                c.reward += answer.step.reward
                if answer.status != "ok":
                    c.env_errors += 1
                    c.finish = "env_error"
                    return
                if answer.step.done or answer.step.observation is None:
                    c.finish = "env_done"
                    return
                messages.append({"role": answer.step.role, "content": self._cut(c, answer.step.observation)})
                continue
            c.reward += answer.reward
            c.tool_errors += answer.status == "error"
            c.tool_timeouts += answer.status == "timeout"
            c.bad_calls += answer.status == "bad_call"
            messages.append({"role": "tool", "content": self._cut(c, answer.text)})
        turn = c.last_model_turn()
        ids = self.chat.next_turn_ids(messages, ended_by=turn[-1] if turn else None)
        room = self.response_length - c.response_len - len(ids)
        if room < 1:  # not even one model token would fit after it
            c.finish = "truncated"
            self._truncated.append(
                f"{c.where} before its turn {c.turns + 1}: {len(ids)} tokens of {messages[0]['role']} turn "
                f"after {c.response_len} tokens"
            )
            return
        c.segments.append(Segment(ids, False))
        c.messages += messages

    def _cut(self, c: Conversation, text: str) -> str:
        """``text`` cut to ``max_tool_response_length`` tokens (counted)."""
        tokenizer = self.chat.tokenizer
        ids = tokenizer.encode(text)
        if len(ids) <= self.cfg.max_tool_response_length:
            return text
        c.tool_truncations += 1
        return tokenizer.decode(ids[: self.cfg.max_tool_response_length]) + "..."


def _in_call_order(
    calls: Sequence[ToolCall | BadCall], answers: Sequence[ToolAnswer | EnvAnswer]
) -> list[ToolAnswer | EnvAnswer | BadCall]:
    """A turn's answers in the order of its call blocks (Hermes / Qwen templates match each
    ``<tool_response>`` to a call by position): each call's answer, a bad call in its own place."""
    ran = iter(answers)
    ordered = [call if isinstance(call, BadCall) else next(ran) for call in calls]
    assert next(ran, None) is None, "one answer per call that ran"
    return ordered
