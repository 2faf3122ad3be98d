"""The model a run ends with and what reads it, in-process on the tiny demo task: an RL run writes the HF
folder ``model/`` (from a temporary model checkpoint, or from its last run checkpoint) and the validation
samples of ``logging.log_val_generations``; ``mcore-rl eval`` of that folder, of the run checkpoint and of
its ``hf-to-mcore`` conversion all give the run's own held-out accuracy; a run started from the megatron
checkpoint as ``model.path`` holds exactly the HF folder's weights."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.config import load_config
from mcore_rl.convert.export import export_hf_model
from mcore_rl.convert.hf_to_mcore import HfToMcoreOptions, convert_hf_to_mcore
from mcore_rl.convert.mcore_to_hf import McoreToHfOptions, convert_mcore_to_hf
from mcore_rl.trainer.evaluate import ALL, evaluate_model
from mcore_rl.trainer.run_checkpoint import verify_run_checkpoint
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

EVAL_KEYS = ["data.max_prompt_length=16", "data.max_response_length=6", "trainer.num_cpus=2", MIXED_REWARD]
"""What the tiny model needs beside the schema defaults (its 32 positions), and a reward that an untrained
model earns on some prompts only, so that equal accuracies say something."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("data"))
    tiny_run_config(folder)
    return folder


