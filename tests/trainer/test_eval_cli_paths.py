"""``mcore-rl eval``'s arguments before any model is built: ``--json OUT`` refused up front (a missing folder
was found after the whole evaluation, its numbers lost) and which DATA_OR_KEY=VALUE arguments are overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.models import tiny_hf_config


def _eval_without_a_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str) -> tuple[int, list]:
    """``mcore-rl eval HF DATA --json OUT`` with the evaluation itself replaced by a recorder."""
    import mcore_rl.trainer.evaluate as evaluate
    from mcore_rl.cli import main

    called: list = []
    monkeypatch.setattr(evaluate, "evaluate_model", lambda *a, **k: called.append(a) or _raise())
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(tiny_hf_config("llama")))
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    return main(["eval", str(model), str(data), "--in-process", "--json", out]), called


def _raise() -> None:
    raise RuntimeError("the evaluation ran")


def test_json_folder_is_checked_before_evaluating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    code, called = _eval_without_a_model(tmp_path, monkeypatch, str(tmp_path / "nodir" / "out.json"))
    assert (code, called) == (1, [])
    err = capsys.readouterr().err
    assert f"--json {tmp_path}/nodir/out.json: folder {tmp_path}/nodir does not exist" in err
    (tmp_path / "out.json").write_text("{}")
    code, called = _eval_without_a_model(tmp_path, monkeypatch, str(tmp_path / "out.json"))
    assert (code, called) == (1, [])
    assert "exists; it is left as it is" in capsys.readouterr().err


def test_json_folder_must_be_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.access(locked, os.W_OK):  # root writes anywhere: the permission as a user without it sees it
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real(p, mode))
    code, called = _eval_without_a_model(tmp_path, monkeypatch, str(locked / "out.json"))
    assert (code, called) == (1, [])
    assert f"folder {locked} is not writable" in capsys.readouterr().err


def test_an_existing_file_with_an_equals_sign_is_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mcore_rl.trainer.eval_cli import split_inputs

    monkeypatch.chdir(tmp_path)
    Path("split=test.parquet").write_text("")
    Path("gsm8k,v2.parquet").write_text("")
    args = [
        "split=test.parquet",  # an existing file, its left side no key: data (it was an override)
        "gsm8k,v2.parquet",
        "data/missing=1.parquet",  # missing, not key-like: data, then named as a missing file
        "rollout.val_kwargs.n=8",
        "rollout.val_kwrags.n=8",  # a typo: an override, named by the config load with a hint
        "actor_rollout_ref.rollout.n=8",  # verl's key: an override (the load says ours)
    ]
    data, overrides = split_inputs(args)
    assert data == ["split=test.parquet", "gsm8k,v2.parquet", "data/missing=1.parquet"]
    assert overrides == ["rollout.val_kwargs.n=8", "rollout.val_kwrags.n=8", "actor_rollout_ref.rollout.n=8"]
    Path("model.path=x").write_text("")  # a key of the config stays an override, file or not
    assert split_inputs(["model.path=x"]) == ([], ["model.path=x"])


def test_missing_or_folder_data_is_named_as_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from mcore_rl.cli import main

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_hf_config("llama", max_position_embeddings=1024)))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for data, why in (("runs/tst.parquet", "does not exist"), ("runs", "is a folder, not a data file")):
        assert main(["eval", "m", data, "--in-process"]) == 1
        err = capsys.readouterr().err
        assert err == f"mcore-rl eval: error: DATA {data} {why}\n"  # was data.train_files: ... does not exist
