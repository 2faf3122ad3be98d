"""The project's own recipes by bare name from any folder (``defaults: [base]``, ``mcore-rl train demo_cpu``),
and shipped with the wheel as ``mcore_rl/recipes/``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mcore_rl.cli import main
from mcore_rl.config import ConfigError, load_config
from mcore_rl.config.loader import project_recipes

REPO = Path(__file__).resolve().parents[2]


def test_a_recipe_outside_the_repo_finds_base_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("defaults: [base]\nrollout:\n  n: 4\n")
    cfg = load_config(tmp_path / "mine.yaml", rules=False)
    assert (
        cfg.rollout.n == 4
        and cfg.optim.lr == load_config(REPO / "recipes" / "base.yaml", rules=False).optim.lr
    )
    # and a recipe outside the repo can start from a project recipe that itself starts from base
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "short.yaml").write_text(
        "defaults: [demo_cpu]\ntrainer:\n  total_training_steps: 3\n"
    )
    cfg = load_config(tmp_path / "sub" / "short.yaml")
    assert cfg.trainer.total_training_steps == 3 and cfg.data.generate == "arithmetic_reversed"


def test_a_recipe_next_to_the_one_naming_it_wins(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(f"defaults: [{REPO / 'recipes' / 'base'}]\nrollout:\n  n: 6\n")
    (tmp_path / "mine.yaml").write_text("defaults: [base]\n")
    assert load_config(tmp_path / "mine.yaml", rules=False).rollout.n == 6


def test_a_bare_name_on_the_command_line_works_from_any_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", "demo_cpu", "--check", "rollout.n=4"]) == 0
    assert "experiment_name: demo_cpu" in capsys.readouterr().out
    (tmp_path / "demo_cpu.yaml").write_text("defaults: [base]\ntrainer:\n  experiment_name: here\n")
    assert main(["config", "show", "demo_cpu"]) == 0  # a recipe of that name here comes first
    assert "experiment_name: here" in capsys.readouterr().out


def test_a_missing_name_lists_the_project_recipes(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("defaults: [bsae]\n")
    with pytest.raises(ConfigError, match=r"bsae\.yaml: recipe not found .*by bare name: base, demo_cpu"):
        load_config(tmp_path / "mine.yaml")
    with pytest.raises(ConfigError, match=r"sub/base\.yaml: recipe not found"):  # a path is a path
        load_config(tmp_path / "sub" / "base")


def test_the_project_recipes_are_the_repository_folder_in_a_checkout() -> None:
    assert project_recipes() == REPO / "recipes"


def test_setup_ships_every_recipe_with_the_package(monkeypatch) -> None:
    """``setup.py`` maps ``recipes/`` to the data folder ``mcore_rl/recipes`` (what a wheel installs)."""
    from setuptools import Distribution

    captured: dict[str, object] = {}

    def record(**kwargs: object) -> Distribution:
        captured.update(kwargs)
        return Distribution()

    monkeypatch.setenv("MCORE_RL_NO_NATIVE", "1")
    monkeypatch.setattr("setuptools.setup", record)
    monkeypatch.chdir(REPO)
    code = compile((REPO / "setup.py").read_text(), str(REPO / "setup.py"), "exec")
    exec(code, {"__name__": "__main__", "__file__": str(REPO / "setup.py")})
    assert "mcore_rl.recipes" in captured["packages"]  # type: ignore[operator]
    folder = captured["package_dir"]["mcore_rl.recipes"]  # type: ignore[index]
    patterns = captured["package_data"]["mcore_rl.recipes"]  # type: ignore[index]
    shipped = {p.name for pattern in patterns for p in (REPO / folder).glob(pattern)}
    assert shipped == set(os.listdir(REPO / "recipes")) and "base.yaml" in shipped
