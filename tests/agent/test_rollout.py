"""The multi-turn loop: tool calls parsed, run in worker processes and answered as the template's tool turn; bad
calls, raising and hanging tools answered with errors and counted; limits; the model-token mask; and, with the
embedded engine, every conversation's turns continued from its KV cache with log-probs a whole-sequence
forward agrees with; the conversation an environment reads opens with the dataset row's own messages."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mcore_rl.agent.chat import load_parser
from mcore_rl.agent.config import MultiTurnConfig
from mcore_rl.agent.executor import ToolExecutor
from mcore_rl.agent.records import conversation_record
from mcore_rl.agent.rollout import MultiTurnOutput, MultiTurnRollout
from mcore_rl.agent.tools import load_tools
from mcore_rl.config import DataConfig
from mcore_rl.data.chat_format import ChatFormat
from mcore_rl.data.prompts import PromptDataset
from mcore_rl.data.rows import write_rows
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import SamplingParams
from mcore_rl.scoring.process_pool import TaskLimits
from tests.agent.common import ScriptedTurns, chatml_tokenizer, prompts
from tests.engine.rollout.common import make_engine, random_full_state, recomputed_log_probs

CALC = "mcore_rl.agent.calculator:calculator"


def _call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _rollout(tokenizer, cfg: MultiTurnConfig, response_length: int = 200) -> MultiTurnRollout:
    limits = TaskLimits(cfg.num_workers, cfg.timeout_s, cfg.memory_limit_bytes, what="tool")
    executor = ToolExecutor(load_tools(cfg.tools), cfg.environment, limits)
    return MultiTurnRollout(
        cfg, ChatFormat(tokenizer), load_parser(cfg.tool_parser), executor, response_length
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return chatml_tokenizer(str(tmp_path_factory.mktemp("chatml")))


def _model_and_context_text(tokenizer, batch, row: int) -> tuple[str, str]:
    """The row's tokens the mask marks as the model's, and the others after the prompt, decoded."""
    tokens, mask = batch.tokens[row], batch.response_mask[row]
    start = int(torch.nonzero(mask)[0]) + 1
    end = start + int(batch.response_lengths[row])
    model = [int(tokens[t]) for t in range(start, end) if mask[t - 1] > 0]
    context = [int(tokens[t]) for t in range(start, end) if mask[t - 1] == 0]
    return tokenizer.decode(model, skip_special_tokens=False), tokenizer.decode(
        context, skip_special_tokens=False
    )


def test_tool_calls_bad_calls_and_raising_tools_in_one_batched_rollout(tokenizer, caplog) -> None:
    cfg = MultiTurnConfig(
        enable=True,
        tools=[CALC, "tests.agent.user_tools:explode", "tests.agent.user_tools:scored_lookup"],
        num_workers=2,
    )
    script = {
        0: [_call("calculator", expression="123*45"), "5535"],
        1: ['<tool_call>{"name": "calculator", "arguments": {"expression": "1+</tool_call>', "3"],
        2: [_call("calc", expression="2*3"), "6"],
        3: [_call("calculator", expr="2*3"), "6"],
        4: [_call("explode", reason="test"), "?"],
        5: [_call("scored_lookup", key="x") + _call("scored_lookup", key="y"), "42"],
        6: ["7"],
        7: ['<tool_call>["calculator"]</tool_call>', "7"],
    }
    engine = ScriptedTurns(tokenizer, script)
    batch_prompts = prompts(tokenizer, ["123*45=", "1+2=", "2*3=", "3+4="], ["5535", "3", "6", "7"])
    with caplog.at_level(logging.WARNING), _rollout(tokenizer, cfg).executor as executor:
        rollout = _rollout(tokenizer, cfg)
        rollout.executor = executor
        out = rollout.run(
            engine, batch_prompts, SamplingParams(n=2, seed=0, pad_token_id=tokenizer.pad_token_id)
        )
    # every open conversation in each engine call: one call per turn, the one that answered left after turn 1
    assert engine.calls == [list(range(8)), [0, 1, 2, 3, 4, 5, 7]] and engine.ended == 1
    eos = "<|im_end|>"
    for row, turns in script.items():
        model, context = _model_and_context_text(tokenizer, out.batch, row)
        assert model == "".join(t + eos for t in turns)  # the mask marks exactly the model's tokens
        if len(turns) > 1:
            assert context.startswith("\n<|im_start|>user\n<tool_response>\n") and context.endswith(
                "assistant\n"
            )
    context = {row: _model_and_context_text(tokenizer, out.batch, row)[1] for row in script}
    assert "5535" in context[0]
    assert "tool call 1 is not valid JSON" in context[1]
    assert "unknown tool 'calc'; the tools are: calculator, explode, scored_lookup" in context[2]
    assert "wrong arguments for calculator: 'expression' is a required property" in context[3]
    assert "Error: explode ZeroDivisionError: exploded on test" in context[4]
    assert context[5].count("<tool_response>") == 2 and "42" in context[5] and "unknown" in context[5]
    assert 'must be a JSON object with a "name"' in context[7]
    # the raising tool is reported with its name and the sample
    assert any("tool explode on sample 4 (test.jsonl row 2)" in r.getMessage() for r in caplog.records)
    metrics = out.metrics()
    assert metrics["multi_turn/bad_calls"] == 4  # bad JSON, unknown tool, wrong arguments, no name
    assert metrics["multi_turn/tool_errors"] == 1 and metrics["multi_turn/tool_timeouts"] == 0
    assert metrics["multi_turn/turns_max"] == 2 and metrics["multi_turn/answered_rate"] == 1.0
    assert metrics["multi_turn/tool_calls_max"] == 2
    assert out.tool_rewards.tolist() == [0, 0, 0, 0, 0, 0.5, 0, 0]  # scored_lookup: +1 and -0.5
    assert out.score_texts == [t[-1] for t in script.values()]
    assert metrics["multi_turn/model_tokens_mean"] == pytest.approx(out.batch.response_mask.sum().item() / 8)


def test_tool_responses_follow_the_order_of_the_calls(tokenizer) -> None:
    """Hermes / Qwen match each <tool_response> to a <tool_call> by position: a malformed call, a good one, an
    unknown tool and one past ``max_tool_calls_per_turn`` are answered in the order written."""
    cfg = MultiTurnConfig(enable=True, tools=[CALC], num_workers=0, max_tool_calls_per_turn=2)
    first = (
        "<tool_call>{bad json</tool_call>"
        + _call("calculator", expression="2*3")
        + _call("calc", expression="1")
        + _call("calculator", expression="7*7")
    )
    out = _rollout(tokenizer, cfg, response_length=400).run(
        ScriptedTurns(tokenizer, {0: [first, "6"]}),
        prompts(tokenizer, ["q"], ["6"]),
        SamplingParams(pad_token_id=tokenizer.pad_token_id),
    )
    answers = [m["content"] for m in out.conversations[0].messages if m["role"] == "tool"]
    assert len(answers) == 4 and answers[1] == "6"
    assert answers[0].startswith("Error: tool call 1 is not valid JSON")
    assert answers[2].startswith("Error: unknown tool 'calc'")
    assert answers[3] == "Error: calculator: more than 2 tool calls in one turn"
    assert out.metrics()["multi_turn/bad_calls"] == 3 and out.metrics()["multi_turn/tool_calls_max"] == 4


def test_timeouts_max_turns_and_truncation(tokenizer, caplog) -> None:
    cfg = MultiTurnConfig(
        enable=True,
        tools=[CALC, "tests.agent.user_tools:hang"],
        num_workers=1,
        timeout_s=1.0,
        max_assistant_turns=2,
        max_tool_response_length=12,
    )
    script = {
        0: [_call("hang", seconds=30), "done"],  # killed at its time limit; the worker is replaced
        1: [_call("calculator", expression="2**40"), _call("calculator", expression="1+1")],  # max turns
        2: [_call("calculator", expression="9" * 30 + "*9"), "x"],  # answer cut to 12 tokens
        3: [_call("calculator", expression="1+1") * 5, "2"],  # the tool turn would not fit the budget
    }
    engine = ScriptedTurns(tokenizer, script)
    batch_prompts = prompts(tokenizer, ["a", "b", "c", "d"], ["", "", "", ""])
    rollout = _rollout(tokenizer, cfg, response_length=80)
    with caplog.at_level(logging.WARNING), rollout.executor:
        out = rollout.run(engine, batch_prompts, SamplingParams(n=1, pad_token_id=tokenizer.pad_token_id))
    finishes = [c.finish for c in out.conversations]
    assert finishes == ["answered", "max_turns", "answered", "truncated"]
    assert "\nError: hang ...\n" in _model_and_context_text(tokenizer, out.batch, 0)[1]  # cut at 12 tokens
    assert "\n899999999999...\n</tool_response>" in _model_and_context_text(tokenizer, out.batch, 2)[1]
    metrics = out.metrics()
    assert (
        metrics["multi_turn/tool_timeouts"] == 1 and metrics["multi_turn/tool_truncations"] == 3
    )  # and 2**40
    assert metrics["multi_turn/max_turns_rate"] == 0.25 and metrics["multi_turn/truncated_rate"] == 0.25
    assert int(out.batch.response_lengths.max()) <= 80
    assert any("would not fit rollout.response_length=80" in r.getMessage() for r in caplog.records)
    assert any("sample 3 (test.jsonl row 3)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("turns", "finish", "reward"),
    [(1, "max_turns", 0.25), (2, "max_turns", 0.5), (3, "env_done", 1.5)],
)
def test_the_environment_judges_the_last_turn_too(tokenizer, turns, finish, reward) -> None:
    """CountdownEnv pays 0.25 per model turn and 1.0 at the third, when it ends the conversation: with
    ``max_assistant_turns`` at 1-3 the last turn's step still runs and counts (it is not sampled after)."""
    cfg = MultiTurnConfig(
        enable=True,
        environment="tests.agent.user_tools:CountdownEnv",
        num_workers=0,
        max_assistant_turns=turns,
    )
    engine = ScriptedTurns(tokenizer, {0: ["a", "b", "c"]})
    out = _rollout(tokenizer, cfg, response_length=80).run(
        engine, prompts(tokenizer, ["x"], ["7"]), SamplingParams(n=1, pad_token_id=tokenizer.pad_token_id)
    )
    (c,) = out.conversations
    assert (c.turns, c.finish, c.reward) == (turns, finish, pytest.approx(reward))
    assert out.tool_rewards.tolist() == [pytest.approx(reward)]
    context = _model_and_context_text(tokenizer, out.batch, 0)[1]
    assert context.count("go on 7") == turns - 1  # no observation after the last turn


