"""Prompt datasets: verl rows from jsonl and parquet, chat templates, over-long prompts, bad rows (one
table, each error naming file, row and column), and the resumable shuffled position."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_rl.config import DataConfig
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.rows import DataError, write_rows
from mcore_rl.data.sampler import EpochSampler
from mcore_rl.data.sft import SFTDataset
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer


def row(i: int, prompt: Any = None, **changes: Any) -> dict[str, Any]:
    base = {
        "data_source": "openai/gsm8k",
        "prompt": prompt if prompt is not None else [{"role": "user", "content": f"the cat sat {i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"split": "train", "index": i},
    }
    base.update(changes)
    return base


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dirs: dict[str, Path]) -> Tokenizer:
    return load_tokenizer(tokenizer_dirs["hf"])


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_rows_load_with_verl_columns(suffix: str, tmp_path: Path, hf_tok: Tokenizer) -> None:
    path, text_path = str(tmp_path / f"d.{suffix}"), str(tmp_path / f"text.{suffix}")
    write_rows(path, [row(0)])  # a parquet column holds one kind: messages here, text in the next file
    write_rows(text_path, [row(1, prompt="plain text prompt")])
    ds = PromptDataset.from_files([path, text_path], hf_tok, DataConfig(max_prompt_length=64))
    first, second = ds.records
    assert list(first.prompt_ids) == hf_tok.encode("<|user|>the cat sat 0</s><|assistant|>")
    assert list(second.prompt_ids) == hf_tok.encode("plain text prompt")  # text prompts: no template
    assert (first.data_source, first.ground_truth, first.extra_info) == (
        "openai/gsm8k",
        "0",
        row(0)["extra_info"],
    )
    no_template = PromptDataset.from_files(
        [path], hf_tok, DataConfig(max_prompt_length=64, apply_chat_template=False)
    )
    assert list(no_template.records[0].prompt_ids) == hf_tok.encode("the cat sat 0")
    batch = ds.batch([1, 0])
    tokens, lengths = batch.padded(hf_tok.pad_token_id)
    assert tokens.shape == (2, int(lengths.max())) and batch.indices.tolist() == [1, 0]
    assert tokens[0, lengths[0] :].eq(hf_tok.pad_token_id).all()
    assert batch.shard(1, 2).ground_truths == ["0"]
    assert batch.origins == [f"{text_path} row 0", f"{path} row 0"]


def test_overlong_prompts_are_refused_or_counted(
    tmp_path: Path, hf_tok: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "d.jsonl")
    write_rows(path, [row(0), row(1, prompt="the cat " * 40), row(2)])
    with pytest.raises(
        DataError,
        match=rf"{path}: row 1: column 'prompt': prompt has \d+ tokens, more than data.max_prompt_length=20",
    ):
        PromptDataset.from_files([path], hf_tok, DataConfig(max_prompt_length=20))
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset.from_files(
            [path], hf_tok, DataConfig(max_prompt_length=20, filter_overlong_prompts=True)
        )
    assert [r.row for r in ds.records] == [0, 2] and len(ds.skipped) == 1
    assert "skipped 1 of 3 rows" in caplog.text


def _bad(**changes: Any) -> dict[str, Any]:
    return row(5, **changes)


def _without(key: str) -> dict[str, Any]:
    out = row(5)
    del out[key]
    return out


# (row placed at index 1 of a jsonl file, column the error must name, reason text)
BAD_ROWS = [
    (_without("prompt"), "prompt", "missing"),
    (_without("data_source"), "data_source", "missing"),
    (_without("reward_model"), "reward_model.ground_truth", "missing"),
    (_bad(reward_model={"style": "rule"}), "reward_model.ground_truth", "missing"),
    (_bad(reward_model={"ground_truth": None}), "reward_model.ground_truth", "missing"),
    (_bad(prompt=""), "prompt", "empty prompt"),
    (_bad(prompt=42), "prompt", "expected text or a list of messages"),
    (_bad(prompt=[]), "prompt", "empty prompt (no messages)"),
    (_bad(prompt="  \n"), "prompt", "empty prompt"),
    (_bad(prompt=[{"role": "user", "content": " "}]), "prompt", "empty prompt (every message is empty)"),
    (_bad(prompt=[{"content": "hi"}]), "prompt", "message 0 needs 'role' and 'content'"),
    (_bad(prompt=["hi"]), "prompt", "message 0 needs 'role' and 'content'"),
    (
        _bad(prompt=[{"role": "system", "content": None}, {"role": "user", "content": "hi"}]),
        "prompt",
        "message 0: expected a role and text content",
    ),
    (
        _bad(prompt=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        "prompt",
        "message 0: expected a role and text content",
    ),
    (_bad(extra_info=[1, 2]), "extra_info", "expected a mapping"),
    ("{not json", "<line>", "not valid JSON"),
]


@pytest.mark.parametrize(("bad", "col", "reason"), BAD_ROWS, ids=[f"{c}:{r}" for _, c, r in BAD_ROWS])
def test_bad_rows_name_file_row_and_column(
    bad: Any, col: str, reason: str, tmp_path: Path, hf_tok: Tokenizer
) -> None:
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(row(0)), bad if isinstance(bad, str) else json.dumps(bad), json.dumps(row(2))]
    path.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(max_prompt_length=64)
    with pytest.raises(DataError) as info:
        PromptDataset.from_files([str(path)], hf_tok, cfg)
    assert f"{path}: row 1: column {col!r}: {reason}" in str(info.value)
    skipping = PromptDataset.from_files(
        [str(path)], hf_tok, DataConfig(max_prompt_length=64, skip_bad_rows=True)
    )
    assert [r.row for r in skipping.records] == [0, 2] and skipping.skipped[0].column == col


def test_text_content_parts_read_as_their_text(tmp_path: Path, hf_tok: Tokenizer) -> None:
    # OpenAI's content parts; read as str() they were the literal "[{'type': 'text', ...}]".
    parts = [{"type": "text", "text": "the cat "}, {"type": "text", "text": "sat 0"}]
    path = str(tmp_path / "parts.jsonl")
    write_rows(path, [row(0, prompt=[{"role": "user", "content": parts}]), row(0)])
    records = PromptDataset.from_files([path], hf_tok, DataConfig(max_prompt_length=64)).records
    assert records[0].prompt_ids == records[1].prompt_ids


def test_bad_files_are_named(tmp_path: Path, hf_tok: Tokenizer) -> None:
    cfg = DataConfig(max_prompt_length=64)
    with pytest.raises(DataError, match=r"absent\.parquet: no such data file"):
        PromptDataset.from_files([str(tmp_path / "absent.parquet")], hf_tok, cfg)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"d.csv: unknown data format; use .parquet, .jsonl or .json"):
        PromptDataset.from_files([str(tmp_path / "d.csv")], hf_tok, cfg)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable parquet file"):
        PromptDataset.from_files([str(tmp_path / "broken.parquet")], hf_tok, cfg)
    write_rows(str(tmp_path / "e.jsonl"), [row(0, prompt="  "), row(1, prompt=[])])
    with pytest.raises(DataError, match="no usable prompts"):
        PromptDataset.from_files([str(tmp_path / "e.jsonl")], hf_tok, DataConfig(skip_bad_rows=True))


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        ("prompt", "set data.prompt_key to the column of the prompt (now 'prompt')"),
        ("data_source", "set data.reward_fn_key to the column naming each row's scorer"),
        ("reward_model", "RL rows hold the answer as reward_model.ground_truth, as verl's do"),
    ],
)
def test_a_column_no_row_has_is_a_wrong_key_named_with_the_files_columns(
    drop: str, expected: str, skip: bool, tmp_path: Path, hf_tok: Tokenizer
) -> None:
    """Said row by row before, with advice to skip bad rows, which then skipped every row."""
    path = str(tmp_path / "q.parquet")
    rows = [row(i) for i in range(3)]
    for r in rows:
        r["question"] = r.pop("prompt") if drop == "prompt" else "q"
        r.pop(drop, None)
    write_rows(path, rows)
    with pytest.raises(DataError) as refused:
        PromptDataset.from_files([path], hf_tok, DataConfig(max_prompt_length=64, skip_bad_rows=skip))
    message = str(refused.value)
    column = "reward_model.ground_truth" if drop == "reward_model" else drop
    assert message.startswith(f"{path}: no row has column {column!r} (its columns: ") and expected in message
    assert "question" in message and "skip_bad_rows" not in message


def test_a_column_some_rows_have_is_still_a_bad_row(tmp_path: Path, hf_tok: Tokenizer) -> None:
    path = str(tmp_path / "d.jsonl")
    write_rows(path, [_without("prompt"), row(1), _without("prompt")])
    with pytest.raises(DataError, match=rf"{path}: row 0: column 'prompt': missing \(set data.skip_bad_rows"):
        PromptDataset.from_files([path], hf_tok, DataConfig(max_prompt_length=64))
    kept = PromptDataset.from_files([path], hf_tok, DataConfig(max_prompt_length=64, skip_bad_rows=True))
    assert len(kept) == 1 and len(kept.skipped) == 2


def test_a_json_file_is_an_array_of_rows_or_one_row_per_line(tmp_path: Path, hf_tok: Tokenizer) -> None:
    """A .json array was read line by line: its first line '[' made row 0 'not valid JSON'."""
    cfg = DataConfig(max_prompt_length=64)
    lines = str(tmp_path / "lines.jsonl")
    write_rows(lines, [row(0), row(1)])
    expected = PromptDataset.from_files([lines], hf_tok, cfg)
    array = tmp_path / "array.json"
    array.write_text(json.dumps([row(0), row(1)], indent=2))
    as_lines = tmp_path / "lines.json"
    as_lines.write_text(Path(lines).read_text())
    for path in (array, as_lines):
        loaded = PromptDataset.from_files([str(path)], hf_tok, cfg)
        assert [r.prompt_ids for r in loaded.records] == [r.prompt_ids for r in expected.records]
        assert [r.ground_truth for r in loaded.records] == ["0", "1"]
    array.write_text('[{"prompt": "x"},')
    with pytest.raises(DataError, match=r"array\.json: not a valid JSON array of rows"):
        PromptDataset.from_files([str(array)], hf_tok, cfg)


def test_sft_examples_mask_the_prompt_and_name_bad_rows(tmp_path: Path, hf_tok: Tokenizer) -> None:
    path = str(tmp_path / "sft.parquet")
    write_rows(path, [row(0, response="seven"), row(1)])
    data = DataConfig(max_prompt_length=64, max_response_length=8)
    with pytest.raises(DataError, match=rf"{path}: row 1: column 'response': missing"):
        SFTDataset.from_files([path], hf_tok, data)
    write_rows(path, [row(0, response="seven")])
    ds = SFTDataset.from_files([path], hf_tok, data)
    batch = ds.batch([0])
    prompt = hf_tok.encode("<|user|>the cat sat 0</s><|assistant|>")
    target = [*hf_tok.encode("seven"), hf_tok.eos_token_id]
    assert batch.tokens[0].tolist() == prompt + target
    masked = batch.labels[0][batch.loss_mask[0].bool()].tolist()
    assert masked == target  # exactly the response and EOS are predicted


def test_sft_rows_without_the_response_key_name_the_key(tmp_path: Path, hf_tok: Tokenizer) -> None:
    """verl-format RL rows (what `mcore-rl data prepare` writes) keep the answer in extra_info.answer."""
    path = str(tmp_path / "train.jsonl")
    prepared = {**row(0), "extra_info": {"answer": "seven #### 7"}}
    write_rows(path, [prepared])
    data = DataConfig(max_prompt_length=64, max_response_length=16)
    with pytest.raises(
        DataError, match=r"no sft\.response_key='response'; .*sft\.response_key=extra_info\.answer"
    ):
        SFTDataset.from_files([path], hf_tok, data)
    assert len(SFTDataset.from_files([path], hf_tok, data, response_key="extra_info.answer")) == 1


def test_sft_skips_a_first_row_without_a_response_when_told_to(tmp_path: Path, hf_tok: Tokenizer) -> None:
    path = str(tmp_path / "sft.jsonl")
    write_rows(path, [row(0), *(row(i, response="seven") for i in (1, 2))])
    data = DataConfig(max_prompt_length=64, max_response_length=8, skip_bad_rows=True)
    assert len(SFTDataset.from_files([path], hf_tok, data)) == 2
    write_rows(path, [row(0)])
    with pytest.raises(
        DataError, match=r"no usable SFT examples \(every row skipped, the first: .*'response': missing"
    ):
        SFTDataset.from_files([path], hf_tok, data)


def _loader(num: int, batch: int, tmp_path: Path, tok: Tokenizer) -> PromptLoader:
    path = str(tmp_path / "many.jsonl")
    write_rows(path, [row(i, prompt=f"the cat {i}") for i in range(num)])
    cfg = DataConfig(max_prompt_length=64, train_batch_size=batch, seed=7)
    return PromptLoader(PromptDataset.from_files([path], tok, cfg), cfg)


def test_saved_position_gives_the_identical_next_batch(tmp_path: Path, hf_tok: Tokenizer) -> None:
    straight = _loader(10, 3, tmp_path, hf_tok)  # 3 batches per epoch, one row dropped
    for steps in (2, 3, 4, 7):  # mid-epoch, at the epoch's end, across epochs
        first = _loader(10, 3, tmp_path, hf_tok)
        for _ in range(steps):
            first.next_batch()
        resumed = _loader(10, 3, tmp_path, hf_tok)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # survives JSON
        for _ in range(3):
            a, b = first.next_batch(), resumed.next_batch()
            assert a.indices.tolist() == b.indices.tolist() and a.prompt_ids == b.prompt_ids
    epochs = [[i for _ in range(3) for i in straight.next_batch().indices.tolist()] for _ in range(2)]
    assert all(len(set(e)) == 9 for e in epochs)  # each epoch: distinct prompts, drop_last drops one


def test_epochs_reshuffle_deterministically() -> None:
    a = EpochSampler(50, 50, True, seed=3, drop_last=True, fingerprint="x")
    b = EpochSampler(50, 50, True, seed=3, drop_last=True, fingerprint="x")
    orders = [a.next_indices() for _ in range(3)]
    assert orders == [b.next_indices() for _ in range(3)]
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(50))
    plain = EpochSampler(5, 2, False, seed=3, drop_last=False, fingerprint="x")
    assert [plain.next_indices() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]


def test_resume_against_other_data_is_refused(tmp_path: Path, hf_tok: Tokenizer) -> None:
    state = _loader(10, 3, tmp_path, hf_tok).state_dict()
    del state["data"]  # a checkpoint from before the loader state named its files (test_data_change.py)
    other = _loader(11, 3, tmp_path, hf_tok)
    with pytest.raises(ValueError, match=r"the saved fingerprint is .*\(the dataset or its order changed\)"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="cannot fill one batch of 8"):
        EpochSampler(5, 8, True, 0, True, "x")
    with pytest.raises(TypeError, match="resolve configs with check_config"):
        PromptLoader(other.dataset, DataConfig(train_batch_size=3))  # seed is still '${trainer.seed}'


def test_padded_batch_is_right_padded() -> None:
    from mcore_rl.types import PromptBatch

    batch = PromptBatch([[5, 6, 7], [8]], torch.tensor([0, 1]), ["s", "s"], ["1", "2"], [{}, {}])
    tokens, lengths = batch.padded(0)
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0]] and lengths.tolist() == [3, 1]


def test_bytes_that_are_not_utf8_name_the_file_and_row(tmp_path: Path, hf_tok: Tokenizer) -> None:
    """Found by a probe: a jsonl with a Latin-1 byte failed with ``UnicodeDecodeError ... position 441``,
    naming neither the file nor the line."""
    path = tmp_path / "d.jsonl"
    good = [json.dumps(row(i)).encode() for i in range(3)]
    path.write_bytes(b"\n".join([good[0], good[1].replace(b"the cat", b"th\xe9 cat"), good[2]]) + b"\n")
    with pytest.raises(
        DataError, match=rf"{path}: row 1: column '<line>': not UTF-8 \(byte 0xe9 at byte \d+"
    ):
        PromptDataset.from_files([str(path)], hf_tok, DataConfig(max_prompt_length=64))
    skipping = PromptDataset.from_files(
        [str(path)], hf_tok, DataConfig(max_prompt_length=64, skip_bad_rows=True)
    )
    assert [r.row for r in skipping.records] == [0, 2]


def test_a_row_check_refuses_or_skips_naming_the_ground_truth(tmp_path: Path, hf_tok: Tokenizer) -> None:
    """The caller's check (the scorer's rules, ``trainer/build.py``) turns a bad ground truth into a row error."""
    path = tmp_path / "d.jsonl"
    rows = [row(0), _bad(reward_model={"ground_truth": {"answer": "7"}}), row(2)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def check(source: str, truth: Any, extra: dict[str, Any]) -> tuple[str, str] | None:
        return (
            None if isinstance(truth, str) else ("reward_model.ground_truth", f"is a {type(truth).__name__}")
        )

    with pytest.raises(DataError, match=r"row 1: column 'reward_model.ground_truth': is a dict"):
        PromptDataset.from_files([str(path)], hf_tok, DataConfig(max_prompt_length=64), check)
    cfg = DataConfig(max_prompt_length=64, skip_bad_rows=True)
    assert [r.row for r in PromptDataset.from_files([str(path)], hf_tok, cfg, check).records] == [0, 2]


def test_a_data_config_built_in_python_with_a_string_count_is_refused_naming_the_field() -> None:
    """Found by a probe: ``DataConfig(train_batch_size="4")`` failed later in the sampler with a TypeError."""
    from mcore_rl.io.fields import FieldError

    with pytest.raises(FieldError, match=r"data.train_batch_size='4' must be an integer"):
        DataConfig(train_batch_size="4")  # type: ignore[arg-type]


def test_rows_for_the_format_scorer_are_checked_for_their_pattern(tmp_path: Path, hf_tok: Tokenizer) -> None:
    """The built-in format scorer reads ``extra_info.format_pattern`` (every answer of a row without one
    raised and scored 0), not the ground truth (an empty one is fine there)."""
    import functools

    from mcore_rl.config import RewardConfig
    from mcore_rl.scoring.registry import row_problem

    check = functools.partial(row_problem, RewardConfig(sources={"fmt": "format"}))
    path = tmp_path / "d.jsonl"
    for extra, message in [
        ({"index": 0}, "missing"),
        ({"format_pattern": "(unclosed"}, "not a regular expression"),
    ]:
        path.write_text(json.dumps({**row(0), "data_source": "fmt", "extra_info": extra}) + "\n")
        with pytest.raises(DataError, match=rf"column 'extra_info.format_pattern': {message}"):
            PromptDataset.from_files([str(path)], hf_tok, DataConfig(max_prompt_length=64), check)
    good = {
        **row(0),
        "data_source": "fmt",
        "reward_model": {"ground_truth": ""},
        "extra_info": {"format_pattern": ".*"},
    }
    path.write_text(json.dumps(good) + "\n")
    assert (
        len(PromptDataset.from_files([str(path)], hf_tok, DataConfig(max_prompt_length=64), check).records)
        == 1
    )
