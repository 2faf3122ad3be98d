"""``mcore-rl data prepare``: GSM8K and MATH rows (written here in the public layouts) into verl's columns;
the prepared ground truths score 1 with the project's own rules on the reference answers and 0 on a wrong
one; bad rows named by file, row and column; splits by name, flag and file name; nothing written over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mcore_rl.cli import main
from mcore_rl.data.prepare import PrepareError, boxed_ground_truth, gsm8k_ground_truth, prepare_dataset
from mcore_rl.data.rows import read_rows
from mcore_rl.io.errors import InputError, OutputError
from mcore_rl.scoring import RewardScorer, ScoreRequest
from mcore_rl.scoring.config import RewardConfig

GSM8K = [
    {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 and a bike $34.", "answer": "1200 + 34 = 1234\n#### 1,234"},
    {"question": "It drops 5 degrees from 2.", "answer": "2 - 5 = -3\n#### -3"},
]
MATH = [
    {"problem": "What is $1/2$ as a fraction?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "1"},
    {"problem": "Compute $2^{10}$.", "solution": "We get \\fbox{1024}", "level": "2"},
    {"problem": "Solve $x+1=3$.", "solution": "So $x = \\boxed 2$.", "level": "1"},
    {"problem": "Nested?", "solution": "First \\boxed{1}, then $\\boxed{\\sqrt{\\{4\\}}}$", "level": "3"},
]


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def rows_of(path: str) -> list[dict[str, Any]]:
    return [raw for _, raw in read_rows(path)]


def scores(rows: list[dict[str, Any]], responses: list[str]) -> list[float]:
    """The project's scorer (dispatch by data_source, in-process) on ``responses`` to ``rows``."""
    scorer = RewardScorer(RewardConfig(num_workers=0))
    try:
        requests = [
            ScoreRequest(r["data_source"], text, r["reward_model"]["ground_truth"], r["extra_info"])
            for r, text in zip(rows, responses, strict=True)
        ]
        return scorer.score(requests).scores.tolist()
    finally:
        scorer.close()


def test_gsm8k_rows_are_verl_rows_and_score_with_the_gsm8k_rule(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    write_parquet(tmp_path / "hub" / "main" / "test-00000-of-00001.parquet", GSM8K[:2])
    prepared = prepare_dataset("gsm8k", [train, str(tmp_path / "hub")], str(tmp_path / "out"))
    assert prepared.num_rows == {"train": 3, "test": 2}
    rows = rows_of(prepared.files["train"])
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": GSM8K[1]["question"]
                + ' Let\'s think step by step and output the final answer after "####".',
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1234"},
        "extra_info": {
            "split": "train",
            "index": 1,
            "answer": GSM8K[1]["answer"],
            "question": GSM8K[1]["question"],
        },
    }
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1234", "-3"]
    assert [r["extra_info"]["split"] for r in rows_of(prepared.files["test"])] == ["test"] * 2
    # The reference answers (the `#### n` lines verl's scorer reads) score 1, a wrong final answer 0.
    assert scores(rows, [g["answer"] for g in GSM8K]) == [1.0, 1.0, 1.0]
    assert scores(rows, ["#### 8", "#### 1234", "the answer is 3"]) == [0.0, 1.0, 0.0]


def test_math_rows_take_the_last_boxed_answer_and_score_with_math_verify(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "math.jsonl", MATH)
    prepared = prepare_dataset("math", [source], str(tmp_path / "out"), split="test")
    rows = rows_of(prepared.files["test"])
    assert [r["reward_model"]["ground_truth"] for r in rows] == [
        "\\frac{1}{2}",
        "1024",
        "2",
        "\\sqrt{\\{4\\}}",
    ]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["prompt"][0]["content"].endswith(
        " Let's think step by step and output the final answer within \\boxed{}."
    )
    assert rows[2]["extra_info"] == {"split": "test", "index": 2}
    assert scores(rows[:3], [m["solution"] for m in MATH[:3]]) == [1.0, 1.0, 1.0]
    assert scores(rows[:2], ["so \\boxed{0.5}", "\\boxed{1000}"]) == [1.0, 0.0]  # equivalence, not strings


def test_ground_truth_extraction_matches_verl() -> None:
    assert gsm8k_ground_truth("x\n#### 1,000.5") == "1000.5"
    assert gsm8k_ground_truth("no final line") is None
    assert boxed_ground_truth("\\boxed{a{b}c} and \\boxed{d}") == "d"
    assert boxed_ground_truth("\\boxed{unbalanced") is None
    assert boxed_ground_truth("none here") is None