def test_non_finite_tool_and_environment_rewards_are_counted_errors(tokenizer) -> None:
    """A NaN or infinite reward never reaches the training reward (a NaN advantage for the whole group): it
    is a tool (environment) error, answered (ended) and counted, as a scorer's NaN scores 0 and is counted."""
    tools = MultiTurnConfig(enable=True, tools=["tests.agent.user_tools:nan_reward"], num_workers=0)
    engine = ScriptedTurns(tokenizer, {0: [_call("nan_reward", key="x"), "42"], 1: ["42"]})
    out = _rollout(tokenizer, tools).run(
        engine, prompts(tokenizer, ["q"], ["42"]), SamplingParams(n=2, pad_token_id=tokenizer.pad_token_id)
    )
    assert out.tool_rewards.tolist() == [0.0, 0.0] and out.metrics()["multi_turn/tool_errors"] == 1
    assert "the reward nan, not a finite number" in _model_and_context_text(tokenizer, out.batch, 0)[1]
    env = MultiTurnConfig(enable=True, environment="tests.agent.user_tools:InfiniteEnv", num_workers=0)
    out = _rollout(tokenizer, env).run(
        ScriptedTurns(tokenizer, {0: ["a"]}),
        prompts(tokenizer, ["q"], ["7"]),
        SamplingParams(pad_token_id=tokenizer.pad_token_id),
    )
    assert out.tool_rewards.tolist() == [0.0] and out.conversations[0].finish == "env_error"
    assert out.metrics()["multi_turn/env_errors"] == 1


