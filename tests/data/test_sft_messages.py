"""SFT rows in the chat layout (one ``messages`` list, as verl multi-turn SFT, TRL and NeMo-RL keep it): split
at the first assistant turn, they give exactly the records of the prompt + response-trace layout; a bad chat
names its file, row and column; a file with neither layout names the columns it has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mcore_rl.data.config import DataConfig
from mcore_rl.data.rows import DataError, write_rows
from mcore_rl.data.sft import SFTDataset
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.data.tool_task import write_tokenizer

SINGLE_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "12*3="},
    {"role": "assistant", "content": "36"},
]
MULTI_TURN = [
    {"role": "user", "content": "12*3="},
    {"role": "assistant", "content": "36"},
    {"role": "user", "content": "and 4*5="},
    {"role": "assistant", "content": "20"},
]
CHATS = {
    "single_turn": (SINGLE_TURN, 2, "36<|im_end|>"),
    "multi_turn": (MULTI_TURN, 1, "36<|im_end|>20<|im_end|>"),
}
"""name: (chat, index of its first assistant turn, the target tokens decoded)."""
DATA = DataConfig(max_prompt_length=32, max_response_length=48)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("chatml")
    write_tokenizer(str(folder))
    return load_tokenizer(str(folder))


def _records(path: Path, rows: list[dict[str, Any]], tokenizer: Tokenizer, data: DataConfig = DATA) -> list:
    write_rows(str(path), rows)
    return SFTDataset.from_files([str(path)], tokenizer, data).records


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("name", sorted(CHATS))
def test_a_chat_gives_the_records_of_its_prompt_and_trace(
    tmp_path: Path, tokenizer: Tokenizer, suffix: str, name: str
) -> None:
    chat, first, targets = CHATS[name]
    split = _records(
        tmp_path / f"split{suffix}", [{"prompt": chat[:first], "response": chat[first:]}], tokenizer
    )
    chats = _records(tmp_path / f"chat{suffix}", [{"messages": chat}], tokenizer)
    assert chats == split
    record = chats[0]
    assert record.target_mask is not None
    trained = [t for t, m in zip(record.response_ids, record.target_mask, strict=True) if m]
    assert tokenizer.decode(trained, skip_special_tokens=False) == targets
    if name == "multi_turn":  # the user turn between the answers is context, not a target
        assert "and 4*5=" in tokenizer.decode(list(record.response_ids), skip_special_tokens=False)


def test_a_row_holding_both_layouts_reads_prompt_and_response(tmp_path: Path, tokenizer: Tokenizer) -> None:
    both = {"prompt": MULTI_TURN[:1], "response": MULTI_TURN[1:], "messages": SINGLE_TURN}
    assert _records(tmp_path / "both.jsonl", [both], tokenizer) == _records(
        tmp_path / "split.jsonl", [{"prompt": MULTI_TURN[:1], "response": MULTI_TURN[1:]}], tokenizer
    )


def test_a_prompt_without_a_response_beside_a_chat_reads_the_chat(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """UltraChat's layout: the first user turn as ``prompt`` beside the whole chat."""
    row = {"prompt": "12*3=", "messages": MULTI_TURN}
    assert _records(tmp_path / "ultrachat.parquet", [row], tokenizer) == _records(
        tmp_path / "chat.parquet", [{"messages": MULTI_TURN}], tokenizer
    )


BAD_CHATS = {
    "not a list": ("12*3= 36", "expected a list of chat messages, got '12\\*3= 36'"),
    "no assistant turn": (MULTI_TURN[:1], "no assistant turn to train on"),
    "no turn before the first assistant": (MULTI_TURN[1:], "starts with an assistant turn: no prompt turn"),
    "no user turn in the prompt": (
        [SINGLE_TURN[0], *MULTI_TURN[1:2]],
        r"no user turn before the first assistant turn \(roles \['system', 'assistant'\]\)",
    ),
    "a turn without content": (
        [MULTI_TURN[0], {"role": "assistant"}],
        "message 1 needs 'role' and 'content'",
    ),
    "a turn without role": ([{"content": "12*3="}, MULTI_TURN[1]], "message 0 needs 'role' and 'content'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHATS))
def test_a_bad_chat_is_named_or_skipped(tmp_path: Path, tokenizer: Tokenizer, case: str) -> None:
    chat, reason = BAD_CHATS[case]
    rows = [{"messages": MULTI_TURN}, {"messages": chat}]
    with pytest.raises(
        DataError, match=rf"bad\.jsonl: row 1: column 'messages': {reason}.*data\.skip_bad_rows"
    ):
        _records(tmp_path / "bad.jsonl", rows, tokenizer)
    skipping = DataConfig(max_prompt_length=32, max_response_length=48, skip_bad_rows=True)
    assert len(_records(tmp_path / "bad.jsonl", rows, tokenizer, skipping)) == 1


@pytest.mark.parametrize("skip_bad_rows", [False, True])
def test_a_file_with_neither_layout_names_its_columns(
    tmp_path: Path, tokenizer: Tokenizer, skip_bad_rows: bool
) -> None:
    rows = [{"question": "12*3=", "answer": "36"}, {"question": "4*5=", "answer": "20"}]
    data = DataConfig(max_prompt_length=32, max_response_length=48, skip_bad_rows=skip_bad_rows)
    with pytest.raises(DataError) as raised:
        _records(tmp_path / "qa.parquet", rows, tokenizer, data)
    assert str(raised.value) == (
        f"{tmp_path / 'qa.parquet'}: no row holds 'prompt' or 'messages'; it has columns answer, question: SFT "
        "reads data.prompt_key 'prompt' with sft.response_key 'response', or a chat list in sft.messages_key "
        "'messages'"
    )


def test_a_row_with_neither_layout_among_chats_is_a_bad_row(tmp_path: Path, tokenizer: Tokenizer) -> None:
    rows = [{"question": "12*3="}, {"messages": MULTI_TURN}]
    with pytest.raises(
        DataError, match="row 0: column 'prompt': missing, and no chat list in 'messages' either"
    ):
        _records(tmp_path / "mixed.jsonl", rows, tokenizer)
    skipping = DataConfig(max_prompt_length=32, max_response_length=48, skip_bad_rows=True)
    assert len(_records(tmp_path / "mixed.jsonl", rows, tokenizer, skipping)) == 1


def test_the_chat_column_is_a_setting(tmp_path: Path, tokenizer: Tokenizer) -> None:
    write_rows(str(tmp_path / "chat.jsonl"), [{"conversation": MULTI_TURN}])
    records = SFTDataset.from_files(
        [str(tmp_path / "chat.jsonl")], tokenizer, DATA, messages_key="conversation"
    ).records
    assert records == _records(tmp_path / "default.jsonl", [{"messages": MULTI_TURN}], tokenizer)
