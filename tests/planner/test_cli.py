"""``mcore-rl plan``: the flag form and the recipe form, exit status 0 / 1 / 2."""

from __future__ import annotations

import json

import pytest

from mcore_rl.cli import main
from tests.planner.hf_configs import LLAMA31_8B


@pytest.fixture
def llama8b_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA31_8B))
    return str(path)


def test_flags_form_fits(llama8b_config, capsys):
    argv = ["plan", "--model-config", llama8b_config, "--tp", "2", "--sp", "--rollout-tp", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "model: 8,030,261,248 parameters; this rank holds 4,015,263,744" in out
    assert "8 x A100-80: tp=2 pp=1 dp=4 sp=True" in out
    assert "verdict: fits" in out


def test_flags_form_too_big_proposes_a_layout(llama8b_config, capsys):
    argv = ["plan", "--model-config", llama8b_config, "--gpu", "A100-40", "--micro-batch-size", "4"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT" in out
    assert "train phase needs" in out and "(largest term: activations)" in out
    assert "smallest layout that fits: 8 x A100-40: tp=4" in out


def test_bad_layout_is_one_line_naming_the_field(llama8b_config, capsys):
    assert main(["plan", "--model-config", llama8b_config, "--tp", "3", "--gpus-per-node", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: num_attention_heads=32 is not divisible by tensor_parallel_size=3"


def test_recipe_form_reads_the_run_config(capsys):
    argv = ["plan", "recipes/demo_cpu.yaml", "algorithm.ppo_micro_batch_size_per_gpu=32", "--gpu", "A100-40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # ppo_mini_batch_size follows train_batch_size (16 prompts) x rollout.n (8); 8 + 6 tokens per sequence.
    assert "batch: 128 sequences x 14 tokens per step, micro-batch 32, 4 micro-batches per DP rank" in out
    assert "model: 430,208 parameters" in out  # the recipe's inline architecture
    assert "verdict: fits" in out


def test_recipe_form_reports_config_errors(capsys):
    assert main(["plan", "recipes/demo_cpu.yaml", "rollout.n=4"]) == 2
    assert "ppo_micro_batch_size_per_gpu=128 does not divide" in capsys.readouterr().err


def test_recipe_form_refuses_layout_flags(capsys):
    assert main(["plan", "recipes/demo_cpu.yaml", "--tp", "2"]) == 2
    assert "--tp cannot be combined with a recipe" in capsys.readouterr().err