def test_a_model_turn_that_reaches_the_budget_ends_its_conversation(tokenizer) -> None:
    cfg = MultiTurnConfig(enable=True, tools=[CALC], num_workers=0)
    engine = ScriptedTurns(tokenizer, {0: ["1" * 50]})
    out = _rollout(tokenizer, cfg, response_length=12).run(
        engine, prompts(tokenizer, ["x"], ["1"]), SamplingParams(n=1, pad_token_id=tokenizer.pad_token_id)
    )
    assert out.conversations[0].finish == "length" and int(out.batch.response_lengths[0]) == 12
    assert out.metrics()["multi_turn/length_rate"] == 1.0


def test_a_pluggable_parser(tokenizer) -> None:
    cfg = MultiTurnConfig(
        enable=True,
        tools=["tests.agent.user_tools:with_schema"],
        tool_parser="tests.agent.user_tools:BracketParser",
    )
    engine = ScriptedTurns(tokenizer, {0: ["[[shout]]", "ok"]})
    rollout = _rollout(tokenizer, MultiTurnConfig(**{**vars(cfg), "num_workers": 0}))
    out = rollout.run(engine, prompts(tokenizer, ["x"], ["ok"]), SamplingParams(pad_token_id=0))
    assert (
        "wrong arguments for shout: 'q' is a required property"
        in _model_and_context_text(tokenizer, out.batch, 0)[1]
    )


