"""Reading tool calls (Hermes) and writing the turns after a model turn through the tokenizer's template; the
tokens of a multi-turn SFT example are those a rollout of the same turns holds."""

from __future__ import annotations

import pytest

from mcore_rl.agent.chat import BadCall, HermesParser, load_parser
from mcore_rl.agent.tools import ToolCall, ToolError
from mcore_rl.data.chat_format import ChatFormat, conversation_ids
from mcore_rl.data.tokenizer import TokenizerError, load_tokenizer, write_tokenizer_config
from mcore_rl.data.tool_task import Product
from tests.agent.common import chatml_tokenizer, write_qwen3_like_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return chatml_tokenizer(str(tmp_path_factory.mktemp("chatml")))


def test_hermes_calls_and_malformed_ones() -> None:
    parse = HermesParser().parse
    turn = parse(
        'Let me.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "g"}</tool_call>'
    )
    assert turn.content == "Let me." and turn.calls == [ToolCall("f", {"x": 1}), ToolCall("g", {})]
    assert parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>').calls == [
        ToolCall("f", {"x": 2})
    ]
    assert parse("just text").calls == [] and parse("just text").content == "just text"
    bad = parse(
        '<tool_call>{"name": </tool_call><tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f"}'
    )
    assert bad.calls == [
        BadCall("tool call 1 is not valid JSON (Expecting value at character 8)"),
        BadCall('tool call 2 must be a JSON object with a "name" (and "arguments")'),
        BadCall("a <tool_call> was not closed with </tool_call>"),
    ]
    # one list in the order written: Hermes / Qwen match the <tool_response>s to the calls by position
    mixed = parse('<tool_call>{bad</tool_call><tool_call>{"name": "g"}</tool_call><tool_call>[]</tool_call>')
    assert [type(c).__name__ for c in mixed.calls] == ["BadCall", "ToolCall", "BadCall"]
    assert isinstance(load_parser("hermes"), HermesParser)
    with pytest.raises(ToolError, match="choose one of hermes or module:Class"):
        load_parser("mistral")


def test_the_appended_turns_are_the_templates_own_rendering(tokenizer) -> None:
    chat = ChatFormat(tokenizer)
    problem = Product(123, 45)
    prompt = tokenizer.encode(tokenizer.chat_text([{"role": "user", "content": problem.prompt}]))
    ids, mask = conversation_ids(tokenizer, chat, prompt, problem.trace())
    whole = tokenizer.chat_text([{"role": "user", "content": problem.prompt}, *problem.trace()], False)
    assert tokenizer.encode(whole) == prompt + ids + tokenizer.encode("\n")  # the template's last newline
    assert sum(mask) == len(tokenizer.encode(problem.trace()[0]["content"])) + len(problem.answer) + 2
    two_tools = chat.next_turn_ids([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert tokenizer.decode(two_tools, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(TokenizerError, match="must end with an assistant turn"):
        conversation_ids(tokenizer, chat, prompt, problem.trace()[:2])


def test_a_tokenizer_without_template_uses_the_fallback(tmp_path) -> None:
    from mcore_rl.data.tool_task import write_tokenizer

    write_tokenizer(str(tmp_path))
    write_tokenizer_config(str(tmp_path), eos_token="<|im_end|>", pad_token="<pad>")
    with pytest.warns(UserWarning, match="no chat template"):
        plain = load_tokenizer(str(tmp_path))
        ids = ChatFormat(plain).next_turn_ids([{"role": "tool", "content": "7"}])
    assert plain.decode(ids) == "\ntool: 7\nassistant: "


def test_tools_are_listed_in_the_prompt_through_the_template(tmp_path) -> None:
    from mcore_rl.agent.tools import load_tools
    from mcore_rl.data.chat_format import WithTools
    from mcore_rl.data.tool_task import CHAT_TEMPLATE, write_tokenizer

    write_tokenizer(str(tmp_path))
    listed = "{%- if tools %}{{- '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    write_tokenizer_config(
        str(tmp_path), eos_token="<|im_end|>", pad_token="<pad>", chat_template=listed + CHAT_TEMPLATE
    )
    plain = load_tokenizer(str(tmp_path))
    wrapped = WithTools(plain, [t.schema() for t in load_tools(["mcore_rl.agent.calculator:calculator"])])
    prompt = wrapped.chat_text([{"role": "user", "content": "2*3="}])
    assert prompt.startswith('<|im_start|>system\n[{"type": "function", "function": {"name": "calculator"')
    assert prompt.endswith("<|im_start|>user\n2*3=<|im_end|>\n<|im_start|>assistant\n")
    assert plain.chat_text([{"role": "user", "content": "2*3="}]).startswith("<|im_start|>user")
    answer = [{"role": "tool", "content": "6"}]  # the tool turn is the same tokens in the tools' context
    assert ChatFormat(wrapped).next_turn_ids(answer) == ChatFormat(plain).next_turn_ids(answer)


def test_a_turn_ended_by_the_templates_close_token_is_not_closed_twice(tmp_path) -> None:
    """A base model's eos (here ``<pad>``) is not ChatML's ``<|im_end|>``, which a run gives as a stop id
    (Qwen base: ``<|endoftext|>`` and ``rollout.stop_token_ids=[<|im_end|>]``): a turn it ended is closed by
    the rest of the template's close, as the template renders the conversation, and the parser reads the turn
    without it."""
    from mcore_rl.data.tool_task import CHAT_TEMPLATE, write_tokenizer

    write_tokenizer(str(tmp_path))
    write_tokenizer_config(str(tmp_path), eos_token="<pad>", pad_token="<pad>", chat_template=CHAT_TEMPLATE)
    base = load_tokenizer(str(tmp_path))
    chat = ChatFormat(base)
    im_end = base.encode("<|im_end|>")[-1]
    turn = [*base.encode("ok"), im_end]
    answer = [{"role": "tool", "content": "7"}]
    after = base.decode(chat.next_turn_ids(answer, ended_by=im_end), skip_special_tokens=False)
    assert (
        after == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    rendered = base.chat_text(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": "ok"}, *answer], True
    )
    assert rendered.endswith("ok" + base.decode(turn[-1:], skip_special_tokens=False) + after)
    assert chat.turn_text(turn) == "ok"
    eos_ended = base.decode(chat.next_turn_ids(answer, ended_by=base.eos_token_id), skip_special_tokens=False)
    assert eos_ended == "<|im_end|>" + after  # an eos the close does not begin with stays, the close follows


def test_the_probe_refuses_a_template_that_cannot_append_tool_turns(tokenizer, tmp_path) -> None:
    """Qwen3's template adds an empty ``<think>`` block to the last assistant turn only: a ChatFormat builds,
    and the first tool turn of a rollout would fail; the probe fails the same way, at once."""
    write_qwen3_like_tokenizer(str(tmp_path))
    chat = ChatFormat(load_tokenizer(str(tmp_path)))
    for role in ("tool", "user"):
        with pytest.raises(TokenizerError, match=f"differently when a {role} turn follows it"):
            chat.check_appendable([role])
    ChatFormat(tokenizer).check_appendable(["tool", "user"])  # ChatML appends either
