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


@pytest.mark.parametrize("tokenizer", ["folder", "file"])
def test_generated_data_never_writes_over_a_users_tokenizer(tmp_path: Path, tokenizer: str) -> None:
    from mcore_rl.config import DataConfig
    from tests.data.conftest import train_sentencepiece

    folder = train_sentencepiece(tmp_path / "model")  # a sentencepiece model folder, no tokenizer.json
    (folder / "tokenizer_config.json").write_text('{"chat_template": "the user\'s"}')
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    path = folder if tokenizer == "folder" else next(folder.glob("*.model"))
    data = DataConfig(seed=0, generate="arithmetic", train_files=[str(tmp_path / "train.parquet")])
    assert demo_task.prepare_data(data, tokenizer_path=str(path)) == [str(tmp_path / "train.parquet")]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_prepare_data_writes_what_the_recipe_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to the working directory
    for split, size in SMALL.items():
        monkeypatch.setitem(demo_task.SPLIT_SIZES, split, size)
    cfg = load_config(RECIPE)
    written = demo_task.prepare_data(cfg.data, cfg.sft.train_files, cfg.model.tokenizer_path)
    assert (
        len(written) == 5
        and demo_task.prepare_data(cfg.data, cfg.sft.train_files, cfg.model.tokenizer_path) == []
    )  # second call: all present
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
    assert cfg.data.generate == "arithmetic_reversed"  # the main job's task: least-significant digit first
    assert record.ground_truth == str(int(a) + int(b))[::-1]
    assert tok.decode([*chars.encode("579"), chars.EOS, chars.PAD]) == "579"

    sft = SFTDataset.from_files(cfg.sft.train_files, tok, cfg.data, cfg.sft.response_key, cfg.sft.max_length)
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


def _task_config(folder: Path, task: str) -> list[str]:
    return [
        f"data.generate={task}",
        *(f"data.{split}_files=[{folder}/{split}.jsonl]" for split in ("train", "val", "test")),
        f"sft.train_files=[{folder}/sft.jsonl]",
        f"model.tokenizer_path={folder}/tokenizer",
    ]


def test_reversed_task_writes_answers_least_significant_digit_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for split, size in SMALL.items():
        monkeypatch.setitem(demo_task.SPLIT_SIZES, split, size)
    plain = load_config(RECIPE, _task_config(tmp_path / "plain", "arithmetic"))
    reversed_ = load_config(RECIPE, _task_config(tmp_path / "rev", "arithmetic_reversed"))
    assert (
        len(demo_task.prepare_data(plain.data, plain.sft.train_files, plain.model.tokenizer_path))
        == len(
            demo_task.prepare_data(reversed_.data, reversed_.sft.train_files, reversed_.model.tokenizer_path)
        )
        == 5
    )
    tok = load_tokenizer(reversed_.model.tokenizer_path or "")
    for cfg, flip in ((plain, False), (reversed_, True)):
        for dataset in (
            PromptDataset.from_files(cfg.data.test_files, tok, cfg.data),
            SFTDataset.from_files(
                cfg.sft.train_files, tok, cfg.data, cfg.sft.response_key, cfg.sft.max_length
            ),
        ):
            for record in dataset.records[:20]:
                a, b = tok.decode(list(record.prompt_ids))[:-1].split("+")
                total = str(int(a) + int(b))
                truth = getattr(record, "ground_truth", None) or tok.decode(list(record.response_ids))
                assert truth == (total[::-1] if flip else total)
    # the prompts are the same problems either way: only the answers' digit order differs
    same = PromptDataset.from_files(plain.data.test_files, tok, plain.data).records
    flipped = PromptDataset.from_files(reversed_.data.test_files, tok, reversed_.data).records
    assert [r.prompt_ids for r in same] == [r.prompt_ids for r in flipped]


def test_generated_files_of_the_other_task_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for split, size in SMALL.items():
        monkeypatch.setitem(demo_task.SPLIT_SIZES, split, size)
    _prepare(load_config(RECIPE, _task_config(tmp_path, "arithmetic")))
    before = {p: p.read_bytes() for p in tmp_path.glob("*.jsonl")}
    with pytest.raises(
        ValueError, match=r"data\.generate=arithmetic_reversed: .*test\.jsonl holds another task"
    ):
        _prepare(load_config(RECIPE, _task_config(tmp_path, "arithmetic_reversed")))
    assert {p: p.read_bytes() for p in tmp_path.glob("*.jsonl")} == before  # nothing rewritten


def test_command_line_writes_the_reversed_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for split, size in SMALL.items():
        monkeypatch.setitem(demo_task.SPLIT_SIZES, split, size)
    assert demo_task.main([str(tmp_path), "--format", "jsonl", "--reversed"]) == 0
    import json

    row = json.loads((tmp_path / "sft.jsonl").read_text().splitlines()[0])
    a, b = row["prompt"][0]["content"][:-1].split("+")
    assert row["response"] == row["reward_model"]["ground_truth"] == str(int(a) + int(b))[::-1]


def _prepare(cfg):
    return demo_task.prepare_data(cfg.data, cfg.sft.train_files, cfg.model.tokenizer_path)


def test_each_generated_file_is_named_on_the_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review: ``data.train_files=[mydata/trian.parquet]`` (a typo) on a demo recipe generated that
    file and trained on it without a word; DPO's ``dpo.train_files`` the same."""
    from mcore_rl.data.preference import prepare_preference_data

    monkeypatch.chdir(tmp_path)
    for split, size in SMALL.items():
        monkeypatch.setitem(demo_task.SPLIT_SIZES, split, size)
    cfg = load_config(RECIPE)
    demo_task.prepare_data(cfg.data, cfg.sft.train_files, cfg.model.tokenizer_path)
    capsys.readouterr()
    typo = load_config(RECIPE, ["data.train_files=[mydata/trian.parquet]"])
    assert demo_task.prepare_data(typo.data, typo.sft.train_files, typo.model.tokenizer_path) == [
        "mydata/trian.parquet"
    ]
    err = capsys.readouterr().err
    assert err == (
        f"mcore-rl: note: data.generate={cfg.data.generate}: generated mydata/trian.parquet (train), which did not "
        "exist; the run trains on what it generated\n"
    )
    assert demo_task.prepare_data(typo.data, typo.sft.train_files, typo.model.tokenizer_path) == []
    assert capsys.readouterr().err == ""  # nothing written, nothing said
    written = prepare_preference_data(cfg.data, ["runs/nothere.parquet"], [], cfg.model.tokenizer_path)
    assert written == ["runs/nothere.parquet"]
    assert capsys.readouterr().err == (
        f"mcore-rl: note: data.generate={cfg.data.generate}: generated runs/nothere.parquet (dpo.train_files "
        "pairs), which did not exist; the run trains on what it generated\n"
    )
