"""``mcore-rl dpo``'s summary names the scorer of its greedy held-out metric (GSM8K's rule is no exact match)."""

from __future__ import annotations

from pathlib import Path

from mcore_rl.config import load_config
from mcore_rl.data.rows import write_rows
from mcore_rl.dpo.cli import scorer_names

REPO = Path(__file__).resolve().parents[2]


def _rows(source: str) -> list[dict[str, object]]:
    return [{"data_source": source, "prompt": "q", "reward_model": {"ground_truth": "1"}}]


def test_the_greedy_metric_is_named_by_the_scorers_of_the_test_rows(tmp_path: Path) -> None:
    gsm8k, mine = str(tmp_path / "gsm8k.jsonl"), str(tmp_path / "mine.parquet")
    write_rows(gsm8k, _rows("openai/gsm8k"))
    write_rows(mine, _rows("my/task"))
    recipe = REPO / "recipes" / "dpo_demo_cpu.yaml"
    cfg = load_config(recipe, [f"data.test_files=[{gsm8k}]"])
    assert scorer_names(cfg) == "gsm8k"
    cfg = load_config(recipe, [f"data.test_files=[{gsm8k},{mine}]", "reward.sources={my/task: math}"])
    assert scorer_names(cfg) == "gsm8k, math"
    cfg = load_config(recipe, [f"data.test_files=[{mine}]", "reward.custom_function=my_scorers:score"])
    assert scorer_names(cfg) == "my_scorers:score"
