"""Signals, kills and concurrent writers, each in real subprocesses running ``mcore_rl.cli.main``.

The writer (tests/io/slow_writer.py) goes through :class:`~mcore_rl.io.output.OutputFolder` exactly as the
conversions and checkpoints do; it imports no torch, so each process starts in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mcore_rl.io.errors import OutputError
from mcore_rl.io.output import OutputFolder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    command = [sys.executable, "-m", "tests.io.slow_writer", "slow-write", *args]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _staging(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("staging "), (line, proc.stderr.read() if proc.stderr else "")
    return line.split(" ", 1)[1].strip()


def _write(out: str, payload: str, overwrite: bool = False) -> None:
    """One complete write, in this process."""
    output = OutputFolder.plan(out, overwrite=overwrite, kind="test")
    staging = output.begin()
    with open(os.path.join(staging, "payload.txt"), "w") as f:
        f.write(payload)
    output.commit()


def _payload(out: str) -> str:
    with open(os.path.join(out, "payload.txt")) as f:
        return f.read()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_removes_the_staging_folder_and_exits_with_one_line(tmp_path, signum):
    proc = _start("--out", str(tmp_path / "out"), "--hold-s", "60")
    staging = _staging(proc)
    assert os.path.isdir(staging)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum
    assert err.strip().splitlines() == [
        f"mcore-rl slow-write: interrupted by {signum.name}; partial output removed"
    ]
    assert os.listdir(tmp_path) == []


def test_a_killed_writers_staging_is_removed_by_the_next_run(tmp_path, capsys):
    out = str(tmp_path / "out")
    proc = _start("--out", out, "--hold-s", "60")
    staging = _staging(proc)
    proc.kill()
    proc.communicate(timeout=30)
    assert os.path.isdir(staging)  # SIGKILL cannot be handled: the next run cleans up
    (tmp_path / ".out.mcore_rl-staging-1-0000000").mkdir()  # not ours (name off by a digit): kept
    _write(out, "next")
    assert "partial output left by process" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == [".out.mcore_rl-staging-1-0000000", "out"]
    assert _payload(out) == "next"


def test_a_kill_between_the_two_renames_restores_the_previous_output(tmp_path, capsys):
    out = str(tmp_path / "out")
    _write(out, "old")
    proc = _start("--out", out, "--payload", "new", "--overwrite", "--die-mid-commit")
    proc.communicate(timeout=30)
    assert proc.returncode == 9 and not os.path.exists(out)  # moved aside, the new one not yet in place
    output = OutputFolder.plan(out, overwrite=True, kind="test")
    output.clean_stale()
    assert "restored" in capsys.readouterr().err
    assert _payload(out) == "old" and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("rules", [{"replace_ours": True}, {"overwrite": True}])
def test_the_write_after_a_kill_between_the_two_renames_replaces_the_output_it_put_back(
    tmp_path, capsys, rules
):
    """The next save of a run checkpoint after such a kill: planned while the folder was away, it finds the
    previous output restored by its own begin() and replaces it (it used to fail its commit with "created by
    another process")."""
    out = str(tmp_path / "out")
    _write(out, "old")
    proc = _start("--out", out, "--payload", "new", "--overwrite", "--die-mid-commit")
    proc.communicate(timeout=30)
    assert proc.returncode == 9 and not os.path.exists(out)
    output = OutputFolder.plan(out, kind="test", **rules)
    with open(os.path.join(output.begin(), "payload.txt"), "w") as f:
        f.write("newer")
    output.commit()
    assert "restored" in capsys.readouterr().err
    assert _payload(out) == "newer" and sorted(os.listdir(tmp_path)) == ["out"]


def test_the_folder_a_kill_left_aside_is_put_back_and_kept_without_leave_to_replace_it(tmp_path):
    out = str(tmp_path / "out")
    _write(out, "old")
    proc = _start("--out", out, "--payload", "new", "--overwrite", "--die-mid-commit")
    proc.communicate(timeout=30)
    output = OutputFolder.plan(out, kind="test")  # no --overwrite: the restored output is not ours to replace
    with pytest.raises(OutputError, match="exists and is not empty"):
        output.begin()
    assert _payload(out) == "old"


def test_two_writers_to_one_new_folder_one_wins_the_other_fails(tmp_path):
    out, go = str(tmp_path / "parent" / "out"), str(tmp_path / "go")
    (tmp_path / "parent").mkdir()
    procs = [_start("--out", out, "--payload", name, "--go", go) for name in ("a", "b")]
    for proc in procs:
        _staging(proc)  # both have checked --out (absent) and are writing
    open(go, "w").close()
    results = [(proc.wait(timeout=30), proc.communicate()[1]) for proc in procs]
    codes = [code for code, _ in results]
    assert sorted(codes) == [0, 1], results
    loser_err = results[codes.index(1)][1].strip().splitlines()
    assert len(loser_err) == 1 and "was created by another process while this one ran" in loser_err[0]
    assert _payload(out) == "ab"[codes.index(0)]  # the winner's output, untouched by the loser
    assert os.listdir(tmp_path / "parent") == ["out"]
