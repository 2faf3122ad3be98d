"""Multi-turn SFT traces (the tool demo's): the tokens are a rollout's of the same turns and only the
assistant's tokens are targets; a malformed trace names its row."""

from __future__ import annotations

import os

import pytest

from mcore_rl.data.config import DataConfig
from mcore_rl.data.rows import DataError, write_rows
from mcore_rl.data.sft import SFTDataset
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.data.tool_task import Product, rows, write_tokenizer


def test_tool_traces_train_on_the_assistant_turns_only(tmp_path) -> None:
    write_tokenizer(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    problems = [Product(123, 45), Product(700, 10)]
    traces = rows(problems, "sft", with_response=True)
    for row, problem in zip(traces, problems, strict=True):
        row["response"] = problem.trace()  # both with the tool (the generator gives a quarter of them one)
    write_rows(str(tmp_path / "sft.jsonl"), traces)
    data = DataConfig(train_files=[str(tmp_path / "sft.jsonl")], max_prompt_length=16, max_response_length=48)
    dataset = SFTDataset.from_files(data.train_files, tokenizer, data)
    batch = dataset.batch([0, 1])
    for row, problem in enumerate(problems):
        targets = batch.labels[row][batch.loss_mask[row] > 0].tolist()
        call = problem.trace()[0]["content"]
        assert (
            tokenizer.decode(targets, skip_special_tokens=False)
            == f"{call}<|im_end|>{problem.answer}<|im_end|>"
        )
        context = batch.tokens[row][: int((batch.tokens[row] != tokenizer.pad_token_id).sum())]
        assert "<tool_response>\n" + problem.answer in tokenizer.decode(
            context.tolist(), skip_special_tokens=False
        )
    # the direct answer of the no-tool baseline from the same rows
    direct = SFTDataset.from_files(
        data.train_files, tokenizer, data, response_key="reward_model.ground_truth"
    )
    assert (
        direct.records[0].target_mask is None and direct.records[0].response_ids[-1] == tokenizer.eos_token_id
    )


def test_a_trace_that_does_not_start_with_the_assistant_is_named(tmp_path) -> None:
    write_tokenizer(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    bad = rows([Product(123, 45)], "sft", with_response=True)
    bad[0]["response"] = Product(123, 45).trace()[1:]
    write_rows(os.path.join(tmp_path, "bad.jsonl"), bad)
    data = DataConfig(train_files=[str(tmp_path / "bad.jsonl")], max_prompt_length=16, max_response_length=48)
    with pytest.raises(
        DataError, match="row 0: column 'response': a multi-turn response starts with an assistant"
    ):
        SFTDataset.from_files(data.train_files, tokenizer, data)


def test_a_quarter_of_the_generated_traces_call_the_tool() -> None:
    from mcore_rl.data.tool_task import TOOL_FRACTION, make_products

    responses = [r["response"] for r in rows(make_products(2000, seed=0), "sft", with_response=True)]
    with_tool = sum(len(r) == 3 for r in responses)
    assert abs(with_tool / 2000 - TOOL_FRACTION) < 0.03 and all(len(r) in (1, 3) for r in responses)


def test_structured_tool_calls_are_named_not_dropped(tmp_path) -> None:
    """An OpenAI-style assistant turn (empty content, ``tool_calls``) trained as a bare stop token."""
    write_tokenizer(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    bad = rows([Product(123, 45)], "sft", with_response=True)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 123, "b": 45}}}
    bad[0]["response"] = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5535", "name": "multiply"},
        {"role": "assistant", "content": "5535"},
    ]
    write_rows(os.path.join(tmp_path, "bad.jsonl"), bad)
    data = DataConfig(train_files=[str(tmp_path / "bad.jsonl")], max_prompt_length=16, max_response_length=48)
    with pytest.raises(DataError, match="row 0: column 'response': an assistant turn's tool_calls"):
        SFTDataset.from_files(data.train_files, tokenizer, data)


def test_a_response_ending_in_the_stop_token_gets_no_second(tmp_path) -> None:
    write_tokenizer(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    examples = rows([Product(123, 45), Product(7, 8)], "sft", with_response=True)
    examples[0]["response"], examples[1]["response"] = "5535<|im_end|>", "56"
    write_rows(os.path.join(tmp_path, "sft.jsonl"), examples)
    data = DataConfig(train_files=[str(tmp_path / "sft.jsonl")], max_prompt_length=16, max_response_length=48)
    records = SFTDataset.from_files(data.train_files, tokenizer, data).records
    eos = tokenizer.eos_token_id
    for record in records:
        assert record.response_ids[-1] == eos and record.response_ids[-2] != eos
