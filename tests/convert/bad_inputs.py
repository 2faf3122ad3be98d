"""Scratch workspaces and case builders for the bad-input table (tests/convert/test_bad_input.py).

A :class:`Workspace` holds lazily made copies of a tiny HF model (``hf``) and of its converted checkpoint
(``ck``), plus a working directory and a HOME of its own; a builder damages it and returns the CLI arguments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock


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


def given_config(keep_info: bool = True, **changes: object) -> Callable[[Workspace], list[str]]:
    """mcore-to-hf with ``--hf-config-from`` a folder whose config.json is the model's with ``changes``
    (the checkpoint's mcore_rl_model.json removed unless ``keep_info``)."""

    def build(ws: Workspace) -> list[str]:
        data = {**json.loads(Path(ws.hf, "config.json").read_text()), **changes}
        ws.write("given/config.json", json.dumps(data))
        if not keep_info:
            os.remove(os.path.join(ws.ck, "mcore_rl_model.json"))
        return to_hf(ws, "--hf-config-from", ws.p("given"))

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


def mocked(
    target: str, error: OSError, build: Callable[[Workspace], list[str]] | None = None
) -> Callable[[Workspace], list[str]]:
    """A system failure (read-only folder, full disk, no permission) that we cannot cause for real as root."""

    def builder(ws: Workspace) -> list[str]:
        builder.patch = mock.patch(target, side_effect=error)  # type: ignore[attr-defined]
        return (build or to_hf)(ws)

    return builder


@dataclass
class Case:
    name: str
    build: Callable[[Workspace], list[str]]
    needles: tuple[str, ...]
    code: int = 1
    env: dict[str, str] | None = None


def _c(name, build, *needles, code=1, env=None) -> Case:
    return Case(name, build, needles, code, env)


# --- faults of a conversion and of a training run's inputs (issue 31) ---------------------------------------


class _Patch:
    """A context manager made of ``set`` / ``reset`` callables (a case's ``patch``)."""

    def __init__(self, set_up: Callable[[], None], tear_down: Callable[[], None]) -> None:
        self.set_up, self.tear_down = set_up, tear_down

    def __enter__(self) -> None:
        self.set_up()

    def __exit__(self, *exc: object) -> None:
        self.tear_down()


def file_size_limit(limit: int, build: Callable[[Workspace], list[str]]) -> Callable[[Workspace], list[str]]:
    """Every file this process writes stops at ``limit`` bytes (EFBIG), as on a full disk; cannot be mocked
    away as root, and needs no mount."""
    import resource
    import signal

    def builder(ws: Workspace) -> list[str]:
        saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        previous = signal.getsignal(signal.SIGXFSZ)

        def set_up() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, saved[1]))

        def tear_down() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, saved)
            signal.signal(signal.SIGXFSZ, previous)

        builder.patch = _Patch(set_up, tear_down)  # type: ignore[attr-defined]
        return build(ws)

    return builder


def signal_inside_save(signum: int) -> Callable[[Workspace], list[str]]:
    """``signum`` arrives while torch's checkpoint writer writes hf-to-mcore's shards: the CLI's handler raises
    ``Interrupted`` right there, inside DCP, which gathers it as a rank's failure."""
    from mcore_rl.io.errors import Interrupted

    return mocked("torch.distributed.checkpoint.filesystem._write_item", Interrupted(signum), to_mcore)  # type: ignore[arg-type]


DEMO_RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes", "demo_cpu.yaml")


def train_on(
    rows: Callable[[list[dict]], list[dict] | bytes] | None = None, *overrides: str, scorer: str | None = None
) -> Callable[[Workspace], list[str]]:
    """``mcore-rl train`` (in this process) of the main job's recipe on demo rows written into the workspace,
    changed by ``rows`` first (a list of rows, or the file's bytes); ``scorer``: a user scorer file's source,
    as ``scorer.py`` (``reward.custom_function=<it>:score``)."""

    def build(ws: Workspace) -> list[str]:
        from mcore_rl.data.demo_task import write_demo_dataset
        from mcore_rl.data.rows import read_rows

        data = ws.p("data")
        if not os.path.exists(os.path.join(data, "train.jsonl")):
            paths = {s: os.path.join(data, f"{s}.jsonl") for s in ("train", "sft")}
            write_demo_dataset(
                {**paths, "tokenizer": os.path.join(data, "tokenizer")}, 1, {"train": 8, "sft": 4}
            )
        train = os.path.join(data, "train.jsonl")
        if rows is not None:
            changed = rows([raw for _, raw in read_rows(train)])
            ws.write("data/train.jsonl", changed if isinstance(changed, bytes) else _jsonl(changed))
        extra = []
        if scorer is not None:
            extra.append(f"reward.custom_function={ws.write('scorer.py', scorer)}:score")
        return [
            "train",
            DEMO_RECIPE,
            "data.generate=null",
            f"data.train_files=[{train}]",
            "data.val_files=[]",
            "data.test_files=[]",
            f"sft.train_files=[{os.path.join(data, 'sft.jsonl')}]",
            f"model.tokenizer_path={os.path.join(data, 'tokenizer')}",
            "sft.enable=false",
            "sft.target_val_accuracy=null",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "data.train_batch_size=4",
            "algorithm.ppo_mini_batch_size=4",
            f"trainer.default_local_dir={ws.p('run')}",
            *extra,
            *overrides,
            "--in-process",
        ]

    return build


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def row_set(index: int, **changes: object) -> Callable[[list[dict]], list[dict]]:
    def change(rows: list[dict]) -> list[dict]:
        rows[index] = {**rows[index], **changes}
        return rows

    return change


def row_without(index: int, key: str) -> Callable[[list[dict]], list[dict]]:
    def change(rows: list[dict]) -> list[dict]:
        del rows[index][key]
        return rows

    return change


def latin1_in_row(index: int) -> Callable[[list[dict]], bytes]:
    def change(rows: list[dict]) -> bytes:
        lines = _jsonl(rows).encode().splitlines(keepends=True)
        lines[index] = lines[index].replace(b'"content": "', b'"content": "\xe9', 1)
        return b"".join(lines)

    return change
