"""``mcore-rl config show``: the defaults can be viewed (the rules a run needs are warnings unless
``--check``), an empty section is its defaults, and a hub id as ``model.path`` is named at config time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mcore_rl.cli import main
from mcore_rl.config import ConfigError, RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
BASE = str(REPO / "recipes" / "base.yaml")
DEMO = str(REPO / "recipes" / "demo_cpu.yaml")


def test_show_prints_the_defaults_of_base_and_warns_what_a_run_needs(capsys) -> None:
    assert main(["config", "show", BASE]) == 0
    captured = capsys.readouterr()
    shown = yaml.safe_load(captured.out)
    assert shown["rollout"]["n"] == 8 and shown["model"]["path"] is None  # the whole config, printed
    assert "warning: a run would refuse this config" in captured.err
    assert "set model.path" in captured.err and "data.train_files is empty" in captured.err


@pytest.mark.parametrize("flag", ["--check", "--check-paths"])
def test_check_makes_the_warnings_errors(flag: str, capsys) -> None:
    assert main(["config", "show", BASE, flag]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("mcore-rl config: error: invalid run config (")
    # one line on the console, the problems parted by "; " rather than run together
    assert len(captured.err.splitlines()) == 1
    assert "(an inline config.json); data.train_files is empty" in captured.err


def test_a_config_that_can_run_prints_no_warning(capsys) -> None:
    assert main(["config", "show", DEMO, "--check"]) == 0
    assert capsys.readouterr().err == ""


def test_field_errors_stay_errors_without_check(capsys) -> None:
    assert main(["config", "show", BASE, "rollout.n=0"]) == 1
    assert "rollout.n=0 must be > 0" in capsys.readouterr().err


def test_a_section_left_empty_is_its_defaults(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [{DEMO}]\nreward:\nlogging:\nrollout:\n  val_kwargs:\n  n: 4\n")
    cfg = load_config(recipe)
    demo = load_config(DEMO)
    assert cfg.reward == demo.reward and cfg.logging == demo.logging
    assert cfg.rollout.val_kwargs == demo.rollout.val_kwargs and cfg.rollout.n == 4
    # a field that may be None keeps its null; an unknown key left empty is still unknown
    (tmp_path / "c.yaml").write_text(f"defaults: [{DEMO}]\ncritic:\n  parallel:\n")
    assert load_config(tmp_path / "c.yaml").critic.parallel is None
    (tmp_path / "u.yaml").write_text(f"defaults: [{DEMO}]\nrewards:\n")
    with pytest.raises(ConfigError, match="unknown key rewards"):
        load_config(tmp_path / "u.yaml")


def test_rules_false_builds_a_config_that_cannot_run() -> None:
    cfg = load_config(BASE, rules=False)
    assert isinstance(cfg, RunConfig) and cfg.data.train_files == []
    with pytest.raises(ConfigError, match=r"data\.train_files is empty"):
        load_config(BASE)


def test_a_hub_id_as_model_path_is_named_at_config_time(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    message = str(info.value)
    assert "model.path=Qwen/Qwen2.5-0.5B-Instruct: no such local folder" in message
    assert "must be a local folder (no downloads); got a hub id?" in message
    # named once, also when the paths are checked (tokenizer_path follows model.path)
    with pytest.raises(ConfigError) as info:
        load_config(
            DEMO, ["model.path=Qwen/Qwen2.5-0.5B-Instruct", "model.tokenizer_path=${model.path}"], True
        )
    assert "model.tokenizer_path" not in str(info.value) and str(info.value).count("Qwen/Qwen2.5") == 2
    # a local folder of that shape is a folder, and an absolute path on another machine is left to --check-paths
    (tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct").mkdir(parents=True)
    (tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct" / "config.json").write_text("{}")  # the recipe's hf_config
    load_config(DEMO, ["model.path=Qwen/Qwen2.5-0.5B-Instruct", f"model.tokenizer_path={tmp_path}"])
    load_config(DEMO, ["model.path=/models/Llama-3.1-8B"])
