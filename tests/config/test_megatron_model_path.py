"""``model.path`` naming a megatron model checkpoint (``mcore-rl convert hf-to-mcore`` output): the
architecture comes from its ``mcore_rl_model.json`` (``model.hf_config`` still overrides it), the tokenizer
from its ``hf_assets/`` unless one is named, the weights through ``load_dir`` (each rank its own shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.config.model import ModelConfig
from tests.models import tiny_hf_config

HF = tiny_hf_config("llama", vocab_size=14, max_position_embeddings=1024)


def checkpoint(folder: Path, info: object, assets: bool = True) -> Path:
    folder.mkdir()
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (folder / "mcore_rl_model.json").write_text(json.dumps(info))
    if assets:
        (folder / "hf_assets").mkdir()
    return folder


def test_architecture_and_tokenizer_come_from_the_checkpoint(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "ckpt", {"hf_config": HF, "dtype": "float32", "format_version": 1})
    model = ModelConfig(path=str(ckpt), tokenizer_path=str(ckpt))
    assert model.is_megatron_checkpoint()
    assert model.tokenizer_path == str(ckpt / "hf_assets")
    assert model.hf_config_dict() == HF
    assert ModelConfig(path=str(ckpt), tokenizer_path="tok").tokenizer_path == "tok"  # named: kept
    cfg = load_config(
        None,
        ["rollout.n=2", "data.train_files=[x.jsonl]", f"model.path={ckpt}", "model.hf_config.rope_theta=5.0"],
    )
    assert cfg.model.tokenizer_path == str(ckpt / "hf_assets")  # the default follows model.path there
    assert cfg.model.arch().num_layers == HF["num_hidden_layers"]
    assert cfg.model.hf_config_dict()["rope_theta"] == 5.0


def test_a_run_checkpoint_without_assets_keeps_the_path_as_tokenizer(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "ckpt", {"hf_config": HF}, assets=False)
    assert ModelConfig(path=str(ckpt), tokenizer_path=str(ckpt)).tokenizer_path == str(ckpt)


def test_hf_folder_is_not_a_megatron_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF))
    assert not ModelConfig(path=str(tmp_path)).is_megatron_checkpoint()
    assert not ModelConfig().is_megatron_checkpoint()


@pytest.mark.parametrize("info", [{"dtype": "float32"}, {"hf_config": [1]}])
def test_a_checkpoint_without_its_config_is_named(tmp_path: Path, info: object) -> None:
    ckpt = checkpoint(tmp_path / "ckpt", info)
    with pytest.raises(ConfigError, match=r"model.path: .*mcore_rl_model.json has no hf_config object"):
        ModelConfig(path=str(ckpt)).hf_config_dict()
