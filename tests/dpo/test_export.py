"""A DPO run ends with the HF folder ``model/`` like an RL run: at DP2 without run checkpoints, both ranks save
a temporary model checkpoint, rank 0 converts it (config.json, safetensors, tokenizer files) and removes it."""

from __future__ import annotations

import os
from typing import Any

from safetensors import safe_open

from tests.dpo.test_trainer import tiny_dpo_config


def _fit_summary(cfg: Any) -> dict[str, Any]:
    from mcore_rl.dpo.trainer import DPOTrainer

    with DPOTrainer.from_config(cfg) as trainer:
        return trainer.fit()


def test_dpo_run_ends_with_its_hf_model(run_distributed, tmp_path) -> None:
    run = str(tmp_path / "run")
    cfg = tiny_dpo_config(
        str(tmp_path),
        [
            f"trainer.default_local_dir={run}",
            "trainer.total_training_steps=1",
            "trainer.save_freq=-1",
            "data.test_files=[]",  # no greedy answers to score: the export alone
            "logging.plot=false",
        ],
    )
    summaries = run_distributed(_fit_summary, cfg, world_size=2, timeout_s=600)
    model = os.path.join(run, "model")
    assert [s["model"] for s in summaries] == [model, model]  # every rank returns the folder
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(model))
    assert not os.path.exists(os.path.join(run, ".model_export_checkpoint"))
    assert not os.path.exists(os.path.join(run, "checkpoints"))
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").shape == (14, 64)


def test_dpo_from_a_megatron_checkpoint_says_to_convert_it(tmp_path) -> None:
    import json

    import pytest

    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.dpo.trainer import initial_weights
    from tests.models import tiny_hf_config

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    hf = tiny_hf_config("llama", max_position_embeddings=1024)
    (ckpt / "mcore_rl_model.json").write_text(json.dumps({"hf_config": hf}))
    cfg = load_config(None, ["dpo.train_files=[p.jsonl]", f"model.path={ckpt}"])
    with pytest.raises(
        ConfigError, match=r"a megatron checkpoint; DPO starts from an HF folder \(mcore-rl convert"
    ):
        initial_weights(cfg)
