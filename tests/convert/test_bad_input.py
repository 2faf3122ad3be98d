"""Bad input fails with one clear error naming the file or field, a non-zero exit, and no output left.

Every case goes through ``mcore_rl.cli.main``. "No output" means the parent of ``--out`` lists exactly
what it listed before (no ``--out``, no hidden temporary folder).
"""

from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import pytest

from mcore_rl.cli import main
from mcore_rl.convert.dcp_io import DistCheckpointReader
from mcore_rl.convert.mapping import ConvertError
from mcore_rl.convert.safetensors_io import SafetensorsReader
from tests.convert.hf_models import save_hf_model


def _fails(capsys, args: list[str], *needles: str) -> str:
    """Run the CLI, expect exit 1 and an error message containing every needle; returns the message."""
    parent = os.path.dirname(args[args.index("--out") + 1])
    before = sorted(os.listdir(parent))
    assert main(["convert", *args]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert sorted(os.listdir(parent)) == before, "output or temporary folder left behind"
    return err


def _copy(source: str, destination) -> str:
    shutil.copytree(source, destination)
    return str(destination)


def _edit_config(hf_dir: str, **changes) -> None:
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **changes}, f)


def test_missing_shard(capsys, hf_sharded, tmp_path):
    hf = _copy(hf_sharded, tmp_path / "hf")
    shard = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(hf, shard))
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], shard, "missing")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_shard(capsys, hf_sharded, tmp_path, damage):
    hf = _copy(hf_sharded, tmp_path / "hf")
    shard = os.path.join(hf, sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))[0])
    if damage == "garbage":
        with open(shard, "wb") as f:
            f.write(b"\xff" * 64)
    else:
        os.truncate(shard, os.path.getsize(shard) - 1000)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], shard, "corrupt")


def test_config_and_weights_disagree(capsys, hf_sharded, tmp_path):
    hf = _copy(hf_sharded, tmp_path / "hf")
    _edit_config(hf, intermediate_size=128)
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
        "mlp.gate_proj.weight has shape [96, 64]",
        "intermediate_size=128",
        "config.json",
    )


def test_extra_layers_in_weights(capsys, hf_sharded, tmp_path):
    hf = _copy(hf_sharded, tmp_path / "hf")
    _edit_config(hf, num_hidden_layers=2)
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
        "model.layers.2.",
        "num_hidden_layers=2",
    )


def test_unknown_architecture_lists_supported(capsys, hf_sharded, tmp_path):
    hf = _copy(hf_sharded, tmp_path / "hf")
    _edit_config(hf, architectures=["GPT2LMHeadModel"])
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
    )


def test_missing_config(capsys, tmp_path):
    (tmp_path / "hf").mkdir()
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "out")],
        "config.json",
    )


def test_wrong_dtype_name(capsys, hf_sharded, tmp_path):
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", hf_sharded, "--out", str(tmp_path / "out"), "--dtype", "fp16"],
        "--dtype",
    )


def test_tp_not_dividing_heads(capsys, hf_sharded, tmp_path):
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", hf_sharded, "--out", str(tmp_path / "out"), "--tp", "3"],
        "num_attention_heads=4",
        "tensor_parallel_size=3",
    )


def test_existing_output_needs_overwrite_and_input_is_never_replaced(capsys, hf_sharded, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf_sharded, "--out", str(tmp_path / "out")], "--overwrite")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    before = sorted(os.listdir(hf_sharded))
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", hf_sharded, "--out", hf_sharded, "--overwrite"],
        "is (or contains) the input",
    )
    _fails(
        capsys,
        ["hf-to-mcore", "--hf-dir", hf_sharded, "--out", os.path.dirname(hf_sharded), "--overwrite"],
        "is (or contains) the input",
    )
    assert sorted(os.listdir(hf_sharded)) == before


def test_mcore_to_hf_bad_inputs(capsys, ckpt, hf_sharded, tmp_path):
    out = str(tmp_path / "out")
    _fails(capsys, ["mcore-to-hf", "--ckpt", hf_sharded, "--out", out], "metadata.json", "not a megatron")
    bare = _copy(ckpt, tmp_path / "bare")
    os.remove(os.path.join(bare, "mcore_rl_model.json"))
    _fails(capsys, ["mcore-to-hf", "--ckpt", bare, "--out", out], "--hf-config-from")
    other = save_hf_model(str(tmp_path / "wide"), "llama", hidden_size=128)
    _fails(
        capsys,
        ["mcore-to-hf", "--ckpt", bare, "--out", out, "--hf-config-from", other],
        "embedding.word_embeddings.weight has shape [256, 64]",
    )
    _fails(
        capsys, ["mcore-to-hf", "--ckpt", ckpt, "--out", out, "--max-shard-size", "big"], "--max-shard-size"
    )
    # A checkpoint written by someone else converts with the config given explicitly.
    assert main(["convert", "mcore-to-hf", "--ckpt", bare, "--out", out, "--hf-config-from", hf_sharded]) == 0


def test_mcore_to_hf_overwrite(capsys, ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    _fails(capsys, ["mcore-to-hf", "--ckpt", ckpt, "--out", str(out)], "not empty", "--overwrite")
    assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", str(out), "--overwrite"]) == 0
    assert "config.json" in os.listdir(out) and "old.txt" not in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    _fails(
        capsys, ["mcore-to-hf", "--ckpt", ckpt, "--out", ckpt, "--overwrite"], "is (or contains) the input"
    )


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
        _fails(
            capsys, ["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "out")], "simulated read failure"
        )


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