def _engine_for(tokenizer):
    arch = ModelArch.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
        }
    )
    return make_engine(arch, random_full_state(arch, seed=3))


def test_the_embedded_engine_continues_every_conversation_from_its_cache(tokenizer) -> None:
    """An environment keeps each conversation going for three model turns: the engine's log-probs equal a
    whole-sequence forward at the model's tokens, the environment's tokens are off the mask, and each turn
    reused everything the engine had computed of the conversation."""
    cfg = MultiTurnConfig(enable=True, environment="tests.agent.user_tools:CountdownEnv", num_workers=0)
    engine = _engine_for(tokenizer)
    reused = []
    original = engine._conversations.turn

    def counting(*args, **kwargs):
        result = original(*args, **kwargs)
        reused.append(engine._conversations.reused_tokens)
        return result

    engine._conversations.turn = counting  # observe what each turn reused
    rollout = _rollout(tokenizer, cfg, response_length=60)
    stops = [tokenizer.eos_token_id, *range(40, 128, 3)]  # turns of a few tokens from a random model
    params = SamplingParams(n=3, seed=1, stop_token_ids=stops, pad_token_id=tokenizer.pad_token_id)
    out = rollout.run(engine, prompts(tokenizer, ["12*3=", "4+5="], ["36", "9"]), params)
    batch = out.batch
    assert [c.turns for c in out.conversations if c.finish == "env_done"] and reused[0] == 0 and reused[1] > 0
    for row, c in enumerate(out.conversations):
        assert c.finish in ("env_done", "length", "truncated")
        if c.finish == "env_done":
            assert c.turns == 3 and c.reward == pytest.approx(1.5)
        sequence = c.context
        prompt = sequence[: len(c.prompt)]
        response = sequence[len(c.prompt) :]
        exact = recomputed_log_probs(engine, prompt, response, 1.0)
        mask = batch.response_mask[row, len(prompt) - 1 : len(sequence) - 1] > 0
        got = batch.rollout_log_probs[row, len(prompt) - 1 : len(sequence) - 1]
        assert float((got[mask] - exact[mask]).abs().max()) < 1e-5
        assert (got[~mask] == 0).all() and int(mask.sum()) == c.model_tokens
    assert "go on 36" in tokenizer.decode(out.conversations[0].context, skip_special_tokens=False)
    assert out.tool_rewards.max() == pytest.approx(1.5)


