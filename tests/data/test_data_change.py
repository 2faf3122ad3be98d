"""A resume against changed training data is refused naming what changed (files added or removed, a file's
prompt count, the first row that differs), not two fingerprints: the loader state a run checkpoint keeps
holds each file's prompts as 8-hex-character digests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mcore_rl.config import DataConfig
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.rows import DataError, write_rows
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from tests.data.test_prompts import row

CFG = DataConfig(max_prompt_length=64, train_batch_size=2, seed=7)


@pytest.fixture(scope="module")
def tok(tokenizer_dirs: dict[str, Path]) -> Tokenizer:
    return load_tokenizer(tokenizer_dirs["hf"])


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    write_rows(str(path), rows)
    return str(path)


def _loader(files: list[str], tok: Tokenizer, cfg: DataConfig = CFG) -> PromptLoader:
    return PromptLoader(PromptDataset.from_files(files, tok, cfg), cfg)


def _saved(files: list[str], tok: Tokenizer) -> dict[str, Any]:
    loader = _loader(files, tok)
    loader.next_batch()
    return json.loads(json.dumps(loader.state_dict()))  # as trainer_state.json holds it


def _refusal(state: dict[str, Any], files: list[str], tok: Tokenizer, cfg: DataConfig = CFG) -> str:
    with pytest.raises(DataError, match=r"data\.train_files changed since the checkpoint") as err:
        _loader(files, tok, cfg).load_state_dict(state)
    assert "fingerprint" not in str(err.value)
    return str(err.value)


def test_the_state_names_each_file_and_its_prompts(tmp_path: Path, tok: Tokenizer) -> None:
    a = _write(tmp_path / "a.jsonl", [row(i) for i in range(5)])
    b = _write(tmp_path / "b.jsonl", [row(i) for i in range(5, 8)])
    state = _saved([a, b], tok)
    assert [(f["file"], f["prompts"], len(f["digests"])) for f in state["data"]["files"]] == [
        (a, 5, 40),
        (b, 3, 24),
    ]
    resumed = _loader([a, b], tok)
    resumed.load_state_dict(state)  # the same data: resumes
    assert resumed.sampler.position == 2


def test_a_changed_row_is_named_by_file_and_row(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "train.jsonl"
    rows = [row(i) for i in range(6)]
    state = _saved([_write(path, rows)], tok)
    rows[4] = row(4, reward_model={"style": "rule", "ground_truth": "40"})  # only the answer changed
    message = _refusal(state, [_write(path, rows)], tok)
    assert f"{path}: row 4 is the first prompt that differs (1 differ)" in message


def test_files_added_removed_and_reordered_are_named(tmp_path: Path, tok: Tokenizer) -> None:
    a = _write(tmp_path / "a.jsonl", [row(i) for i in range(4)])
    b = _write(tmp_path / "b.jsonl", [row(i) for i in range(4, 8)])
    c = _write(tmp_path / "c.jsonl", [row(i) for i in range(8, 12)])
    state = _saved([a, b], tok)
    assert f"the files changed: added {c}; removed {b}" in _refusal(state, [a, c], tok)
    assert f"the files changed: added {c}" in _refusal(state, [a, b, c], tok)
    assert f"the files are in another order (saved: {a}, {b})" in _refusal(state, [b, a], tok)


def test_a_prompt_count_change_is_named(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "train.jsonl"
    state = _saved([_write(path, [row(i) for i in range(6)])], tok)
    grown = _refusal(state, [_write(path, [row(i) for i in range(8)])], tok)
    assert f"{path}: 6 usable prompts when saved, 8 now (rows from 6 added)" in grown
    shrunk = _refusal(state, [_write(path, [row(i) for i in range(5)])], tok)
    assert f"{path}: 6 usable prompts when saved, 5 now (the last ones removed)" in shrunk
    dropped = _refusal(state, [_write(path, [row(i) for i in range(6) if i != 2])], tok)
    assert f"{path}: 6 usable prompts when saved, 5 now, row 2 is the first prompt that differs" in dropped


def test_every_prompt_changed_points_at_the_tokenizer(tmp_path: Path, tok: Tokenizer) -> None:
    path = _write(tmp_path / "train.jsonl", [row(i) for i in range(6)])
    state = _saved([path], tok)
    plain = DataConfig(max_prompt_length=64, train_batch_size=2, seed=7, apply_chat_template=False)
    assert "every prompt differs (a changed tokenizer" in _refusal(state, [path], tok, plain)


def test_a_checkpoint_without_the_manifest_names_the_fingerprints(tmp_path: Path, tok: Tokenizer) -> None:
    """A checkpoint written before the loader state kept the files still refuses changed data."""
    path = tmp_path / "train.jsonl"
    state = _saved([_write(path, [row(i) for i in range(6)])], tok)
    del state["data"]
    with pytest.raises(DataError, match=r"the saved fingerprint is .*\(the dataset or its order changed\)"):
        _loader([_write(path, [row(i) for i in range(7)])], tok).load_state_dict(state)
