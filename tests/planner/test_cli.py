"""``mcore-rl plan``: the flag form and the recipe form, exit status 0 / 1 / 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mcore_rl.cli import main
from mcore_rl.planner import model_params
from tests.models import tiny_arch, tiny_hf_config
from tests.planner.hf_configs import LLAMA31_8B

REPO = Path(__file__).resolve().parents[2]


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
    assert "smallest layout that fits: 4 x A100-40: tp=4" in out


def test_bad_layout_is_one_line_naming_the_field(llama8b_config, capsys):
    assert main(["plan", "--model-config", llama8b_config, "--tp", "3", "--gpus-per-node", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: num_attention_heads=32 is not divisible by tensor_model_parallel_size=3"


@pytest.fixture
def tiny_recipe(tmp_path):
    """A recipe of its own (the shared demo recipes change under other work): base + a tiny Llama."""
    recipe = {
        "defaults": [str(REPO / "recipes" / "base")],
        "model": {"hf_config": tiny_hf_config("llama")},
        "rollout": {"n": 4},
        "algorithm": {"ppo_micro_batch_size_per_gpu": 8},
        "data": {
            "train_files": ["prompts.parquet"],
            "max_prompt_length": 20,
            "max_response_length": 12,
            "train_batch_size": 16,
        },
        "trainer": {"n_gpus_per_node": 2},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_recipe_form_reads_the_run_config(tiny_recipe, capsys):
    assert main(["plan", tiny_recipe, "algorithm.ppo_micro_batch_size_per_gpu=4", "--gpu", "A100-40"]) == 0
    out = capsys.readouterr().out
    # ppo_mini_batch_size follows train_batch_size (16 prompts) x rollout.n (4) = 64 sequences over DP2;
    # 20 + 12 tokens; the override's micro-batch of 4 -> 64 / 2 / 4 = 8 micro-batches.
    assert "batch: 64 sequences x 32 tokens per step, micro-batch 4, 8 micro-batches per DP rank" in out
    assert "2 x A100-40: tp=1 pp=1 dp=2" in out
    assert f"model: {model_params(tiny_arch('llama')):,} parameters" in out  # the recipe's inline model
    assert "verdict: fits" in out


def test_recipe_form_reports_config_errors(tiny_recipe, capsys):
    assert main(["plan", tiny_recipe, "parallel.tensor_model_parallel_size=3"]) == 2
    assert "= 3 does not divide the world size 2" in capsys.readouterr().err


def test_a_recipe_whose_model_folder_is_elsewhere_is_planned_from_its_config_json(tmp_path, capsys):
    """A cluster recipe names /models/...: here its error says how to plan without the folder, and
    --model-config does it."""
    recipe = str(REPO / "recipes" / "llama3_8b_grpo_a100.yaml")
    missing = f"model.path={tmp_path / 'not-here'}"
    assert main(["plan", recipe, missing]) == 2
    err = capsys.readouterr().err
    assert "config.json does not exist; plan reads only the model's config.json" in err
    assert "--model-config CONFIG.json" in err
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA31_8B))
    assert main(["plan", recipe, missing, "--model-config", str(path)]) in (0, 1)  # fits or not: planned
    assert "model: 8,030,261,248 parameters" in capsys.readouterr().out


def test_recipe_form_refuses_layout_flags(tiny_recipe, capsys):
    assert main(["plan", tiny_recipe, "--tp", "2"]) == 2
    assert "--tp cannot be combined with a recipe" in capsys.readouterr().err


def test_the_report_names_its_assumptions(capsys):
    """The assumed GPU, why a rank holds more than the model (vocab padding), and reshard buffers no larger
    than what a rank moves (a 0.5M-parameter model never fills two 256 MiB buckets)."""
    assert main(["plan", str(REPO / "recipes" / "demo_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu: A100-80 assumed (--gpu names yours: A100-40, A100-80, H100-80, H200-141)\n")
    assert "(the vocabulary padded from 14 to 128 rows, a multiple of 128 x tp, as megatron does)" in out
    switch = out.split("switch:")[1].split("rollout:")[0]
    sizes = {line.rsplit(None, 2)[0].strip(): line.split()[-2:] for line in switch.splitlines()[1:] if line}
    assert sizes["reshard buffers"] == ["4.1", "MiB"], sizes  # its weights sent + rollout weights received
    assert main(["plan", str(REPO / "recipes" / "demo_cpu.yaml"), "--gpu", "H100-80"]) == 0
    assert "assumed" not in capsys.readouterr().out


def test_flags_form_expert_parallel(tmp_path, capsys):
    """``--ep`` / ``--etp`` for a mixture-of-experts model; a size the experts do not divide is exit 2."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_hf_config("qwen3_moe")))
    common = ["plan", "--model-config", str(path), "--seq-length", "16", "--global-batch-size", "8"]
    argv = [*common, "--gpus-per-node", "2", "--tp", "2", "--sp", "--ep", "2", "--etp", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 x A100-80: tp=2 pp=1 dp=1 ep=2 etp=1 edp=1 sp=True" in out
    assert "in its 2 experts per MoE layer (each split over etp=1)" in out
    assert main([*common, "--gpus-per-node", "6", "--ep", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: num_experts=4 is not divisible by expert_model_parallel_size=3"
    )