@pytest.fixture(scope="module")
def finished(data: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A 2-step RL run with a held-out test, validation every step and 3 logged samples each time."""
    run = str(tmp_path_factory.mktemp("runs") / "rl")
    cfg = tiny_run_config(
        data,
        [
            f"data.test_files=[{data}/test.jsonl]",
            "trainer.total_training_steps=2",
            "trainer.test_freq=1",
            "trainer.save_freq=2",
            "logging.log_val_generations=3",
            MIXED_REWARD,
            "logging.progress_bar=false",
            "logging.plot=false",
            f"trainer.default_local_dir={run}",
        ],
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        summary = trainer.fit()
    return run, summary


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    engine = trainer.actors.backend.worker.engine  # type: ignore[attr-defined]
    return {n: p.detach().clone() for n, p in engine.models[0].named_parameters()}


def test_rl_run_ends_with_its_hf_model_and_logged_samples(finished: tuple[str, dict]) -> None:
    run, summary = finished
    assert summary["model"] == os.path.join(run, "model")
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert set(os.listdir(summary["model"])) >= names
    assert not os.path.exists(os.path.join(run, ".model_export_checkpoint"))
    with open(os.path.join(run, "logs", "generations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # validation at RL steps 1 and 2 (3 samples each), then the held-out test of the end (stage "test")
    stages = [(r["stage"], r["step"]) for r in rows]
    assert stages[-9:] == [("rl", 1)] * 3 + [("rl", 2)] * 3 + [("test", 2)] * 3
    assert [r["prompt"] for r in rows[-9:-6]] == [r["prompt"] for r in rows[-6:-3]]  # the same prompts
    assert set(rows[-1]) == {"stage", "step", "data_source", "prompt", "response", "ground_truth", "score"}
    assert all(r["score"] in (0.0, 1.0) and r["data_source"] == "mcore_rl/arithmetic" for r in rows)
    assert 0.0 < summary["test_after_rl"] < 1.0  # the evals below compare a number that could differ


def test_eval_of_the_model_checkpoint_and_conversion_equals_the_runs_test(
    finished: tuple[str, dict],
    data: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, summary = finished
    test = f"{data}/test.jsonl"
    hf = evaluate_model(summary["model"], [test], EVAL_KEYS, use_ray=False)
    assert hf.by_source[ALL].greedy_accuracy == pytest.approx(summary["test_after_rl"])
    assert hf.by_source[ALL].num_prompts == 16 and hf.num_samples == 0
    # the run folder: its model/ (the export of the last checkpoint's weights) with the run's saved config as
    # the recipe; the eval writes nothing into the run (its ranks' output goes to a folder of its own, removed
    # when the eval succeeds)
    before = sorted(str(p.relative_to(run)) for p in Path(run).rglob("*"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    from_run = evaluate_model(run, [test], ["trainer.num_cpus=2"], use_ray=False)
    assert from_run.by_source == hf.by_source
    assert sorted(str(p.relative_to(run)) for p in Path(run).rglob("*")) == before
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("mcore-rl-eval-")]
    ckpt = convert_hf_to_mcore(HfToMcoreOptions(hf_dir=summary["model"], out=str(tmp_path / "mcore")))
    megatron = evaluate_model(ckpt, [test], EVAL_KEYS, use_ray=False)
    assert megatron.by_source == hf.by_source
    out = tmp_path / "eval.json"
    keys = [*EVAL_KEYS, "rollout.val_kwargs.n=4", "rollout.val_kwargs.temperature=1.0"]
    assert main(["eval", ckpt, test, *keys, "--in-process", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mcore_rl/arithmetic" in printed and "pass@4" in printed
    numbers = json.loads(out.read_text())["by_data_source"][ALL]
    assert numbers["greedy_accuracy"] == pytest.approx(summary["test_after_rl"])
    assert set(numbers) >= {"pass@1", "pass@2", "pass@4", "sampled_mean_reward"}
    assert numbers["pass@1"] <= numbers["pass@2"] <= numbers["pass@4"]


def test_a_run_checkpoint_moved_elsewhere_is_a_model_with_its_tokenizer(
    finished: tuple[str, dict], data: str, tmp_path: Path
) -> None:
    """A run checkpoint keeps the run's tokenizer (``hf_assets/``, in its manifest): copied away from the run and
    with the tokenizer folder the run named gone, it is evaluated, converted and started from as it was."""
    run, summary = finished
    step = Path(run) / "checkpoints" / "global_step_2"
    tokenizer = Path(data) / "tokenizer"
    assert (step / "hf_assets" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert "hf_assets/tokenizer.json" in json.loads((step / "manifest.json").read_text())["files"]
    moved = tmp_path / "elsewhere" / "global_step_2"
    shutil.copytree(step, moved)
    verify_run_checkpoint(str(moved))
    hidden = tmp_path / "tokenizer_gone"
    tokenizer.rename(hidden)
    try:
        report = evaluate_model(str(moved), [f"{data}/test.jsonl"], ["trainer.num_cpus=2"], use_ray=False)
        assert report.by_source[ALL].greedy_accuracy == pytest.approx(summary["test_after_rl"])
        hf = convert_mcore_to_hf(McoreToHfOptions(ckpt=str(moved), out=str(tmp_path / "hf")))
        assert (Path(hf) / "tokenizer.json").read_bytes() == (
            moved / "hf_assets" / "tokenizer.json"
        ).read_bytes()
        cfg = load_config(None, [f"model.path={moved}", f"data.train_files=[{data}/test.jsonl]", *EVAL_KEYS])
        assert cfg.model.tokenizer_path == str(moved / "hf_assets")  # the default: no tokenizer key needed
    finally:
        hidden.rename(tokenizer)


def test_an_export_keeps_the_models_generation_config_beside_another_tokenizer_folder(
    finished: tuple[str, dict], data: str, tmp_path: Path
) -> None:
    """A run whose tokenizer folder is not its model folder (model.path an Instruct model, tokenizer_path
    elsewhere) exports the model folder's generation_config.json (its stop ids) with the tokenizer's files."""
    run, _ = finished
    model = tmp_path / "instruct"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    step = str(Path(run) / "checkpoints" / "global_step_2")
    config = json.loads((Path(run) / "model" / "config.json").read_text())
    out = export_hf_model(step, str(tmp_path / "model"), config, (f"{data}/tokenizer", str(model)))
    assert json.loads((Path(out) / "generation_config.json").read_text()) == {"eos_token_id": [3, 4]}
    assert (Path(out) / "tokenizer.json").read_bytes() == (
        Path(data) / "tokenizer" / "tokenizer.json"
    ).read_bytes()


def test_a_megatron_checkpoint_as_model_path_loads_the_same_weights(
    finished: tuple[str, dict], data: str, tmp_path: Path
) -> None:
    _, summary = finished
    ckpt = convert_hf_to_mcore(HfToMcoreOptions(hf_dir=summary["model"], out=str(tmp_path / "mcore")))
    starts = []
    for i, path in enumerate((summary["model"], ckpt)):
        cfg = tiny_run_config(
            data,
            [
                f"model.path={path}",
                f"trainer.default_local_dir={tmp_path / f'run{i}'}",
                "trainer.total_training_steps=1",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
                "logging.progress_bar=false",
                "logging.plot=false",
            ],
        )
        assert cfg.model.tokenizer_path == os.path.join(data, "tokenizer")  # tiny_run_config names it
        with Trainer.from_config(cfg, use_ray=False) as trainer:
            starts.append(_weights(trainer))
            if i == 1:  # no run checkpoint: the export writes a model checkpoint of its own, then removes it
                assert trainer.fit()["model"] == str(tmp_path / "run1" / "model")
    vocab = 14
    for name, weight in starts[0].items():
        rows = slice(0, vocab) if "word_embeddings" in name or "output_layer" in name else slice(None)
        assert torch.equal(starts[1][name][rows], weight[rows]), name
    assert os.path.isfile(tmp_path / "run1" / "model" / "model.safetensors")
    assert not os.path.exists(tmp_path / "run1" / ".model_export_checkpoint")