@pytest.mark.parametrize(
    ("dataset", "rows", "expected"),
    [
        (
            "gsm8k",
            [GSM8K[0], {"question": "q", "answer": "no marker"}],
            "row 1: column 'answer': no final answer",
        ),
        ("gsm8k", [{"answer": "#### 1"}], "row 0: column 'question': missing"),
        ("gsm8k", [{"question": 3, "answer": "#### 1"}], "row 0: column 'question': expected non-empty text"),
        (
            "math",
            [MATH[0], MATH[1], {"problem": "p", "solution": "no box"}],
            "row 2: column 'solution': no \\boxed",
        ),
        ("math", [["not", "an", "object"]], "row 0: column '<row>': expected an object"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_column(
    tmp_path: Path, dataset: str, rows: list[Any], expected: str
) -> None:
    source = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(PrepareError, match=r"train\.jsonl: " + expected.replace("\\", "\\\\")):
        prepare_dataset(dataset, [source], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing written, not even a partial folder
    assert issubclass(PrepareError, InputError)  # the CLI reports it as the user's error, exit 1


def test_invalid_json_line_is_named(tmp_path: Path) -> None:
    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps(GSM8K[0]) + "\n{oops\n")
    with pytest.raises(PrepareError, match=r"train\.jsonl: row 1: column '<line>': not valid JSON"):
        prepare_dataset("gsm8k", [str(source)], str(tmp_path / "out"))


def test_splits_by_name_flag_or_file_name(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", GSM8K)
    b = write_jsonl(tmp_path / "b.jsonl", GSM8K[:1])
    with pytest.raises(PrepareError, match=r"which split is it\? Name it \(--input train="):
        prepare_dataset("gsm8k", [a], str(tmp_path / "out"))
    prepared = prepare_dataset("gsm8k", [f"test={a}", f"test={b}"], str(tmp_path / "out"))
    rows = rows_of(prepared.files["test"])
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2, 3]  # one split across files
    assert list(prepared.files) == ["test"]


def test_existing_output_is_never_written_over(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(OutputError, match="exists and is not empty"):
        prepare_dataset("gsm8k", [source], str(out))
    prepare_dataset("gsm8k", [source], str(tmp_path / "fresh"))
    with pytest.raises(OutputError, match="exists and is not empty"):
        prepare_dataset("gsm8k", [source], str(tmp_path / "fresh"))  # not even our own earlier output
    assert (out / "mine.txt").read_text() == "keep"
    with pytest.raises(OutputError, match="is the input"):
        prepare_dataset("gsm8k", [source], source)
    folder = tmp_path / "raw"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", GSM8K)
    for given in (str(folder), f"train={folder}"):  # the next run over that folder would read it as input
        with pytest.raises(OutputError, match="raw/prepared"):
            prepare_dataset("gsm8k", [given], str(folder / "prepared"))
        assert not (folder / "prepared").exists()


def test_cli_prepares_and_reports_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "test_math.jsonl", MATH)
    out = tmp_path / "out"
    assert main(["data", "prepare", "math", "--input", source, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"test: {out / 'test.parquet'} (4 rows)" in printed
    assert f"data.val_files=[{out / 'test.parquet'}]" in printed
    bad = write_jsonl(tmp_path / "train.jsonl", [{"problem": "p", "solution": "none"}])
    assert main(["data", "prepare", "math", "--input", bad, "--out", str(tmp_path / "o2")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mcore-rl data: error: ") and "train.jsonl: row 0: column 'solution'" in err
    assert "\n" not in err


def test_prepared_rows_load_as_a_runs_prompts(tmp_path: Path, tokenizer_dirs: dict[str, Path]) -> None:
    from mcore_rl.config import DataConfig
    from mcore_rl.data.prompts import PromptDataset
    from mcore_rl.data.tokenizer import load_tokenizer

    source = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    prepared = prepare_dataset("gsm8k", [source], str(tmp_path / "out"))
    tokenizer = load_tokenizer(str(tokenizer_dirs["hf"]))
    dataset = PromptDataset.from_files(
        [prepared.files["train"]], tokenizer, DataConfig(max_prompt_length=4096)
    )
    assert [r.ground_truth for r in dataset.records] == ["7", "1234", "-3"]
    assert {r.data_source for r in dataset.records} == {"openai/gsm8k"}
    assert dataset.records[0].extra_info["index"] == 0
