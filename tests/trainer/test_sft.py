"""``mcore-rl sft`` (in-process): the loss on response tokens falls, the run folder holds the resolved config,
the logs and the model, and an RL run started from that model (``model.path``) holds exactly its weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.config import ConfigError
from mcore_rl.trainer.sft import fit_sft, sft_config
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import demo_recipe_overrides, tiny_run_config


def _overrides(data: str, run: str) -> list[str]:
    return [
        *demo_recipe_overrides(data, run),
        "sft.train_batch_size=16",
        "sft.micro_batch_size_per_gpu=8",
        "sft.optim.lr_warmup_steps=0",
    ]


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    engine = trainer.actors.backend.worker.engine  # type: ignore[attr-defined]
    return {n: p.detach().clone() for n, p in engine.models[0].named_parameters()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("data"))
    tiny_run_config(folder)  # writes the small demo splits and the tokenizer
    return folder


def test_sft_lowers_the_loss_and_rl_starts_from_its_model(data, tmp_path) -> None:
    run = str(tmp_path / "sft")
    cfg = sft_config(
        "recipes/demo_cpu.yaml", [*_overrides(data, run), "sft.total_steps=8", "sft.test_freq=4"]
    )
    with Trainer.from_config(cfg, use_ray=False) as trainer:
        summary = fit_sft(trainer)
        trained = _weights(trainer)
    assert summary.steps == 8 and summary.last_loss < 0.9 * summary.first_loss
    assert summary.test_before is not None and summary.test_after is not None
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert set(os.listdir(summary.model_dir)) >= names  # + the io layer's ownership marker
    assert os.path.isfile(os.path.join(run, "config.yaml"))
    with open(os.path.join(summary.log_dir, "metrics.jsonl")) as f:
        stages = [json.loads(line)["stage"] for line in f]
    assert stages == ["test", *["sft"] * 8, "test"]

    rl_overrides = [
        *_overrides(data, str(tmp_path / "rl")),
        f"model.path={summary.model_dir}",
        "sft.enable=false",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
    ]
    with Trainer.from_config("recipes/demo_cpu.yaml", rl_overrides, use_ray=False) as rl:
        start = _weights(rl)
        assert start.keys() == trained.keys()
        # fp32 through safetensors: exact, but for the vocab padding rows (never a token, not in the HF file)
        vocab = rl.cfg.model.arch().vocab_size
        for name, weight in trained.items():
            padded = "word_embeddings" in name or "output_layer" in name
            assert (
                torch.equal(start[name][:vocab], weight[:vocab])
                if padded
                else torch.equal(start[name], weight)
            )
        rl.fit()
        stages = [(r["stage"], r["step"]) for r in rl.records]
        assert stages == [("test", 0), ("rl", 0), ("rl", 1), ("test", 1)]  # val at step 0: val_before_train


def test_sft_command_writes_the_model_and_says_how_to_start_rl_from_it(data, tmp_path, capsys) -> None:
    run = str(tmp_path / "sft")
    args = [*_overrides(data, run), "sft.total_steps=2", "sft.test_freq=100", "data.test_files=[]"]
    assert main(["sft", "recipes/demo_cpu.yaml", *args, "--in-process"]) == 0
    out = capsys.readouterr().out
    assert "2 SFT steps (loss " in out and f"model.path={run}/model sft.enable=false" in out
    assert "held-out accuracy: none (set data.test_files to score one)" in out and "n/a" not in out
    assert os.path.isfile(os.path.join(run, "model", "model.safetensors"))
    assert os.path.isfile(os.path.join(run, "sft_checkpoint", "metadata.json"))
    # the checkpoint keeps the run's tokenizer: it alone is a model to start RL from, wherever it lies
    assets = os.path.join(run, "sft_checkpoint", "hf_assets")
    with (
        open(os.path.join(assets, "tokenizer.json"), "rb") as kept,
        open(os.path.join(run, "model", "tokenizer.json"), "rb") as exported,
    ):
        assert kept.read() == exported.read()


def test_sft_without_examples_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"sft\.train_files"):
        sft_config("recipes/demo_cpu.yaml", ["sft.train_files=[]"])


def test_sft_validates_on_its_own_prompts(data, tmp_path) -> None:
    """``sft.val_files`` given, ``data.val_files`` not: the SFT stage validates on its own prompts (it read
    ``data.val_files`` alone, so an early stop at ``sft.target_val_accuracy`` never came)."""
    args = [
        *_overrides(data, str(tmp_path / "sft")),
        "data.val_files=[]",
        "data.test_files=[]",
        "trainer.test_freq=-1",
        f"sft.val_files=[{data}/val.jsonl]",
        "sft.total_steps=4",
        "sft.test_freq=2",
    ]
    with Trainer.from_config(sft_config("recipes/demo_cpu.yaml", args), use_ray=False) as trainer:
        fit_sft(trainer)
        validated = [r["step"] for r in trainer.records if r["stage"] == "sft" and "val_accuracy" in r]
    assert validated == [2, 4]


def test_an_sft_target_without_validation_prompts_is_refused(data, tmp_path) -> None:
    args = [*_overrides(data, str(tmp_path / "sft")), "data.val_files=[]", "trainer.test_freq=-1"]
    args.append("sft.target_val_accuracy=0.5")
    with pytest.raises(ConfigError, match=r"sft\.target_val_accuracy=0\.5 needs sft\.val_files"):
        sft_config("recipes/demo_cpu.yaml", args)


def test_the_sft_loss_is_the_mean_nll_of_response_tokens_only(data) -> None:
    from mcore_rl.data.sft import SFTDataset
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.trainer.build import build_actor_group, worker_spec
    from mcore_rl.types import RolloutBatch

    cfg = tiny_run_config(data)
    dataset = SFTDataset.from_files([f"{data}/sft.jsonl"], load_tokenizer(cfg.model.tokenizer_path), cfg.data)
    batch = dataset.batch(range(8))
    actors = build_actor_group(cfg, worker_spec(cfg, total_optimizer_steps=1), use_ray=False)
    try:
        rows = batch.tokens.shape[0]
        probe = RolloutBatch(  # the trainer's log-probs of every next token, before the step
            batch.tokens,
            batch.loss_mask,
            torch.zeros(batch.loss_mask.shape),
            batch.labels,
            torch.ones(rows),
            torch.arange(rows),
        )
        log_probs = actors.submit_log_probs(probe, temperature=1.0, micro_batch_size=8)().actor_log_probs
        loss = actors.sft_update(batch, micro_batch_size=4)["loss"]
    finally:
        actors.shutdown()
    mask = batch.loss_mask
    assert 0 < mask.sum() < (batch.tokens != 0).sum() - rows  # prompts are long enough to matter
    assert loss == pytest.approx(float(-(log_probs * mask).sum() / mask.sum()), rel=1e-5)
    every_position = -(log_probs[:, :-1]).mean()
    assert abs(loss - float(every_position)) > 1e-3  # the prompt positions would change it


def test_rl_after_a_warm_start_without_validation_or_test_samples_from_the_sft_weights(
    data, tmp_path
) -> None:
    """Nothing but the warm start itself syncs the SFT weights into the rollout engine here (no validation
    or test set to evaluate): RL's first step must still generate from them, and agree with the trainer."""
    run = str(tmp_path / "run")
    overrides = [
        *_overrides(data, run),
        "sft.total_steps=3",
        "sft.test_freq=100",
        "sft.target_val_accuracy=null",
        "data.val_files=[]",
        "data.test_files=[]",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
    ]
    with Trainer.from_config("recipes/demo_cpu.yaml", overrides, use_ray=False) as trainer:
        trainer.fit()
        rl = [r for r in trainer.records if r["stage"] == "rl"]
    assert len(rl) == 1 and abs(rl[0]["token_mult_prob_error"] - 1) < 1e-5
