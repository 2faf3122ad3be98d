"""What refuses a run at ``Trainer.from_config``, before it writes anything or starts a worker: a Python
``RunConfig`` is resolved and checked as a recipe is, a tokenizer larger than the model's vocabulary, a
``data_source`` with no scorer, an earlier run's ``metrics.jsonl`` a fresh run would replace, a checkpoint to
resume saved for other data (named by what changed). Each refused run leaves the folder as it found it.

None of these builds a model: every refusal comes before the workers start (a few seconds each)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from mcore_rl.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainerConfig,
    claim_run_folders,
    save_config,
)
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.rows import DataError, read_rows, write_rows
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.engine.trainer_checkpoint import TRAINER_STATE_FILE
from mcore_rl.io.errors import OutputError
from mcore_rl.scoring.registry import ScorerError
from mcore_rl.trainer.trainer import Trainer
from tests.models import tiny_hf_config
from tests.trainer.common import tiny_run_config


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (by relative path); {} when it does not exist."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _rows_with_source(src: str, dst: Path, data_source: str) -> str:
    write_rows(str(dst), [{**raw, "data_source": data_source} for _, raw in read_rows(src)])
    return str(dst)


def test_a_run_config_built_in_python_is_resolved_and_checked(tmp_path: Path, monkeypatch) -> None:
    """``RunConfig(model=ModelConfig(path=...))`` has ``tokenizer_path`` and ``logging.log_dir`` still as
    interpolations: from_config resolves them (it used to fail on a tokenizer folder named ``${model.path}``
    and create ``${trainer.default_local_dir}/logs`` in the working directory)."""
    data = str(tmp_path / "data")
    tiny_run_config(data)
    model = tmp_path / "model"  # an HF-style folder: config.json and the tokenizer
    shutil.copytree(os.path.join(data, "tokenizer"), model)
    (model / "config.json").write_text(json.dumps(tiny_hf_config("llama", vocab_size=14)))
    train = _rows_with_source(os.path.join(data, "train.jsonl"), tmp_path / "train.jsonl", "my/task")
    cfg = RunConfig(
        model=ModelConfig(path=str(model), load_weights=False),
        data=DataConfig(train_files=[train], max_prompt_length=16, max_response_length=6, train_batch_size=8),
        trainer=TrainerConfig(default_local_dir=str(tmp_path / "run")),
    )
    assert cfg.model.tokenizer_path == "${model.path}"  # unresolved as built
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # the tokenizer loaded (from model.path), the data read: the refusal is the start-up check's own
    with pytest.raises(ScorerError, match="no scorer for data_source 'my/task'"):
        Trainer.from_config(cfg, use_ray=False)
    assert os.listdir(work) == [] and not (tmp_path / "run").exists()


def test_a_tokenizer_larger_than_the_model_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    data, run = str(tmp_path / "data"), tmp_path / "run"
    cfg = tiny_run_config(data, [f"trainer.default_local_dir={run}", "model.hf_config.vocab_size=12"])
    message = (
        rf"model.tokenizer_path {data}/tokenizer: the tokenizer has 14 tokens, more than the model's "
        r"model.hf_config vocab_size=12"
    )
    with pytest.raises(ConfigError, match=message):
        Trainer.from_config(cfg, use_ray=False)
    assert not run.exists()  # a refused run creates no run folder


def test_a_data_source_without_a_scorer_is_refused_naming_it_the_file_and_the_fix(tmp_path: Path) -> None:
    """With ``reward.on_error=zero`` every reward of such rows would be 0: a run that learns nothing."""
    data, run = str(tmp_path / "data"), tmp_path / "run"
    tiny_run_config(data)  # writes the data
    val = _rows_with_source(os.path.join(data, "val.jsonl"), tmp_path / "val.jsonl", "my/task")
    cfg = tiny_run_config(data, [f"trainer.default_local_dir={run}", f"data.val_files=[{val}]"])
    message = (
        rf"no scorer for data_source 'my/task' \({val} row 0\): add reward.sources.my/task=<scorer> "
        r"\(a built-in of gsm8k, math, math_dapo, exact_match, format or module:function or path/to/file.py:function\) "
        r"or reward.custom_function; the built-in scorers answer openai/gsm8k, .*mcore_rl/arithmetic"
    )
    with pytest.raises(ScorerError, match=message):
        Trainer.from_config(cfg, use_ray=False)
    assert not run.exists()


def test_an_earlier_runs_log_is_never_replaced(tmp_path: Path) -> None:
    """A folder holding a run's ``metrics.jsonl`` and no checkpoint to resume (e.g. ``trainer.save_freq=-1``):
    a new run there is refused, naming the file and the keys to choose another folder; nothing changes."""
    data, run = str(tmp_path / "data"), tmp_path / "run"
    cfg = tiny_run_config(data, [f"trainer.default_local_dir={run}"])
    claim_run_folders(cfg)
    save_config(cfg, run)
    logs = run / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"stage": "rl", "step": 1, "reward": 0.5}\n')
    before = _snapshot(run)
    message = (
        rf"{logs}/metrics.jsonl holds an earlier run's log, which a new run would replace \(no run checkpoint "
        rf"in {run}/checkpoints to resume \(trainer.save_freq=-1\)\): set trainer.default_local_dir "
        rf"\(or logging.log_dir\) to another folder, or move {run} away"
    )
    with pytest.raises(OutputError, match=message):
        Trainer.from_config(cfg, use_ray=False)
    assert _snapshot(run) == before
    _fake_checkpoint(cfg, step=1)
    disabled = tiny_run_config(data, [f"trainer.default_local_dir={run}", "trainer.resume_mode=disable"])
    before = _snapshot(run)
    with pytest.raises(OutputError, match=r"\(trainer.resume_mode=disable\).*or trainer.resume_mode=auto to"):
        Trainer.from_config(disabled, use_ray=False)
    assert _snapshot(run) == before


def _fake_checkpoint(cfg: RunConfig, step: int) -> str:
    """The driver state of a run checkpoint at ``step`` (what the start-up checks read), as ``Trainer.save``
    writes it for ``cfg``'s data, with ``latest`` naming it; no weights (nothing here loads them)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or "")
    loader = PromptLoader(PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data), cfg.data)
    for _ in range(step):
        loader.next_batch()
    root = Path(cfg.trainer.default_local_dir) / "checkpoints"
    folder = root / f"global_step_{step}"
    folder.mkdir(parents=True)
    extra = {"loader": loader.state_dict(), "model": cfg.model.hf_config_dict(), "algorithm": {}}
    layout = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    (folder / TRAINER_STATE_FILE).write_text(json.dumps({"step": step, "layout": layout, "extra": extra}))
    (root / "latest").write_text(f"global_step_{step}\n")
    return str(folder)


def test_a_refused_resume_leaves_the_run_folder_as_it_was(tmp_path: Path) -> None:
    """The training data changed since the checkpoint: refused naming the row, and the folder's
    ``config.yaml`` still describes the run that was saved (it used to be overwritten by the refused one)."""
    data, run = tmp_path / "data", tmp_path / "run"
    cfg = tiny_run_config(str(data), [f"trainer.default_local_dir={run}"])
    claim_run_folders(cfg)
    save_config(cfg, run)
    checkpoint = _fake_checkpoint(cfg, step=2)
    rows = [raw for _, raw in read_rows(str(data / "train.jsonl"))]
    rows[5]["reward_model"]["ground_truth"] = "12345"
    write_rows(str(data / "train.jsonl"), rows)
    before = _snapshot(run)
    changed = tiny_run_config(
        str(data), [f"trainer.default_local_dir={run}", "trainer.total_training_steps=9"]
    )
    message = (
        rf"{checkpoint}: cannot resume the data position: data.train_files changed since the checkpoint: "
        rf"{data}/train.jsonl: row 5 is the first prompt that differs \(1 differ\); not resuming"
    )
    with pytest.raises(DataError, match=message):
        Trainer.from_config(changed, use_ray=False)
    assert _snapshot(run) == before
