"""The model's own stop ids: ``generation_config.json``'s ``eos_token_id`` (one id or a list) stops a response
as vLLM and transformers stop it; only the tokenizer's one EOS did (a Qwen2.5-Instruct response ending in
``<|endoftext|>``, a Llama-3.1 one in ``<|eom_id|>``, ran on to ``rollout.response_length``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.config.model import ModelConfig


def _model(folder: Path, generation: object | None) -> ModelConfig:
    folder.mkdir()
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return ModelConfig(path=str(folder), tokenizer_path=str(folder))


def test_the_generation_configs_eos_ids_stop_a_response(tmp_path: Path) -> None:
    assert _model(tmp_path / "list", {"eos_token_id": [7, 3]}).generation_stop_ids() == [7, 3]
    assert _model(tmp_path / "one", {"eos_token_id": 9, "do_sample": True}).generation_stop_ids() == [9]
    assert _model(tmp_path / "none", None).generation_stop_ids() == []
    assert _model(tmp_path / "unset", {"do_sample": True}).generation_stop_ids() == []
    rollout = load_config("recipes/demo_cpu.yaml", ["rollout.stop_token_ids=[5,3]"]).rollout
    params = rollout.sampling_params(eos_token_id=3, pad_token_id=0, seed=1, model_stops=[7, 3])
    assert params.stop_token_ids == (3, 7, 5)  # each once, the tokenizer's EOS first


def test_a_broken_generation_config_is_named(tmp_path: Path) -> None:
    model = _model(tmp_path / "bad", {"eos_token_id": ["<|im_end|>"]})
    with pytest.raises(
        ConfigError, match=r"generation_config\.json: eos_token_id=\['<\|im_end\|>'\] is not a token id"
    ):
        model.generation_stop_ids()
