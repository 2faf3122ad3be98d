"""Failure paths besides the bad-input table: failures midway on one rank or another, unexpected errors,
--debug, --overwrite, launcher variables left in the shell, NaN weights allowed by flag."""

from __future__ import annotations

import os
import shutil
from unittest import mock

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.convert.dcp_io import DistCheckpointReader
from mcore_rl.engine.hf.mapping import ConvertError
from mcore_rl.engine.hf.safetensors_io import SafetensorsReader, StreamingShardWriter
from tests.convert.bad_inputs import Workspace, nan_weight
from tests.convert.hf_models import save_hf_model


@pytest.fixture
def workspace(tmp_path, hf_sharded, ckpt) -> Workspace:
    return Workspace(str(tmp_path / "ws"), hf_sharded, ckpt)


def test_nonfinite_weights_are_refused_or_converted_with_a_warning(workspace: Workspace, capsys):
    from mcore_rl.convert.hf_to_mcore import _ChunkSource
    from mcore_rl.engine.arch import ModelArch
    from mcore_rl.engine.hf.mapping import tensor_maps

    nan_weight(workspace)
    arch = ModelArch.from_hf_config(workspace.hf)
    reader = SafetensorsReader(workspace.hf)
    for allow in (False, True):
        source = _ChunkSource(arch, reader, torch.float32, allow_nonfinite=allow)
        sources = [source.full(m.full_name) for m in tensor_maps(arch)] if allow else None
        if not allow:
            with pytest.raises(ConvertError, match="NaN/Inf"):
                for m in tensor_maps(arch):
                    source.full(m.full_name)
    assert sources is not None and any(bool(t.isnan().any()) for t in sources)
    assert "warning:" in capsys.readouterr().err


def test_overwrite_replaces_ours_and_a_users_folder(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", str(out), "--overwrite"]) == 0
    assert "config.json" in os.listdir(out) and "old.txt" not in os.listdir(out)
    assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging or previous copy left behind
    # An empty folder made beforehand is fine without --overwrite.
    (tmp_path / "empty").mkdir()
    assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "empty")]) == 0


def test_stale_launcher_variables_are_ignored_with_a_note(ckpt, tmp_path, capsys, monkeypatch):
    """The issue's "exit 0 having written nothing": RANK=3 left in the shell of a single process."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "out")]) == 0
    assert os.path.isfile(tmp_path / "out" / "config.json")


def test_debug_shows_the_traceback(hf_sharded, tmp_path, capsys):
    assert main(["--debug", "convert", "hf-to-mcore", "--hf-dir", hf_sharded, "--out", ""]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith(
        "mcore-rl convert: error: --out is empty"
    )


def test_unexpected_failure_is_one_line_naming_its_type(ckpt, tmp_path, capsys):
    with mock.patch.object(StreamingShardWriter, "finish", side_effect=RuntimeError("boom")):
        assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1] == "mcore-rl convert: internal error: RuntimeError: boom (run with --debug for the traceback)"
    )
    assert os.listdir(tmp_path) == []


def _failing_after(calls: int, original):
    count = {"n": 0}

    def wrapper(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise ConvertError(f"{getattr(self, 'directory', '?')}: simulated read failure")
        return original(self, *args, **kwargs)

    return wrapper


def test_mcore_to_hf_failure_midway_leaves_nothing(capsys, ckpt, tmp_path):
    with mock.patch.object(DistCheckpointReader, "read", _failing_after(5, DistCheckpointReader.read)):
        assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "out")]) == 1
    assert "simulated read failure" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def _hf_to_mcore_failing_midway(hf_dir: str, out: str) -> tuple[int, list[str]]:
    import torch.distributed as dist

    # Only rank 1 fails, after a few tensors: every rank must still report the error and clean up.
    calls = 4 if dist.get_rank() == 1 else 10**6
    with mock.patch.object(SafetensorsReader, "get", _failing_after(calls, SafetensorsReader.get)):
        code = main(["convert", "hf-to-mcore", "--hf-dir", hf_dir, "--out", out, "--tp", "2"])
    dist.barrier()
    return code, sorted(os.listdir(os.path.dirname(out)))


def test_hf_to_mcore_failure_midway_leaves_nothing(run_distributed, hf_sharded, tmp_path):
    (tmp_path / "parent").mkdir()
    results = run_distributed(_hf_to_mcore_failing_midway, hf_sharded, str(tmp_path / "parent" / "out"))
    assert results == [(1, []), (1, [])]


def test_a_model_made_elsewhere_converts_with_its_config(ckpt, hf_sharded, tmp_path):
    bare = shutil.copytree(ckpt, tmp_path / "bare")
    os.remove(bare / "mcore_rl_model.json")
    other = save_hf_model(str(tmp_path / "wide"), "llama", hidden_size=128)
    out = str(tmp_path / "out")
    assert main(["convert", "mcore-to-hf", "--ckpt", str(bare), "--out", out, "--hf-config-from", other]) == 1
    assert main(["convert", "mcore-to-hf", "--ckpt", str(bare), "--out", out]) == 1
    assert (
        main(["convert", "mcore-to-hf", "--ckpt", str(bare), "--out", out, "--hf-config-from", hf_sharded])
        == 0
    )


_SLOW_CONVERSION = """
import sys, time
from mcore_rl.cli import main
from mcore_rl.engine.hf import safetensors_io

add = safetensors_io.StreamingShardWriter.add

def slow_add(self, name, tensor):  # a big model: each tensor takes a while
    add(self, name, tensor)
    print("wrote", name, flush=True)
    time.sleep(60)

safetensors_io.StreamingShardWriter.add = slow_add
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_a_real_conversion_leaves_nothing(ckpt, tmp_path):
    """The issue's hidden staging folders after SIGTERM: mcore-to-hf killed after its first tensor."""
    import signal
    import subprocess
    import sys

    out = str(tmp_path / "out")
    command = [sys.executable, "-c", _SLOW_CONVERSION, "convert", "mcore-to-hf", "--ckpt", ckpt, "--out", out]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("wrote ")
    assert len(os.listdir(tmp_path)) == 1  # the staging folder, with a shard being written
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "mcore-rl convert: interrupted by SIGTERM; partial output removed"
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_without_tokenizer_files_converts_and_says_so(ckpt, hf_sharded, tmp_path, capsys):
    """A run checkpoint holds weights only: the HF folder is written, and one note names what is missing and
    the flag that brings it (found by a new user: the folder silently had no tokenizer)."""
    from mcore_rl.engine.checkpoint import HF_ASSETS_DIR

    weights_only = shutil.copytree(ckpt, tmp_path / "weights_only")
    shutil.rmtree(weights_only / HF_ASSETS_DIR, ignore_errors=True)
    out = tmp_path / "out"
    assert main(["convert", "mcore-to-hf", "--ckpt", str(weights_only), "--out", str(out)]) == 0
    assert "has no tokenizer" in capsys.readouterr().err and not (out / "tokenizer.json").exists()
    from tests.convert.hf_models import save_word_tokenizer

    model = shutil.copytree(hf_sharded, tmp_path / "model_with_tokenizer")
    save_word_tokenizer(str(model))
    again = tmp_path / "again"
    assert main(["convert", "mcore-to-hf", "--ckpt", str(weights_only), "--out", str(again),
                 "--hf-config-from", str(model)]) == 0  # fmt: skip
    assert "has no tokenizer" not in capsys.readouterr().err and (again / "tokenizer.json").exists()
