"""``mcore-rl plan``'s exit status: 1 when the run does not fit, in both forms, and written in ``--help``."""

from __future__ import annotations

import pytest
import yaml

from mcore_rl.cli import main
from tests.models import tiny_hf_config
from tests.planner.test_cli import REPO


def test_help_states_the_exit_status(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "exit status: 0 fits, 1 DOES NOT FIT (a smaller layout that fits is proposed), 2 bad input"
        in help_text
    )


def test_a_recipe_that_does_not_fit_exits_1_with_overrides_after_a_flag(tmp_path, capsys) -> None:
    recipe = tmp_path / "big.yaml"
    hf = tiny_hf_config("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32)
    hf.update(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    recipe.write_text(
        yaml.safe_dump({"defaults": [str(REPO / "recipes" / "base")], "model": {"hf_config": hf}})
    )
    argv = ["plan", str(recipe), "--gpu", "A100-40", "data.train_files=[x.parquet]", "--no-propose"]
    assert main([*argv, "data.max_prompt_length=4096", "data.max_response_length=4096"]) == 1
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT" in out
