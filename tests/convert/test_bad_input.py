"""Bad input, table-driven: each case ends in one error line naming the item, the documented exit code, and
every file that existed before byte-identical afterwards (nothing added, nothing removed, nothing changed).

Cases run ``mcore_rl.cli.main`` in-process inside a scratch workspace (``ws``: copies of a tiny HF model
and of its converted checkpoint, a HOME and a working directory of its own). The classes: output safety,
untrusted checkpoints, config.json and our metadata files, weights, flags, launcher environment, demo flags.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

from mcore_rl.cli import main
from mcore_rl.convert.dcp_io import DistCheckpointReader
from mcore_rl.convert.mapping import ConvertError
from mcore_rl.convert.safetensors_io import SafetensorsReader, StreamingShardWriter
from tests.convert.hf_models import save_hf_model


class Workspace:
    """A scratch folder with lazily made copies of the HF model and checkpoint; cwd and HOME inside it."""

    def __init__(self, root: str, hf_source: str, ckpt_source: str) -> None:
        self.root = root
        self._sources = {"hf": hf_source, "ck": ckpt_source}
        os.makedirs(self.p("cwd", "home"), exist_ok=True)
        os.makedirs(self.p("home"), exist_ok=True)

    def p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def copy(self, name: str) -> str:
        path = self.p(name)
        if not os.path.exists(path):
            shutil.copytree(self._sources[name], path, symlinks=True)
        return path

    @property
    def hf(self) -> str:
        return self.copy("hf")

    @property
    def ck(self) -> str:
        return self.copy("ck")

    def inside(self, relative: str) -> str:
        """``root/relative``, the copy it lies in made first (``hf/...``, ``ck/...``)."""
        top = relative.split("/")[0]
        if top in self._sources:
            self.copy(top)
        return self.p(relative)

    def write(self, relative: str, data: bytes | str) -> str:
        path = self.inside(relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        return path

    def edit_json(self, relative: str, **changes: object) -> None:
        path = self.inside(relative)
        with open(path) as f:
            data = json.load(f)
        data.update(changes)
        with open(path, "w") as f:
            json.dump(data, f)

    def secret(self) -> str:
        return self.write("secret/id_rsa", "PRIVATE KEY")


def snapshot(root: str) -> dict[str, str]:
    """Every entry under ``root``: file -> sha256 of its bytes, link -> its target, folder -> 'dir'."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            key = os.path.relpath(path, root)
            if os.path.islink(path):
                entries[key] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                entries[key] = "dir"
            else:
                with open(path, "rb") as f:
                    entries[key] = hashlib.sha256(f.read()).hexdigest()
    return entries


# --- case builders: each takes the workspace and returns the CLI arguments (after "convert") -----------------


def to_mcore(ws: Workspace, *extra: str, out: str | None = None) -> list[str]:
    return ["convert", "hf-to-mcore", "--hf-dir", ws.hf, "--out", ws.p("out") if out is None else out, *extra]


def to_hf(ws: Workspace, *extra: str, out: str | None = None) -> list[str]:
    return ["convert", "mcore-to-hf", "--ckpt", ws.ck, "--out", ws.p("out") if out is None else out, *extra]


def config(**changes: object) -> Callable[[Workspace], list[str]]:
    def build(ws: Workspace) -> list[str]:
        ws.edit_json("hf/config.json", **{"architectures": ["LlamaForCausalLM"], **changes})
        return to_mcore(ws)

    return build


def config_without(key: str) -> Callable[[Workspace], list[str]]:
    def build(ws: Workspace) -> list[str]:
        data = json.loads(Path(ws.hf, "config.json").read_text())
        del data[key]
        ws.write("hf/config.json", json.dumps(data))
        return to_mcore(ws)

    return build


def model_info(**changes: object) -> Callable[[Workspace], list[str]]:
    def build(ws: Workspace) -> list[str]:
        ws.edit_json("ck/mcore_rl_model.json", **changes)
        return to_hf(ws)

    return build


def hf_config_field(**changes: object) -> Callable[[Workspace], list[str]]:
    def build(ws: Workspace) -> list[str]:
        data = json.loads(Path(ws.ck, "mcore_rl_model.json").read_text())
        data["hf_config"].update(changes)
        ws.write("ck/mcore_rl_model.json", json.dumps(data))
        return to_hf(ws)

    return build


