"""``mcore-rl eval``'s numbers without a model: the unbiased pass@k against counting every k-subset, the
per-data_source summary on hand-computed rewards, the report's JSON and table, what a model argument
resolves to (HF folder, megatron checkpoint, run checkpoint, run folder) and the config an eval runs on."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from mcore_rl.io.errors import ConfigError, InputError, OutputError
from mcore_rl.trainer.evaluate import (
    ALL,
    EvalReport,
    eval_config,
    eval_source,
    pass_at_k,
    pass_ks,
    summarize,
    write_report,
)
from tests.models import tiny_hf_config


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (5, 2), (8, 8), (7, 3)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n: int, c: int) -> None:
    passes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(passes, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_reported_ks() -> None:
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(8) == [1, 2, 4, 8]


def test_summary_per_data_source_by_hand() -> None:
    sources = ["gsm8k", "math", "gsm8k"]
    greedy = torch.tensor([1.0, 0.1, 0.0])  # 0.1: a format score, not a pass
    samples = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    out = summarize(sources, greedy, samples)
    assert list(out) == ["gsm8k", "math", ALL]
    g = out["gsm8k"]
    assert (g.num_prompts, g.greedy_accuracy, g.greedy_mean_reward) == (2, 0.5, 0.5)
    assert g.sampled_mean_reward == pytest.approx(0.75)
    assert g.pass_at == {1: pytest.approx(0.75), 2: pytest.approx(1.0)}
    m = out["math"]
    assert (m.greedy_accuracy, m.greedy_mean_reward, m.pass_at) == (0.0, pytest.approx(0.1), {1: 0.0, 2: 0.0})
    a = out[ALL]
    assert (a.num_prompts, a.greedy_accuracy) == (3, pytest.approx(1 / 3))
    assert a.pass_at == {1: pytest.approx(0.5), 2: pytest.approx(2 / 3)}
    assert summarize(sources, greedy, samples, pass_threshold=0.1)["math"].greedy_accuracy == 1.0
    greedy_only = summarize(sources, greedy)[ALL]
    assert greedy_only.sampled_mean_reward is None and greedy_only.pass_at == {}


def test_report_json_and_table(tmp_path: Path) -> None:
    by_source = summarize(["a", "b"], torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    report = EvalReport("m", ["d.parquet"], 2, 1.0, 1.0, by_source)
    numbers = report.to_json()
    assert numbers["by_data_source"]["all"] == {
        "num_prompts": 2,
        "greedy_accuracy": 0.5,
        "greedy_mean_reward": 0.5,
        "sampled_mean_reward": 0.5,
        "pass@1": 0.5,
        "pass@2": 1.0,
    }
    lines = report.table().splitlines()
    assert lines[0].split() == [
        "data_source",
        "prompts",
        "greedy",
        "acc",
        "greedy",
        "reward",
        "sampled",
        "reward",
        "pass@1",
        "pass@2",
    ]
    assert lines[3].split() == ["all", "2", "50.0%", "0.500", "0.500", "50.0%", "100.0%"]
    out = tmp_path / "r.json"
    write_report(report, str(out))
    assert json.loads(out.read_text()) == numbers
    with pytest.raises(OutputError, match="exists; it is left as it is"):
        write_report(report, str(out))


def _megatron_checkpoint(folder: Path, hf: dict, assets: bool = False) -> Path:
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    info = {"hf_config": hf, "dtype": "float32", "format_version": 1, "extra": {}}
    (folder / "mcore_rl_model.json").write_text(json.dumps(info))
    if assets:
        (folder / "hf_assets").mkdir()
        (folder / "hf_assets" / "tokenizer.json").write_text("{}")
    return folder


def test_model_argument_resolution(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    assert eval_source(str(hf)).recipe is None
    step = _megatron_checkpoint(tmp_path / "run" / "checkpoints" / "global_step_3", {})
    (step / "config.yaml").write_text("{}")
    (step / "trainer_state.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("global_step_3\n")
    for given in (step, tmp_path / "run"):
        source = eval_source(str(given))
        assert (source.model_path, source.recipe) == (str(step), str(step / "config.yaml"))
    with pytest.raises(InputError, match="local folders only"):
        eval_source("Qwen/Qwen2.5-0.5B-Instruct")


def test_eval_config_loads_a_megatron_checkpoint_and_switches_training_off(tmp_path: Path) -> None:
    from mcore_rl.trainer.build import worker_spec

    hf = tiny_hf_config("llama", vocab_size=14, max_position_embeddings=1024)
    ckpt = _megatron_checkpoint(tmp_path / "ckpt", hf, assets=True)
    cfg = eval_config(
        str(ckpt), ["data/x.jsonl"], ["rollout.val_kwargs.n=4", "parallel.tensor_model_parallel_size=1"]
    )
    assert cfg.model.path == str(ckpt)
    assert cfg.model.tokenizer_path == str(ckpt / "hf_assets")  # the conversion's copy of the tokenizer
    assert cfg.model.arch().hidden_size == hf["hidden_size"]  # from mcore_rl_model.json
    assert cfg.data.train_files == ["data/x.jsonl"] and cfg.data.val_files == [] and not cfg.sft.enable
    assert cfg.rollout.val_kwargs.n == 4
    spec = worker_spec(cfg, 1)
    assert (spec.load_dir, spec.hf_path) == (str(ckpt), None)  # each rank reads its shards
    assert worker_spec(eval_config(str(ckpt), ["x.jsonl"], ["model.load_weights=false"]), 1).load_dir is None


def test_eval_refuses_greedy_pass_at_k(tmp_path: Path) -> None:
    from mcore_rl.trainer.evaluate import evaluate_model

    ckpt = _megatron_checkpoint(tmp_path / "ckpt", tiny_hf_config("llama", max_position_embeddings=1024))
    with pytest.raises(
        ConfigError, match=r"rollout\.val_kwargs\.n=4 with rollout\.val_kwargs\.temperature=0"
    ):
        evaluate_model(str(ckpt), ["x.jsonl"], ["rollout.val_kwargs.n=4"])
    with pytest.raises(ConfigError, match="give at least one data file"):
        evaluate_model(str(ckpt), [])


def test_schema_defaults_too_long_for_the_model_point_to_the_recipe(tmp_path: Path) -> None:
    ckpt = _megatron_checkpoint(tmp_path / "ckpt", tiny_hf_config("llama", max_position_embeddings=64), True)
    with pytest.raises(ConfigError, match="max_position_embeddings=64") as refused:
        eval_config(str(ckpt), ["x.jsonl"])
    assert "--recipe RECIPE" in str(refused.value) and "data.max_response_length" in str(refused.value)
    short = ["data.max_prompt_length=32", "data.max_response_length=32"]
    assert eval_config(str(ckpt), ["x.jsonl"], short).data.max_response_length == 32


def _run_folder_with_model(run: Path) -> Path:
    """A finished run written with trainer.save_freq=-1: config.yaml, logs/ and model/, no checkpoints/."""
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    model = run / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_hf_config("llama", max_position_embeddings=1024)))
    return model


def test_a_run_folder_is_evaluated_from_its_model_unless_a_later_checkpoint_exists(tmp_path: Path) -> None:
    import os

    run = tmp_path / "rl"
    model = _run_folder_with_model(run)
    # README's `mcore-rl eval runs/rl DATA`: the run folder was read as an HF folder
    source = eval_source(str(run))
    assert (source.model_path, source.recipe) == (str(model), str(run / "config.yaml"))
    step = _megatron_checkpoint(run / "checkpoints" / "global_step_4", {})
    (step / "config.yaml").write_text("{}")
    (step / "trainer_state.json").write_text("{}")
    latest = run / "checkpoints" / "latest"
    latest.write_text("global_step_4\n")
    os.utime(latest, (1000, 1000))  # the last checkpoint, then the export at the run's end
    assert eval_source(str(run)).model_path == str(model)
    os.utime(latest)  # resumed past the export and stopped: the checkpoint holds the newest weights
    source = eval_source(str(run))
    assert (source.model_path, source.recipe) == (str(step), str(step / "config.yaml"))
    (run / "config.yaml").unlink()  # not a run's model/: the folder's checkpoint as before
    os.utime(latest, (1000, 1000))
    assert eval_source(str(run)).model_path == str(step)


@pytest.mark.parametrize(
    "files",
    [["data/gsm8k,v2.parquet"], ["a#b.jsonl", "c: d.parquet", "123", "null"], ["x=1.parquet", "${y}/z"]],
)
def test_eval_data_and_model_paths_are_taken_as_written(tmp_path: Path, files: list[str]) -> None:
    hf = tiny_hf_config("llama", vocab_size=14, max_position_embeddings=1024)
    ckpt = _megatron_checkpoint(tmp_path / "ckpt, #1: x", hf, assets=True)
    cfg = eval_config(str(ckpt), files, ["data.max_prompt_length=8", "data.max_response_length=8"])
    assert cfg.data.train_files == files  # one file per path: a comma split gsm8k,v2 in two
    assert cfg.model.path == str(ckpt)


def test_a_run_folders_model_reads_the_runs_config(tmp_path: Path) -> None:
    # README's `mcore-rl eval runs/tool_demo/model DATA rollout.multi_turn.tools=[]`: the schema's defaults were read
    run = tmp_path / "tool_demo"
    model = _run_folder_with_model(run)
    (run / "config.yaml").write_text("data: {max_response_length: 24}\n")
    for given in (str(model), f"{model}/"):
        source = eval_source(given)
        assert (source.model_path, source.recipe) == (given, str(run / "config.yaml"))
    assert eval_config(str(model), ["x.jsonl"]).data.max_response_length == 24
    other = tmp_path / "hf" / "weights"  # a folder not named model/: an HF folder, whatever sits beside it
    other.mkdir(parents=True)
    (tmp_path / "hf" / "config.yaml").write_text("{}")
    assert eval_source(str(other)).recipe is None


def test_a_runs_config_uses_the_tokenizer_shipped_with_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the saved config's tokenizer path is relative to where the run started, not to where eval runs
    run = tmp_path / "rl"
    model = _run_folder_with_model(run)
    (run / "config.yaml").write_text("model: {tokenizer_path: runs/demo_rev_data/tokenizer}\n")
    monkeypatch.chdir(tmp_path)
    assert eval_config(str(run), ["x.jsonl"]).model.tokenizer_path == "runs/demo_rev_data/tokenizer"
    (model / "tokenizer.json").write_text("{}")
    for given in (run, model):
        assert eval_config(str(given), ["x.jsonl"]).model.tokenizer_path == str(model)
    mine = ["model.tokenizer_path=tok"]  # the user's override still wins
    assert eval_config(str(run), ["x.jsonl"], mine).model.tokenizer_path == "tok"
