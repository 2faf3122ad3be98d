"""CLI options beyond the defaults: output dtype, shard size, ``python -m mcore_rl.convert``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from mcore_rl.cli import main


def test_mcore_to_hf_casts_dtype_and_cuts_shards(ckpt, hf_sharded, tmp_path):
    out = tmp_path / "bf16"
    args = [
        "convert",
        "mcore-to-hf",
        "--ckpt",
        ckpt,
        "--out",
        str(out),
        "--dtype",
        "bf16",
        "--max-shard-size",
        "50KB",
    ]
    assert main(args) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.getsize(out / f) < 50_000 + 40_000 for f in files)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    original: dict[str, torch.Tensor] = {}
    for f in os.listdir(hf_sharded):
        if f.endswith(".safetensors"):
            original.update(load_file(os.path.join(hf_sharded, f)))
    for f in files:
        for name, tensor in load_file(str(out / f)).items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, original[name].to(torch.bfloat16))


def test_python_dash_m_entry_point(hf_sharded, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-m", "mcore_rl.convert", "mcore-to-hf", "--help"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "--hf-config-from" in done.stdout
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_rl.convert",
            "hf-to-mcore",
            "--hf-dir",
            hf_sharded,
            "--out",
            str(tmp_path / "o"),
            "--tp",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert (
        done.returncode == 1
        and "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3" in done.stderr
    )


def test_each_direction_says_how_to_use_what_it_wrote(ckpt, hf_sharded, tmp_path, capsys):
    capsys.readouterr()
    out = str(tmp_path / "mcore")
    assert main(["convert", "hf-to-mcore", "--hf-dir", hf_sharded, "--out", out]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {out}",
        f"use it: mcore-rl train RECIPE model.path={out} (each rank reads only its own shards)",
    ]
    hf = str(tmp_path / "hf")
    assert main(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", hf]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"use it: mcore-rl eval {hf} DATA")
