"""``mcore-rl eval`` and a DPO run's held-out test prompts are checked for their scorer as an RL run's data is:
a ``data_source`` no rule scores, or a ground truth the built-in rules cannot compare, is refused when the data
is read (it built the model, generated every answer and reported accuracy 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.data.rows import DataError, write_rows
from mcore_rl.scoring import ScorerError
from tests.data.conftest import train_bpe
from tests.models import tiny_hf_config

UNSCORED = [
    ("my/task", "5", r"no scorer for data_source 'my/task'"),
    ("openai/gsm8k", {"answer": "5"}, "dict"),
]


class _BuiltError(Exception):
    pass


def _refuse_building(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise _BuiltError("the model was built: the data passed its checks")


def _row(source: str, truth: object) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": "the cat sat"}],
        "reward_model": {"ground_truth": truth},
    }


@pytest.mark.parametrize(("source", "truth", "message"), UNSCORED)
def test_eval_refuses_rows_no_scorer_can_score(tmp_path: Path, monkeypatch, source, truth, message) -> None:
    import mcore_rl.trainer.build as build
    from mcore_rl.trainer.evaluate import evaluate_model

    monkeypatch.setattr(build, "build_actor_group", _refuse_building)
    model = train_bpe(tmp_path / "model", with_config=True)
    (model / "config.json").write_text(
        json.dumps(tiny_hf_config("llama", max_position_embeddings=1024, vocab_size=300))
    )
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_row(source, truth)) + "\n")
    keys = ["data.max_prompt_length=64", "data.max_response_length=64"]
    with pytest.raises((ScorerError, DataError), match=message):
        evaluate_model(str(model), [str(data)], keys, use_ray=False)


@pytest.mark.parametrize(("source", "truth", "message"), UNSCORED)
def test_dpo_test_prompts_are_checked_for_their_scorer(tmp_path: Path, source, truth, message) -> None:
    from mcore_rl.config import load_config
    from mcore_rl.dpo.trainer import load_dpo_data

    tokenizer = train_bpe(tmp_path / "tok", with_config=True)
    pairs, test = tmp_path / "pairs.jsonl", tmp_path / "test.jsonl"
    write_rows(str(pairs), [{"prompt": "the cat", "chosen": "sat", "rejected": "ran"}] * 4)
    write_rows(str(test), [_row(source, truth)])
    overrides = [
        "data.generate=null",
        f"model.tokenizer_path={tokenizer}",
        "model.hf_config.vocab_size=300",
        f"data.test_files=[{test}]",
        f"dpo.train_files=[{pairs}]",
        "dpo.val_files=[]",
        "dpo.train_batch_size=4",
        "dpo.micro_batch_size_per_gpu=4",
        "data.train_batch_size=4",
    ]
    with pytest.raises((ScorerError, DataError), match=message):
        load_dpo_data(load_config("dpo_demo_cpu", overrides, max_ranks=1))