class _RunsCode:
    """A pickle that, when loaded, creates the file ``ran`` (proof that code ran)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted_metadata(ws: Workspace) -> list[str]:
    ws.write("ck/.metadata", pickle.dumps(_RunsCode(ws.p("ran"))))
    return to_hf(ws)


def crafted_eval(ws: Workspace) -> list[str]:
    class Eval:
        def __reduce__(self):
            return (eval, ("__import__('os').system('touch ran')",))

    ws.write("ck/.metadata", pickle.dumps(Eval()))
    return to_hf(ws)


def metadata_escaping_storage(ws: Workspace) -> list[str]:
    import dataclasses

    from mcore_rl.io.checkpoint_read import read_dcp_metadata

    metadata = read_dcp_metadata(ws.ck)
    metadata.storage_data = {
        k: dataclasses.replace(v, relative_path="../secret/id_rsa") for k, v in metadata.storage_data.items()
    }
    ws.secret()
    ws.write("ck/.metadata", pickle.dumps(metadata))
    return to_hf(ws)


def link(ws: Workspace, relative: str, target: str) -> None:
    path = ws.inside(relative)
    if os.path.lexists(path):
        os.remove(path) if not os.path.isdir(path) or os.path.islink(path) else shutil.rmtree(path)
    os.symlink(target, path)


def side_file_link(ws: Workspace) -> list[str]:
    os.makedirs(os.path.join(ws.ck, "hf_assets"), exist_ok=True)
    link(ws, "ck/hf_assets/tokenizer.json", ws.secret())
    return to_hf(ws)


def first_shard(ws: Workspace) -> str:
    return sorted(f for f in os.listdir(ws.hf) if f.endswith(".safetensors"))[0]


def nan_weight(ws: Workspace) -> list[str]:
    from safetensors.torch import load_file, save_file

    shard = os.path.join(ws.hf, first_shard(ws))
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return to_mcore(ws)


def float64_weights(ws: Workspace) -> list[str]:
    from safetensors.torch import load_file, save_file

    for file in os.listdir(ws.hf):
        if file.endswith(".safetensors"):
            path = os.path.join(ws.hf, file)
            save_file({k: v.double() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    return to_mcore(ws)


def existing(ws: Workspace, marker: bool = False) -> None:
    ws.write("out/keep.txt", "mine")
    if marker:
        ws.write("out/.mcore_rl-output.json", json.dumps({"tool": "mcore_rl", "kind": "hf-model"}))


def mocked(target: str, error: OSError) -> Callable[[Workspace], list[str]]:
    """A system failure (read-only folder, full disk) where the real one needs privileges we lack as root."""

    def build(ws: Workspace) -> list[str]:
        build.patch = mock.patch(target, side_effect=error)  # type: ignore[attr-defined]
        return to_hf(ws)

    return build


@dataclass
class Case:
    name: str
    build: Callable[[Workspace], list[str]]
    needles: tuple[str, ...]
    code: int = 1
    env: dict[str, str] | None = None


def _c(name, build, *needles, code=1, env=None) -> Case:
    return Case(name, build, needles, code, env)


CASES = [
    # First: they need a process without a torch.distributed world (later cases may leave one behind).
    # --- launcher environment --------------------------------------------------------------------------------
    _c("world-without-launcher", to_hf, "WORLD_SIZE=2", "torchrun", env={"WORLD_SIZE": "2", "RANK": "1"}),
    _c("world-not-int", to_hf, "WORLD_SIZE='two'", env={"WORLD_SIZE": "two"}),
    _c(
        "rank-beyond-world",
        to_hf,
        "RANK=5",
        env={
            "WORLD_SIZE": "2",
            "RANK": "5",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        },
    ),
    _c("rendezvous-missing", to_hf, "MASTER_ADDR", env={"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}),
    # --- output safety ---------------------------------------------------------------------------------------
    _c("out-empty-hf", lambda ws: to_mcore(ws, "--overwrite", out=""), "--out is empty"),
    _c("out-empty-mcore", lambda ws: to_hf(ws, "--overwrite", out=""), "--out is empty"),
    _c("out-blank", lambda ws: to_hf(ws, out="  "), "--out is empty"),
    _c("out-dot", lambda ws: to_hf(ws, "--overwrite", out="."), "--out .", "current directory"),
    _c("out-cwd-abs", lambda ws: to_mcore(ws, "--overwrite", out=ws.p("cwd")), "current directory"),
    _c("out-cwd-parent", lambda ws: to_hf(ws, "--overwrite", out=".."), "contains the current directory"),
    _c("out-home", lambda ws: to_hf(ws, "--overwrite", out=ws.p("home")), "home folder"),
    _c("out-tilde-parent", lambda ws: to_hf(ws, "--overwrite", out=ws.root), "contains"),
    _c("out-root", lambda ws: to_hf(ws, "--overwrite", out="/"), "filesystem root"),
    _c("out-is-input", lambda ws: to_mcore(ws, "--overwrite", out=ws.hf), "is the input"),
    _c("out-is-ckpt", lambda ws: to_hf(ws, "--overwrite", out=ws.ck), "is the input"),
    _c(
        "out-inside-input",
        lambda ws: to_hf(ws, "--overwrite", out=os.path.join(ws.ck, "x")),
        "inside the input",
    ),
    _c(
        "out-contains-input",
        lambda ws: to_mcore(ws, "--overwrite", out=os.path.dirname(ws.hf) + "/./"),
        "contains",
    ),
    _c(
        "out-via-symlinked-parent",
        lambda ws: (link(ws, "alias", ws.hf), to_mcore(ws, "--overwrite", out=ws.p("alias", "sub")))[1],
        "inside the input",
    ),
    _c(
        "out-symlink-to-input",
        lambda ws: (link(ws, "alias", ws.hf), to_mcore(ws, "--overwrite", out=ws.p("alias")))[1],
        "symbolic link",
    ),
    _c(
        "out-is-hf-config-from",
        lambda ws: to_hf(ws, "--hf-config-from", ws.hf, "--overwrite", out=ws.hf),
        "is the input",
    ),
    _c(
        "out-contains-hf-config-from",
        lambda ws: (
            shutil.copytree(ws.hf, ws.p("models", "hf")),
            to_hf(ws, "--hf-config-from", ws.p("models", "hf"), "--overwrite", out=ws.p("models")),
        )[1],
        "contains the input",
    ),
    _c("out-exists-hf", lambda ws: (existing(ws), to_mcore(ws))[1], "not empty", "--overwrite"),
    _c("out-exists-mcore", lambda ws: (existing(ws), to_hf(ws))[1], "not empty", "--overwrite"),
    _c("out-ours-no-overwrite", lambda ws: (existing(ws, True), to_hf(ws))[1], "not empty", "--overwrite"),
    _c(
        "out-is-a-file",
        lambda ws: (ws.write("out", "a user's file"), to_hf(ws, "--overwrite"))[1],
        "not a folder",
    ),
    _c(
        "out-parent-missing", lambda ws: to_hf(ws, out=ws.p("nope", "out")), "parent folder", "does not exist"
    ),
    _c("out-name-too-long", lambda ws: to_hf(ws, out=ws.p("x" * 300)), "longer than 255"),
    _c(
        "out-read-only",
        mocked("mcore_rl.io.output.os.mkdir", OSError(errno.EROFS, "Read-only file system", "/ro/out")),
        "/ro/out",
        "Read-only file system",
    ),
    _c(
        "out-disk-full",
        mocked(
            "mcore_rl.convert.safetensors_io.StreamingShardWriter.add", OSError(errno.ENOSPC, "No space left")
        ),
        "No space left",
    ),
    # --- untrusted checkpoints -------------------------------------------------------------------------------
    _c("pickle-runs-code", crafted_metadata, ".metadata", "io.open", "refusing"),
    _c("pickle-eval", crafted_eval, ".metadata", "builtins.eval", "refusing"),
    _c(
        "metadata-garbage",
        lambda ws: (ws.write("ck/.metadata", b"\x80\x05garbage"), to_hf(ws))[1],
        ".metadata",
    ),
    _c(
        "metadata-truncated",
        lambda ws: (os.truncate(os.path.join(ws.ck, ".metadata"), 100), to_hf(ws))[1],
        ".metadata",
        "not a readable",
    ),
    _c(
        "metadata-not-metadata",
        lambda ws: (ws.write("ck/.metadata", pickle.dumps({"a": 1})), to_hf(ws))[1],
        ".metadata",
        "holds a dict",
    ),
    _c("metadata-names-outside-file", metadata_escaping_storage, "../secret/id_rsa", "not a file of"),
    _c(
        "metadata-symlink-out",
        lambda ws: (link(ws, "ck/.metadata", ws.secret()), to_hf(ws))[1],
        ".metadata",
        "outside",
    ),
    _c("side-file-symlink-out", side_file_link, "tokenizer.json", "outside"),
    _c(
        "hf-assets-dir-symlink-out",
        lambda ws: (ws.secret(), link(ws, "ck/hf_assets", ws.p("secret")), to_hf(ws))[2],
        "hf_assets",
        "outside",
    ),
    _c(
        "hf-side-file-symlink-out",
        lambda ws: (link(ws, "hf/tokenizer.json", ws.secret()), to_mcore(ws))[1],
        "tokenizer.json",
        "outside",
    ),
    _c(
        "hf-config-symlink-out",
        lambda ws: (
            ws.write("secret/config.json", "{}"),
            link(ws, "hf/config.json", ws.p("secret/config.json")),
            to_mcore(ws),
        )[2],
        "config.json",
        "outside",
    ),
    _c(
        "hf-shard-symlink-out",
        lambda ws: (
            shutil.copy(os.path.join(ws.hf, first_shard(ws)), ws.secret()),
            link(ws, "hf/" + first_shard(ws), ws.p("secret/id_rsa")),
            to_mcore(ws),
        )[2],
        "outside",
    ),
    _c(
        "distcp-truncated",
        lambda ws: (os.truncate(os.path.join(ws.ck, "__0_0.distcp"), 64), to_hf(ws))[1],
        "cannot read",
    ),
    _c(
        "metadata-json-garbage", lambda ws: (ws.write("ck/metadata.json", "{"), to_hf(ws))[1], "metadata.json"
    ),
    _c("metadata-json-list", lambda ws: (ws.write("ck/metadata.json", "[]"), to_hf(ws))[1], "JSON object"),
    _c(
        "metadata-json-backend",
        lambda ws: (ws.write("ck/metadata.json", '{"sharded_backend": "zarr"}'), to_hf(ws))[1],
        "sharded_backend='zarr'",
    ),
    _c(
        "not-a-checkpoint",
        lambda ws: ["convert", "mcore-to-hf", "--ckpt", ws.hf, "--out", ws.p("out")],
        "metadata.json",
        "not a megatron",
    ),
    _c(
        "info-garbage",
        lambda ws: (ws.write("ck/mcore_rl_model.json", "nope"), to_hf(ws))[1],
        "mcore_rl_model.json",
    ),
    _c("info-dtype", model_info(dtype="int8"), "mcore_rl_model.json", "dtype='int8'"),
    _c("info-hf-config-type", model_info(hf_config="llama"), "mcore_rl_model.json", "hf_config"),
    _c("info-version-string", model_info(format_version="1"), "format_version='1'"),
    _c("info-unknown-field", model_info(surprise=1), "unknown field 'surprise'"),
    _c(
        "info-tie-string",
        hf_config_field(tie_word_embeddings="false"),
        "mcore_rl_model.json",
        "tie_word_embeddings",
    ),
    _c("info-layers-zero", hf_config_field(num_hidden_layers=0), "mcore_rl_model.json", "num_hidden_layers"),
    # --- config.json fields ----------------------------------------------------------------------------------
    _c(
        "tie-string",
        config(tie_word_embeddings="false"),
        "config.json",
        "tie_word_embeddings",
        "true or false",
    ),
    _c("layers-string", config(num_hidden_layers="4"), "config.json", "num_hidden_layers"),
    _c("layers-float", config(num_hidden_layers=4.0), "num_hidden_layers", "positive integer"),
    _c("layers-zero", config(num_hidden_layers=0), "num_hidden_layers"),
    _c("layers-bool", config(num_hidden_layers=True), "num_hidden_layers"),
    _c("hidden-negative", config(hidden_size=-64), "hidden_size"),
    _c("vocab-missing", config_without("vocab_size"), "missing field 'vocab_size'"),
    _c("positions-missing", config_without("max_position_embeddings"), "max_position_embeddings"),
    _c("eps-string", config(rms_norm_eps="1e-6"), "rms_norm_eps"),
    _c("eps-nan", config(rms_norm_eps=float("nan")), "rms_norm_eps"),
    _c("rope-theta-zero", config(rope_theta=0), "rope_theta"),
    _c(
        "rope-llama3-incomplete",
        config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
        "rope_parameters.low_freq_factor",
    ),
    _c(
        "rope-linear-no-factor",
        config(rope_parameters=None, rope_scaling={"rope_type": "linear"}),
        "rope_scaling.factor",
    ),
    _c("rope-string", config(rope_parameters="llama3"), "rope_parameters must be an object"),
    _c("rope-yarn", config(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type='yarn'"),
    _c("attention-bias-string", config(attention_bias="yes"), "attention_bias"),
    _c("kv-heads-not-dividing", config(num_key_value_heads=3), "num_key_value_heads=3"),
    _c("architectures-string", config(architectures="LlamaForCausalLM"), "architectures"),
    _c(
        "architectures-unknown",
        config(architectures=["GPT2LMHeadModel"]),
        "GPT2LMHeadModel",
        "Qwen2ForCausalLM",
    ),
    _c("dtype-number", config(torch_dtype=16), "torch_dtype"),
    _c("partial-rotary-2", config(partial_rotary_factor=2.0), "partial_rotary_factor"),
    _c(
        "mistral-window-string",
        config(architectures=["MistralForCausalLM"], sliding_window="8"),
        "sliding_window",
    ),
    _c(
        "config-garbage",
        lambda ws: (ws.write("hf/config.json", "{nope"), to_mcore(ws))[1],
        "config.json",
        "JSON",
    ),
    _c(
        "config-list",
        lambda ws: (ws.write("hf/config.json", "[1]"), to_mcore(ws))[1],
        "config.json",
        "JSON object",
    ),
    _c(
        "config-missing",
        lambda ws: (os.remove(os.path.join(ws.hf, "config.json")), to_mcore(ws))[1],
        "config.json",
    ),
    _c(
        "config-disagrees-with-weights",
        config(intermediate_size=128),
        "mlp.gate_proj.weight has shape [96, 64]",
        "intermediate_size=128",
    ),
    _c("extra-layers-in-weights", config(num_hidden_layers=2), "model.layers.2.", "num_hidden_layers=2"),
    # --- weights ---------------------------------------------------------------------------------------------
    _c("nan-weight", nan_weight, "NaN/Inf", "--allow-nonfinite"),
    _c("float64-weights", float64_weights, "torch.float64", "--dtype"),
    _c(
        "shard-missing",
        lambda ws: (os.remove(os.path.join(ws.hf, first_shard(ws))), to_mcore(ws))[1],
        "missing",
    ),
    _c(
        "shard-garbage",
        lambda ws: (ws.write("hf/" + first_shard(ws), b"\xff" * 64), to_mcore(ws))[1],
        "corrupt",
    ),
    _c(
        "shard-truncated",
        lambda ws: (os.truncate(os.path.join(ws.hf, first_shard(ws)), 1000), to_mcore(ws))[1],
        "corrupt",
    ),
    _c(
        "shard-is-a-folder",
        lambda ws: (
            shard := os.path.join(ws.hf, first_shard(ws)),
            os.remove(shard),
            os.mkdir(shard),
            to_mcore(ws),
        )[3],
        "not a regular file",
    ),
    _c(
        "index-weight-map-list",
        lambda ws: (ws.write("hf/model.safetensors.index.json", '{"weight_map": []}'), to_mcore(ws))[1],
        "weight_map",
    ),
    _c(
        "index-garbage",
        lambda ws: (ws.write("hf/model.safetensors.index.json", "{"), to_mcore(ws))[1],
        "model.safetensors.index.json",
    ),
    _c(
        "only-bin-weights",
        lambda ws: (
            [os.remove(os.path.join(ws.hf, f)) for f in os.listdir(ws.hf) if "safetensors" in f],
            ws.write("hf/pytorch_model.bin", b"x"),
            to_mcore(ws),
        )[2],
        ".bin",
    ),
    # --- flags -----------------------------------------------------------------------------------------------
    _c("tp-zero", lambda ws: to_mcore(ws, "--tp", "0"), "--tp", "at least 1", code=2),
    _c("tp-word", lambda ws: to_mcore(ws, "--tp", "two"), "--tp", code=2),
    _c("pp-negative", lambda ws: to_mcore(ws, "--pp", "-1"), "--pp", code=2),
    _c(
        "tp-not-dividing-heads",
        lambda ws: to_mcore(ws, "--tp", "3"),
        "num_attention_heads=4",
        "tensor_parallel_size=3",
    ),
    _c("dtype-unknown", lambda ws: to_mcore(ws, "--dtype", "fp8"), "--dtype 'fp8'", code=2),
    _c("shard-size-word", lambda ws: to_hf(ws, "--max-shard-size", "big"), "--max-shard-size", code=2),
    _c("shard-size-zero", lambda ws: to_hf(ws, "--max-shard-size", "0"), "--max-shard-size", code=2),
    _c(
        "hf-dir-missing",
        lambda ws: ["convert", "hf-to-mcore", "--hf-dir", ws.p("nope"), "--out", ws.p("out")],
        "--hf-dir",
        "not a folder",
    ),
    _c(
        "ckpt-missing",
        lambda ws: ["convert", "mcore-to-hf", "--ckpt", ws.p("nope"), "--out", ws.p("out")],
        "--ckpt",
        "not a folder",
    ),
    _c("hf-config-from-missing", lambda ws: to_hf(ws, "--hf-config-from", ws.p("nope")), "--hf-config-from"),
    _c("unknown-flag", lambda ws: to_hf(ws, "--frobnicate"), "--frobnicate", code=2),
    # --- demo flags --------------------------------------------------------------------------------------------
    _c("demo-sft-steps-zero", lambda ws: ["demo", "--sft-steps", "0"], "--sft-steps", code=2),
    _c("demo-target-above-1", lambda ws: ["demo", "--sft-target", "1.5"], "--sft-target", code=2),
    _c("demo-lr-nan", lambda ws: ["demo", "--sft-lr", "nan"], "--sft-lr", code=2),
    _c("demo-grpo-seconds-negative", lambda ws: ["demo", "--grpo-seconds", "-1"], "--grpo-seconds", code=2),
    _c("demo-batch-word", lambda ws: ["demo", "--batch-size", "many"], "--batch-size", code=2),
    _c("demo-out-empty", lambda ws: ["demo", "--out", ""], "--out is empty"),
    _c("demo-out-cwd", lambda ws: ["demo", "--out", "."], "current directory"),
    _c(
        "demo-out-not-ours",
        lambda ws: (existing(ws), ["demo", "--out", ws.p("out")])[1],
        "not written by mcore_rl",
    ),
]


@pytest.fixture
def workspace(tmp_path, hf_sharded, ckpt, monkeypatch) -> Workspace:
    ws = Workspace(str(tmp_path / "ws"), hf_sharded, ckpt)
    monkeypatch.chdir(ws.p("cwd"))
    monkeypatch.setenv("HOME", ws.p("home"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    return ws


def _run_case(case: Case, ws: Workspace, capsys, monkeypatch) -> str:
    import torch.distributed as dist

    if case.env and dist.is_initialized():
        pytest.skip("this process already joined a torch.distributed world; launcher variables are moot")
    args = case.build(ws)
    before = snapshot(ws.root)
    for key, value in (case.env or {}).items():
        monkeypatch.setenv(key, value)
    patch = getattr(case.build, "patch", None)
    capsys.readouterr()
    try:
        if patch is not None:
            with patch:
                code = main(args)
        else:
            code = main(args)
    except SystemExit as exit_:  # argparse usage errors exit directly
        code = exit_.code
    err = capsys.readouterr().err
    assert code == case.code, (code, err)
    errors = [line for line in err.splitlines() if line.startswith("mcore-rl") and "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    for needle in case.needles:
        assert needle in errors[0], (needle, errors[0])
    assert snapshot(ws.root) == before, "a file was changed, added or removed"
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, workspace: Workspace, capsys, monkeypatch):
    _run_case(case, workspace, capsys, monkeypatch)
    assert not os.path.exists(workspace.p("ran")), "a checkpoint's pickle ran code"
    assert not os.path.exists(workspace.p("cwd", "ran")), "a checkpoint's pickle ran code"


def test_the_table_is_wide():
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)


def test_nonfinite_weights_are_refused_or_converted_with_a_warning(workspace: Workspace, capsys):
    from mcore_rl.convert.hf_to_mcore import _ChunkSource
    from mcore_rl.convert.mapping import tensor_maps
    from mcore_rl.engine.arch import ModelArch

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
