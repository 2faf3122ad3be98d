"""The KL reference after the SFT warm start (``sft.enable``): the policy RL starts from, not the model before
SFT (the worker copied the reference once, at build). At RL step 1 with one mini-batch and one epoch the update
runs on exactly those weights, so the KL term is 0; a resumed run reads the reference from its checkpoint."""

from __future__ import annotations

import os

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.trainer.trainer import Trainer
from tests.trainer.common import MIXED_REWARD, tiny_run_config

TIMING = ("time/", "tokens_per_s", "memory/")


def _overrides(data: str, run: str) -> list[str]:
    return [
        MIXED_REWARD,
        "trainer.test_freq=-1",
        "logging.progress_bar=false",
        "logging.plot=false",
        "sft.enable=true",
        f"sft.train_files=[{os.path.join(data, 'sft.jsonl')}]",
        "sft.total_steps=3",
        "sft.train_batch_size=16",
        "sft.micro_batch_size_per_gpu=16",
        "sft.optim.lr=1e-2",
        "algorithm.use_kl_loss=true",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        f"trainer.default_local_dir={run}",
    ]


def _rl(trainer: Trainer) -> dict[int, dict]:
    return {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in trainer.records
        if r["stage"] == "rl" and "kl_loss" in r
    }


def test_the_reference_is_where_rl_starts_after_sft_and_resumes_with_the_run(tmp_path) -> None:
    data = str(tmp_path / "data")
    straight = tiny_run_config(data, _overrides(data, str(tmp_path / "a")))
    with Trainer.from_config(straight, use_ray=False) as trainer:
        trainer.fit()
        expected = _rl(trainer)
    assert expected[1]["kl_loss"] == 0.0  # was 1.22: the KL to the pre-SFT model
    assert expected[3]["kl_loss"] > 0.0
    assert os.path.isdir(os.path.join(str(tmp_path / "a"), "checkpoints", "global_step_3", "reference"))

    cfg = tiny_run_config(data, _overrides(data, str(tmp_path / "b")))
    with Trainer.from_config(cfg, use_ray=False) as first:
        first.fit(stop_after=1)
    with Trainer.from_config(cfg, use_ray=False) as resumed:  # its workers copy model.path as the reference
        resumed.fit()
        assert {s: m for s, m in _rl(resumed).items() if s > 1} == {2: expected[2], 3: expected[3]}


def test_sft_with_lora_and_a_kl_term_is_refused_naming_the_keys(tmp_path) -> None:
    with pytest.raises(
        ConfigError, match=r"sft.enable=true with model.lora_rank=8 and algorithm.use_kl_loss"
    ):
        load_config(
            "recipes/demo_cpu.yaml",
            [
                "sft.enable=true",
                "model.lora_rank=8",
                "algorithm.use_kl_loss=true",
                "data.train_files=[x.jsonl]",
            ],
        )


def test_an_sft_run_of_a_lora_recipe_with_a_kl_term_runs_without_a_reference(tmp_path) -> None:
    """``mcore-rl sft`` on such a recipe (the refusal above is for the warm start inside ``train``): no RL step
    reads a reference, so the SFT run's config turns the KL terms off and builds none."""
    from mcore_rl.trainer.sft import sft_config

    cfg = sft_config(
        "recipes/demo_cpu.yaml",
        ["model.lora_rank=8", "algorithm.use_kl_loss=true", "data.train_files=[x.jsonl]"],
    )
    assert cfg.sft.enable and cfg.model.lora_rank == 8
    assert not cfg.algorithm.use_kl_loss and not cfg.algorithm.use_kl_in_reward