def _recorded_rollout(tmp_path, tokenizer, prompt) -> tuple[PromptDataset, MultiTurnOutput, list[dict]]:
    """One dataset row with ``prompt``, loaded as a training run loads it, in a multi-turn rollout on the
    embedded engine whose RecordingEnv writes down every conversation it is given (two steps each)."""
    seen, data = tmp_path / "seen.jsonl", str(tmp_path / "train.jsonl")
    row = {
        "data_source": "mcore_rl/tool_calc",
        "prompt": prompt,
        "reward_model": {"ground_truth": "15"},
        "extra_info": {"row": 0, "record_to": str(seen)},
    }
    write_rows(data, [row])
    dataset = PromptDataset.from_files([data], tokenizer, DataConfig(max_prompt_length=64))
    cfg = MultiTurnConfig(enable=True, environment="tests.agent.user_tools:RecordingEnv", num_workers=0)
    stops = [tokenizer.eos_token_id, *range(40, 128, 3)]  # turns of a few tokens from a random model
    params = SamplingParams(seed=1, stop_token_ids=stops, pad_token_id=tokenizer.pad_token_id)
    out = _rollout(tokenizer, cfg, response_length=200).run(
        _engine_for(tokenizer), dataset.batch([0]), params
    )
    return dataset, out, [json.loads(line) for line in seen.read_text().splitlines()]


def _check_opening(tokenizer, out: MultiTurnOutput, seen: list[dict], opening: list[dict]) -> None:
    """The environment read ``opening`` and then the turns, each step the whole conversation so far; the
    logged conversation is the same, untouched by the environment's edits of its copy."""
    (c,) = out.conversations
    assert c.finish == "env_done" and c.turns == 2 and len(seen) == 2
    chat = ChatFormat(tokenizer)
    model_turns = [{"role": "assistant", "content": chat.turn_text(s.ids)} for s in c.segments if s.model]
    assert seen[0]["conversation"] == [*opening, model_turns[0]]
    again = {"role": "user", "content": "again"}
    assert seen[1]["conversation"] == [*opening, model_turns[0], again, model_turns[1]]
    assert c.messages == seen[1]["conversation"]
    assert conversation_record(c)["messages"] == c.messages


def test_the_environment_reads_the_rows_own_messages(tmp_path, tokenizer) -> None:
    """verl's ``raw_prompt`` / NeMo-RL's ``message_log``: a chat-format row's system and user messages open the
    conversation (they were the chat template's rendered prompt, flattened into one user message), while the
    model still reads the template's rendering."""
    messages = [
        {"role": "system", "content": "Add the numbers."},
        {"role": "user", "content": "12+3="},
    ]
    dataset, out, seen = _recorded_rollout(tmp_path, tokenizer, messages)
    rendered = tokenizer.encode(tokenizer.chat_text(messages, add_generation_prompt=True))
    assert out.conversations[0].prompt == rendered  # the model's input is unchanged
    _check_opening(tokenizer, out, seen, messages)
    assert list(dataset.records[0].messages) == messages  # the environment edited copies
    assert dataset.batch([0]).part(slice(0, 1)).messages == [messages]


def test_a_plain_text_prompt_opens_as_one_user_message(tmp_path, tokenizer) -> None:
    dataset, out, seen = _recorded_rollout(tmp_path, tokenizer, "12+3=")
    assert out.conversations[0].prompt == [*tokenizer.text_prefix, *tokenizer.encode("12+3=")]
    _check_opening(tokenizer, out, seen, [{"role": "user", "content": "12+3="}])
    assert list(dataset.records[0].messages) == [{"role": "user", "content": "12+3="}]


def test_a_batch_without_messages_opens_with_the_decoded_prompt(tokenizer) -> None:
    """A batch built from token ids alone (no row messages) keeps the decoded prompt as one user message."""
    cfg = MultiTurnConfig(enable=True, tools=[CALC], num_workers=0)
    batch = prompts(tokenizer, ["12+3="], ["15"])
    out = _rollout(tokenizer, cfg).run(
        ScriptedTurns(tokenizer, {0: ["15"]}), batch, SamplingParams(pad_token_id=tokenizer.pad_token_id)
    )
    decoded = tokenizer.decode(batch.prompt_ids[0], skip_special_tokens=True)
    assert out.conversations[0].messages[0] == {"role": "user", "content": decoded}
