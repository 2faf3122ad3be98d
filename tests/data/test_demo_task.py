"""The arithmetic task as verl-format data: the generator writes what the demo recipe names, the written
tokenizer reproduces the task's ids, held-out prompts never leak into training, and the rows score by
exact match through the reward dispatch."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.data import demo_task
from mcore_rl.data.arithmetic import CharTokenizer
from mcore_rl.data.prompts import PromptDataset
from mcore_rl.data.sft import SFTDataset
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.scoring import RewardScorer, ScoreRequest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "demo_cpu.yaml"
SMALL = {"test": 50, "val": 20, "train": 200, "sft": 300}


def test_prepare_data_writes_what_the_recipe_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to the working directory
    for split, size in SMALL.items():
        monkeypatch.setitem(demo_task.SPLIT_SIZES, split, size)
    cfg = load_config(RECIPE)
    written = demo_task.prepare_data(cfg)
    assert len(written) == 5 and demo_task.prepare_data(cfg) == []  # second call: all present
    load_config(RECIPE, check_paths=True)

    tok = load_tokenizer(cfg.model.tokenizer_path or "")
    chars = CharTokenizer()
    assert (tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (chars.EOS, chars.PAD, chars.vocab_size)
    train = PromptDataset.from_files(cfg.data.train_files, tok, cfg.data)
    test = PromptDataset.from_files(cfg.data.test_files, tok, cfg.data)
    val = PromptDataset.from_files(cfg.data.val_files, tok, cfg.data)
    assert (len(train), len(test), len(val)) == (200, 50, 20)
    record = train.records[0]
    text = chars.decode(list(record.prompt_ids))
    assert list(record.prompt_ids) == chars.encode(text) and text.endswith(
        "="
    )  # the chat template adds nothing
    a, b = text[:-1].split("+")
    assert record.ground_truth == str(int(a) + int(b))
    assert tok.decode([*chars.encode("579"), chars.EOS, chars.PAD]) == "579"

    sft = SFTDataset.from_files(cfg.sft.train_files, tok, cfg.data, cfg.sft)
    held_out = {r.prompt_ids for r in test.records + val.records}
    assert not held_out & {r.prompt_ids for r in train.records + sft.records}  # type: ignore[operator]

    requests = [ScoreRequest(r.data_source, r.ground_truth, r.ground_truth) for r in val.records[:3]]
    requests.append(ScoreRequest(val.records[0].data_source, "12", val.records[0].ground_truth))
    with RewardScorer(cfg.reward) as scorer:
        assert scorer.score(requests).scores.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_command_line_writes_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for split, size in SMALL.items():
        monkeypatch.setitem(demo_task.SPLIT_SIZES, split, size)
    assert demo_task.main([str(tmp_path), "--format", "jsonl"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "sft.jsonl",
        "test.jsonl",
        "tokenizer",
        "train.jsonl",
        "val.jsonl",
    ]
    first = (tmp_path / "sft.jsonl").read_text().splitlines()[0]
    assert '"data_source": "mcore_rl/arithmetic"' in first and '"response": ' in first
