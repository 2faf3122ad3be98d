"""Preference data: text and chat rows from jsonl and parquet, masks, length filtering, bad rows named."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from mcore_rl.config import DataConfig
from mcore_rl.data.arithmetic import CharTokenizer
from mcore_rl.data.demo_task import write_tokenizer
from mcore_rl.data.preference import PreferenceBatch, PreferenceDataset, wrong_answer
from mcore_rl.data.rows import DataError, write_rows
from mcore_rl.data.tokenizer import load_tokenizer, write_tokenizer_config
from tests.data.conftest import TEMPLATE, train_bpe

CHARS = CharTokenizer()


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory):  # the demo's character tokenizer (PAD 0, EOS 1)
    folder = tmp_path_factory.mktemp("tok") / "digits"
    write_tokenizer(str(folder))
    return load_tokenizer(str(folder))


def data_config(**kwargs) -> DataConfig:
    return DataConfig(max_prompt_length=8, max_response_length=5, **kwargs)


ROWS = [
    {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
    {"prompt": [{"role": "user", "content": "12+30="}], "chosen": "42", "rejected": "52"},
]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_text_and_message_prompts_tokenise_and_mask(digits, tmp_path: Path, suffix: str) -> None:
    # Two files (parquet wants one type per column): text prompts, then chat prompts.
    paths = [str(tmp_path / f"text.{suffix}"), str(tmp_path / f"chat.{suffix}")]
    write_rows(paths[0], ROWS[:1])
    write_rows(paths[1], ROWS[1:])
    dataset = PreferenceDataset.from_files(paths, digits, data_config())
    first = dataset.records[0]
    assert first.prompt_ids == tuple(CHARS.encode("1+2="))
    assert first.chosen_ids == (*CHARS.encode("3"), CHARS.EOS)
    assert first.rejected_ids == (*CHARS.encode("4"), CHARS.EOS)
    assert dataset.records[1].chosen_ids == (*CHARS.encode("42"), CHARS.EOS)

    batch = dataset.batch([0, 1])
    assert batch.num_pairs == 2 and batch.tokens.shape == (4, 9)
    # Rows: chosen 0, chosen 1, rejected 0, rejected 1; row 2 is "1+2=4</s>" then padding.
    assert batch.tokens[2].tolist() == [*CHARS.encode("1+2=4"), CHARS.EOS, 0, 0, 0]
    # The mask marks the positions predicting the completion: '=' predicts '4', '4' predicts EOS.
    assert batch.loss_mask[2].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert batch.loss_mask[1].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0]


def test_pairs_keep_chosen_and_rejected_together(digits, tmp_path: Path) -> None:
    path = str(tmp_path / "p.jsonl")
    write_rows(path, [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "0"} for i in range(1, 5)])
    batch = PreferenceDataset.from_files([path], digits, data_config()).batch(range(4), width_multiple=4)
    assert batch.tokens.shape[1] % 4 == 0
    part = batch.pairs(1, 3)
    assert part.num_pairs == 2
    assert part.tokens.tolist() == batch.tokens[[1, 2, 5, 6]].tolist()
    assert isinstance(part, PreferenceBatch)


def test_chat_completions_are_what_the_template_adds(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(train_bpe(tmp_path / "hf", with_config=True)))
    user = [{"role": "user", "content": "the cat sat"}]
    row = {
        "prompt": user,
        "chosen": [{"role": "assistant", "content": "on a mat"}],
        "rejected": [{"role": "assistant", "content": "in the box"}],
    }
    path = str(tmp_path / "chat.jsonl")
    write_rows(path, [row])
    record = PreferenceDataset.from_files([path], tokenizer, DataConfig()).records[0]
    assert (
        tokenizer.decode(list(record.prompt_ids), skip_special_tokens=False)
        == "<|user|>the cat sat</s><|assistant|>"
    )
    # The template closes the turn with </s> (the EOS), so no second EOS is appended.
    assert tokenizer.decode(list(record.chosen_ids), skip_special_tokens=False) == "on a mat</s>"
    assert record.rejected_ids[-1] == tokenizer.eos_token_id
    assert record.rejected_ids.count(tokenizer.eos_token_id) == 1


def test_chat_completions_stop_at_the_stop_token_the_template_closes_with(tmp_path: Path) -> None:
    # ChatML closes a turn with "<|im_end|>\n": the model stops at <|im_end|> (its EOS here) and is not
    # trained on the newline after it, nor on a second EOS.
    folder = train_bpe(tmp_path / "hf", with_config=False)
    template = TEMPLATE.replace("</s>", "</s>\n")
    write_tokenizer_config(str(folder), eos_token="</s>", pad_token="<pad>", chat_template=template)
    tokenizer = load_tokenizer(str(folder))
    row = {
        "prompt": [{"role": "user", "content": "the cat sat"}],
        "chosen": [{"role": "assistant", "content": "on a mat"}],
        "rejected": [{"role": "assistant", "content": "in the box"}],
    }
    path = str(tmp_path / "chat.jsonl")
    write_rows(path, [row])
    record = PreferenceDataset.from_files([path], tokenizer, DataConfig()).records[0]
    assert tokenizer.decode(list(record.chosen_ids), skip_special_tokens=False) == "on a mat</s>"
    assert tokenizer.decode(list(record.rejected_ids), skip_special_tokens=False) == "in the box</s>"


def test_overlong_pairs_refused_or_dropped_with_a_count(digits, tmp_path: Path, caplog) -> None:
    path = str(tmp_path / "long.jsonl")
    rows = [
        *ROWS,
        {"prompt": "123456+1=", "chosen": "1", "rejected": "2"},
        {"prompt": "1=", "chosen": "12345678901", "rejected": "1"},
    ]
    write_rows(path, rows)
    with pytest.raises(
        DataError,
        match=rf"{path}: row 2: column 'prompt': prompt has 9 tokens, more than data.max_prompt_length=8",
    ):
        PreferenceDataset.from_files([path], digits, data_config())
    with caplog.at_level(logging.WARNING):
        dataset = PreferenceDataset.from_files([path], digits, data_config(filter_overlong_prompts=True))
    assert len(dataset) == 2 and dataset.num_dropped == {"overlong": 2, "bad": 0}
    assert "dropped 2 over-long preference pairs" in caplog.text
    only = str(tmp_path / "pair.jsonl")
    write_rows(only, rows[3:])
    with pytest.raises(DataError, match=r"row 0: column 'chosen': pair has 14 tokens .* more than 13"):
        PreferenceDataset.from_files([only], digits, data_config())
    assert len(PreferenceDataset.from_files([only], digits, data_config(), max_length=14)) == 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "1+1=", "chosen": "2", "rejected": ""}, "row 0: column 'rejected': empty prompt"),
        (
            {"prompt": "1+1=", "chosen": [{"content": "2"}], "rejected": "3"},
            "row 0: column 'chosen': message 0 needs 'role'",
        ),
        (
            {"prompt": "1+1=", "chosen": 2, "rejected": "3"},
            "row 0: column 'chosen': expected text or a list of messages",
        ),
    ],
)
def test_bad_rows_are_named(digits, tmp_path: Path, row: dict, message: str) -> None:
    path = str(tmp_path / "bad.jsonl")
    write_rows(path, [row])
    with pytest.raises(DataError, match=f"{path}: {message}"):
        PreferenceDataset.from_files([path], digits, data_config())


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        (
            "prompt",
            "set data.prompt_key to the column of the prompt (now 'prompt'), or give NeMo-RL's ranked",
        ),
        ("chosen", "set dpo.chosen_key to the column of the preferred completion (now 'chosen')"),
        ("rejected", "set dpo.rejected_key to the column of the other completion (now 'rejected')"),
    ],
)
def test_a_column_no_row_has_is_a_wrong_key_named_with_the_files_columns(
    digits, tmp_path: Path, drop: str, expected: str, skip: bool
) -> None:
    """Said row by row before, with advice to skip bad rows, which then skipped every row."""
    path = str(tmp_path / "pairs.parquet")
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "0", "question": "q"} for i in range(3)]
    write_rows(path, [{k: v for k, v in r.items() if k != drop} for r in rows])
    with pytest.raises(DataError) as refused:
        PreferenceDataset.from_files([path], digits, data_config(skip_bad_rows=skip))
    message = str(refused.value)
    assert message.startswith(f"{path}: no row has column {drop!r} (its columns: ") and expected in message
    assert "question" in message and "skip_bad_rows" not in message


def test_a_column_some_rows_have_is_still_a_bad_row(digits, tmp_path: Path) -> None:
    path = str(tmp_path / "pairs.jsonl")
    write_rows(path, [ROWS[0], {"prompt": "1+1=", "chosen": "2"}])
    with pytest.raises(
        DataError, match=rf"{path}: row 1: column 'rejected': missing \(set data.skip_bad_rows"
    ):
        PreferenceDataset.from_files([path], digits, data_config())
    kept = PreferenceDataset.from_files([path], digits, data_config(skip_bad_rows=True))
    assert len(kept) == 1 and kept.num_dropped == {"overlong": 0, "bad": 1}


def test_bad_rows_skipped_and_counted(digits, tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n" + json.dumps({"prompt": "1="}) + "\n")
    with pytest.raises(DataError, match=r"row 1: column '<line>': not valid JSON"):
        PreferenceDataset.from_files([str(path)], digits, data_config())
    dataset = PreferenceDataset.from_files([str(path)], digits, data_config(skip_bad_rows=True))
    assert len(dataset) == 1 and dataset.num_dropped == {"overlong": 0, "bad": 2}


def test_fingerprint_changes_with_the_data(digits, tmp_path: Path) -> None:
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    write_rows(a, ROWS)
    write_rows(b, [ROWS[0], {**ROWS[1], "rejected": "43"}])
    fingerprint = PreferenceDataset.from_files([a], digits, data_config()).fingerprint()
    assert fingerprint == PreferenceDataset.from_files([a], digits, data_config()).fingerprint()
    assert fingerprint != PreferenceDataset.from_files([b], digits, data_config()).fingerprint()


def test_wrong_answers_differ_in_one_digit() -> None:
    rng = random.Random(0)
    for answer in ["0", "7", "10", "579", "1998"] * 40:
        wrong = wrong_answer(answer, rng)
        assert len(wrong) == len(answer) and wrong != answer
        assert sum(x != y for x, y in zip(wrong, answer, strict=True)) == 1
        assert len(wrong) == 1 or wrong[0] != "0"


def test_nemo_rl_ranked_rows(digits, tmp_path: Path) -> None:
    """NeMo-RL's ``context`` + ranked ``completions``: the lower rank is the chosen one, whatever the order."""
    user = [{"role": "user", "content": "1+2="}]
    rows = [
        {
            "context": user,
            "completions": [
                {"rank": 1, "completion": [{"role": "assistant", "content": "4"}]},
                {"rank": 0, "completion": [{"role": "assistant", "content": "3"}]},
            ],
        },
        {
            "context": user,
            "completions": [{"rank": 0, "completion": [{"role": "assistant", "content": "3"}]}],
        },
    ]
    path = str(tmp_path / "ranked.jsonl")
    write_rows(path, rows)
    with pytest.raises(
        DataError, match=r"row 1: column 'completions': expected two completions .* ranks \[0\]"
    ):
        PreferenceDataset.from_files([path], digits, data_config())
    record = PreferenceDataset.from_files([path], digits, data_config(skip_bad_rows=True)).records[0]
    assert record.chosen_ids == (*CHARS.encode("3"), CHARS.EOS)
    assert record.rejected_ids == (*CHARS.encode("4"), CHARS.EOS)
    assert record.prompt_ids == tuple(CHARS.encode("1+2="))
