"""A prompt message keeps its fields besides role and content: an assistant message's ``tool_calls`` (OpenAI's
and verl's multi-turn prompts; chat templates render them) was dropped, so the model read an empty assistant
turn and then a tool's answer to a call it never made. verl hands the messages to the template as stored."""

from __future__ import annotations

from pathlib import Path

from mcore_rl.config import DataConfig
from mcore_rl.data.prompts import PromptDataset
from mcore_rl.data.rows import write_rows
from mcore_rl.data.tokenizer import load_tokenizer, write_tokenizer_config
from tests.data.conftest import train_bpe

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c['function']['name'] }}{% endfor %}{% endif %}"
    "</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tool_calls_of_a_prompt_message_reach_the_template(tmp_path: Path) -> None:
    folder = train_bpe(tmp_path / "tok", with_config=False)
    write_tokenizer_config(str(folder), eos_token="</s>", pad_token="<pad>", chat_template=TEMPLATE)
    tok = load_tokenizer(folder)
    messages = [
        {"role": "user", "content": "how many apples"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "count", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "user", "content": "then"},
    ]
    path = str(tmp_path / "d.jsonl")
    write_rows(
        path, [{"data_source": "openai/gsm8k", "prompt": messages, "reward_model": {"ground_truth": "5"}}]
    )
    ds = PromptDataset.from_files([path], tok, DataConfig(max_prompt_length=512))
    expected = tok.encode(tok.chat_text(messages, add_generation_prompt=True))
    assert "call count" in tok.chat_text(messages)  # the template does render it
    assert list(ds.records[0].prompt_ids) == expected
