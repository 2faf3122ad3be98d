"""Run folders (logs, run checkpoints, the resolved config): claimed before a run, never over what is not ours."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.config.run_folder import (
    check_run_folders,
    checkpoint_root,
    claim_run_folders,
    publish_checkpoint,
    resume_checkpoint,
)
from mcore_rl.io.errors import OutputError
from mcore_rl.io.output import MARKER_FILE, OutputFolder, claim_run_folder, is_ours


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (by relative path)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_new_folder_is_claimed_and_a_second_run_continues_it(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "exp1"  # parents are created, as users expect of a run folder
    assert claim_run_folder(str(run), flag="trainer.default_local_dir") == str(run)
    assert is_ours(str(run)) and (run / MARKER_FILE).is_file()
    (run / "metrics.jsonl").write_text("{}\n")
    assert claim_run_folder(str(run), flag="trainer.default_local_dir") == str(run)  # resume: ours


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("", "trainer.default_local_dir is empty"),
        (".", "is the current directory"),
        ("~", "is your home folder"),
        ("/", "is the filesystem root"),
        ("parent_of_cwd", "contains the current directory"),
        ("foreign", "exists and was not written by mcore_rl"),
        ("data/inside", "is inside the input"),
        ("data", "is the input"),
        ("a_file", "exists and is not a folder"),
        ("a_link", "is a symbolic link"),
    ],
)
def test_refusals_leave_every_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, message: str
) -> None:
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.parquet").write_bytes(b"rows")
    (work / "foreign").mkdir()
    (work / "foreign" / "weeks_of_training.pt").write_bytes(b"precious")
    (work / "a_file").write_text("mine")
    (work / "a_link").symlink_to(work / "foreign")
    (work / "cwd").mkdir()
    monkeypatch.chdir(work / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    given = {"~": str(tmp_path / "home"), "parent_of_cwd": str(work), "": "", ".": ".", "/": "/"}.get(
        where, str(work / where)
    )
    before = _snapshot(tmp_path)
    with pytest.raises(OutputError, match=message) as err:
        claim_run_folder(given, flag="trainer.default_local_dir", inputs=[str(work / "data")])
    assert "\n" not in str(err.value) and "trainer.default_local_dir" in str(err.value)
    assert _snapshot(tmp_path) == before


def _cfg(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return load_config(
        "recipes/demo_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"data.train_files=[{tmp_path / 'd' / 't.parquet'}]",
            *list(overrides),
        ],
    )


def test_config_claims_the_run_and_an_outside_log_folder(tmp_path: Path) -> None:
    foreign_logs = tmp_path / "logs"
    foreign_logs.mkdir()
    (foreign_logs / "metrics.jsonl").write_text("a user's log\n")
    with pytest.raises(OutputError, match=r"logging.log_dir .* not written by mcore_rl"):
        claim_run_folders(_cfg(tmp_path, f"logging.log_dir={foreign_logs}"))
    assert (foreign_logs / "metrics.jsonl").read_text() == "a user's log\n"
    claim_run_folders(_cfg(tmp_path))  # logs inside the run folder: claimed with it
    with pytest.raises(OutputError, match=r"contains the input"):
        claim_run_folders(_cfg(tmp_path, f"trainer.default_local_dir={tmp_path}"))


def test_keep_last_k_removes_only_our_checkpoints(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "trainer.max_ckpt_to_keep=1")
    claim_run_folders(cfg)
    root = Path(checkpoint_root(cfg))
    root.mkdir()
    (root / "global_step_1").mkdir()  # a user's own folder with our naming: kept
    (root / "global_step_1" / "notes.txt").write_text("mine")
    for step in (2, 3):  # ours: written through OutputFolder, so they carry the marker
        out = OutputFolder.plan(str(root / f"global_step_{step}"), kind="checkpoint")
        out.begin()
        out.commit()
    publish_checkpoint(cfg, 3)
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_3", "latest"]
    assert (root / "global_step_1" / "notes.txt").read_text() == "mine"
    assert resume_checkpoint(cfg) == str(root / "global_step_3")
    assert resume_checkpoint(_cfg(tmp_path, "trainer.resume_mode=disable")) is None


def test_keep_last_k_never_drops_the_save_just_published_nor_a_later_one(tmp_path: Path) -> None:
    """A run resumed from step 10 while an older attempt's step 20 is still there (resume_path, or auto falling
    back past a damaged save): its step-11 save is kept with keep=1, step 20 is left, steps before 11 go."""
    cfg = _cfg(tmp_path, "trainer.max_ckpt_to_keep=2")
    claim_run_folders(cfg)
    root = Path(checkpoint_root(cfg))
    root.mkdir()
    for step in (5, 10, 20, 11):
        out = OutputFolder.plan(str(root / f"global_step_{step}"), kind="checkpoint")
        out.begin()
        out.commit()
    publish_checkpoint(cfg, 11)  # keep 2: step 11 and the newest before it
    assert sorted(os.listdir(root)) == ["global_step_10", "global_step_11", "global_step_20", "latest"]
    publish_checkpoint(_cfg(tmp_path, "trainer.max_ckpt_to_keep=1"), 11)
    assert sorted(os.listdir(root)) == ["global_step_11", "global_step_20", "latest"]
    assert resume_checkpoint(cfg) == str(root / "global_step_11")


def test_an_old_checkpoint_that_will_not_go_is_a_note_not_a_failed_save(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """On NFS a folder another job still reads cannot be removed (EBUSY), nor one holding a file we may not
    delete (EACCES): the save before it succeeded and ``latest`` names it, so the cleanup says so and goes on
    (it used to raise from inside the save, which reported the published checkpoint as not saved)."""
    import errno
    import shutil

    import mcore_rl.config.run_folder as run_folder

    cfg = _cfg(tmp_path, "trainer.max_ckpt_to_keep=1")
    claim_run_folders(cfg)
    root = Path(checkpoint_root(cfg))
    root.mkdir()
    for step in (1, 2, 3):
        out = OutputFolder.plan(str(root / f"global_step_{step}"), kind="checkpoint")
        out.begin()
        out.commit()
    rmtree = shutil.rmtree

    def busy_step_1(path, *args, **kwargs):
        if os.path.basename(path) == "global_step_1":
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(run_folder.shutil, "rmtree", busy_step_1)
    publish_checkpoint(cfg, 3)
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_3", "latest"]
    assert resume_checkpoint(cfg) == str(root / "global_step_3")
    assert "global_step_1 not removed (trainer.max_ckpt_to_keep=1)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["trainer.resume_mode=disable"], "trainer.resume_mode=disable"),
        ([], "finds no `latest` there"),  # auto, `latest` gone
        (
            ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/elsewhere/global_step_4"],
            "not one of",
        ),
    ],
)
def test_a_fresh_run_is_refused_over_an_earlier_runs_checkpoints_wherever_it_logs(
    tmp_path: Path, overrides: list[str], why: str
) -> None:
    """The earlier run logged elsewhere (or without metrics.jsonl), so no log check catches it: a run that
    does not start from one of this folder's checkpoints would save its own global_step_N over them."""
    cfg = _cfg(tmp_path, f"logging.log_dir={tmp_path / 'other_logs'}", *overrides)
    claim_run_folders(_cfg(tmp_path))
    root = Path(checkpoint_root(cfg))
    root.mkdir()
    for step in (2, 10):
        out = OutputFolder.plan(str(root / f"global_step_{step}"), kind="checkpoint")
        out.begin()
        out.commit()
    with pytest.raises(
        OutputError, match=rf"global_step_2, global_step_10\), which a new run would replace .*{why}"
    ):
        check_run_folders(cfg)
    publish_checkpoint(
        cfg, 10
    )  # `latest` names step 10: auto continues it, and resume_path may start at step 2
    check_run_folders(_cfg(tmp_path, f"logging.log_dir={tmp_path / 'other_logs'}"))
    check_run_folders(
        _cfg(
            tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={root / 'global_step_2'}"
        )
    )


def test_a_save_removes_what_killed_saves_of_other_steps_left(tmp_path: Path) -> None:
    """A run killed while saving step 3 and resumed from an earlier checkpoint may never save step 3 again:
    the next save of any step removes that staging folder (a whole checkpoint's bytes), naming it."""
    import json
    import subprocess
    import sys

    from mcore_rl.trainer.run_checkpoint import staged_checkpoint

    cfg = _cfg(tmp_path)
    claim_run_folders(cfg)
    root = Path(checkpoint_root(cfg))
    root.mkdir()
    killed = OutputFolder.plan(str(root / "global_step_3"), replace_ours=True, kind="run-checkpoint")
    staging = Path(killed.begin())
    (staging / "shard.distcp").write_bytes(b"x" * 1000)
    marker = json.loads((staging / MARKER_FILE).read_text())
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (staging / MARKER_FILE).write_text(json.dumps({**marker, "pid": int(gone.stdout)}))  # its writer is gone
    with staged_checkpoint(cfg, 5, str(root / "global_step_5")) as folder:
        Path(folder, "weights").write_text("5")
    assert sorted(os.listdir(root)) == ["global_step_5", "latest"]
