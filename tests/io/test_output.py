"""OutputFolder in one process: the order of fsync and rename, a folder replaced meanwhile, what counts as
ours, long names; and input files that may not lead outside their folder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from unittest import mock

import pytest

from mcore_rl.io import output as output_module
from mcore_rl.io.errors import InputError, OutputError, UnsafeInputError
from mcore_rl.io.inputs import copy_input_file, input_file
from mcore_rl.io.output import MARKER_FILE, OutputFolder


def _write(out: str, payload: str, **plan) -> OutputFolder:
    output = OutputFolder.plan(out, kind="test", **plan)
    staging = output.begin()
    with open(os.path.join(staging, "payload.txt"), "w") as f:
        f.write(payload)
    output.commit()
    return output


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_every_file_is_fsynced_before_the_rename_that_publishes_it(tmp_path):
    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    with (
        mock.patch.object(output_module.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1]),
        mock.patch.object(
            output_module.os, "rename", lambda a, b: (events.append("rename"), real_rename(a, b))[1]
        ),
    ):
        _write(str(tmp_path / "out"), "x")
    # payload + marker + the staging folder, then the rename, then the parent folder.
    assert events == ["fsync", "fsync", "fsync", "rename", "fsync"]


def test_a_folder_replaced_while_we_wrote_is_left_alone(tmp_path):
    out = str(tmp_path / "out")
    _write(out, "first")
    output = OutputFolder.plan(out, overwrite=True, kind="test")
    output.begin()
    os.rename(out, str(tmp_path / "moved"))  # someone else swaps in their own folder meanwhile
    _write(out, "theirs", overwrite=True)
    with pytest.raises(OutputError, match="replaced by another process"):
        output.commit()
    output.abort()
    with open(os.path.join(out, "payload.txt")) as f:
        assert f.read() == "theirs"
    assert sorted(os.listdir(tmp_path)) == ["moved", "out"]


def test_only_provably_ours_is_ever_removed(tmp_path, capsys):
    out = str(tmp_path / "out")
    parent = str(tmp_path)

    def staging_like(pid: int, host: str, target: str = os.path.realpath(out)) -> str:
        folder = os.path.join(parent, f".out.mcore_rl-staging-{pid}-{os.urandom(4).hex()}")
        os.mkdir(folder)
        with open(os.path.join(folder, MARKER_FILE), "w") as f:
            json.dump({"tool": "mcore_rl", "target": target, "pid": pid, "host": host}, f)
        return folder

    kept = [
        staging_like(os.getpid(), socket.gethostname()),  # a live writer
        staging_like(_dead_pid(), "another-host"),  # a shared filesystem: its pid means nothing here
        staging_like(_dead_pid(), socket.gethostname(), target="/elsewhere"),  # another target
        os.path.join(parent, ".out.mcore_rl-old-1-abcdef12"),  # named like ours, no marker names it
    ]
    os.mkdir(kept[-1])
    removed = staging_like(_dead_pid(), socket.gethostname())
    _write(out, "x")
    assert all(os.path.isdir(k) for k in kept) and not os.path.exists(removed)
    assert capsys.readouterr().err.count("note: removed") == 1


def test_a_name_at_the_filesystem_limit_still_stages(tmp_path):
    out = str(tmp_path / ("n" * 250))
    _write(out, "x")
    assert sorted(os.listdir(tmp_path)) == ["n" * 250]


def test_input_files_stay_inside_their_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret").write_text("key")
    (folder / "tokenizer.json").symlink_to(tmp_path / "secret")
    (folder / "vocab.json").write_text("{}")
    (folder / "merges.txt").symlink_to(folder / "vocab.json")  # a link inside the folder is fine
    with pytest.raises(UnsafeInputError, match=r"tokenizer\.json is a symbolic link to .*secret, outside"):
        input_file(str(folder), "tokenizer.json")
    assert input_file(str(folder), "merges.txt") == str(folder / "merges.txt")
    assert input_file(str(folder), "absent.json", required=False) is None
    with pytest.raises(InputError, match="no such file"):
        input_file(str(folder), "absent.json")
    assert copy_input_file(str(folder), "merges.txt", str(tmp_path / "out"))
    assert not os.path.islink(tmp_path / "out" / "merges.txt")  # copied as a regular file


def test_a_hub_cache_snapshot_may_link_into_its_own_blobs(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text("{}")
    (snapshot / "config.json").symlink_to("../../blobs/f00d")
    (tmp_path / "elsewhere").write_text("x")
    (snapshot / "tokenizer.json").symlink_to(tmp_path / "elsewhere")
    assert input_file(str(snapshot), "config.json") == str(snapshot / "config.json")
    with pytest.raises(UnsafeInputError):
        input_file(str(snapshot), "tokenizer.json")
