"""Streaming safetensors: read one tensor at a time, write shards without holding them in memory.

Reading opens the file for each tensor (``safe_open`` memory-maps it) and closes it straight away, so
pages of tensors already converted do not stay mapped and counted in the process's resident memory.

Writing knows every tensor's name, shape and dtype up front (the conversion plan), so each shard's
safetensors header can be written first and the tensors appended as they are produced: peak memory is
one tensor, whatever the shard size. The files are byte-compatible with ``safetensors.torch.save_file``
(8-byte little-endian header length, JSON header padded with spaces to 8 bytes, raw little-endian data).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

from mcore_rl.engine.hf.mapping import ConvertError
from mcore_rl.io.inputs import input_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class SafetensorsReader:
    """The tensors of an HF checkpoint folder (``model.safetensors`` or an index with shards).

    The constructor reads only headers: it fails on a missing or corrupt shard, naming the file, before
    any tensor data is touched.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.infos: dict[str, TensorInfo] = {}
        for file in self._shard_files():
            self._read_header(file)

    def _shard_files(self) -> list[str]:
        index_path = input_file(self.directory, INDEX_FILE, required=False)
        if index_path is not None:
            weight_map = _read_index(index_path)
            files = sorted(set(weight_map.values()))
            for file in files:
                if not os.path.lexists(os.path.join(self.directory, file)):
                    raise ConvertError(
                        f"{os.path.join(self.directory, file)}: shard listed in {INDEX_FILE} is missing"
                    )
                input_file(self.directory, file)  # no link out of the folder, no "../" names
            return files
        if input_file(self.directory, SINGLE_FILE, required=False) is not None:
            return [SINGLE_FILE]
        if any(name.endswith(".bin") for name in os.listdir(self.directory)):
            raise ConvertError(
                f"{self.directory}: only PyTorch .bin weights found; convert them to safetensors first"
            )
        raise ConvertError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE}")

    def _read_header(self, file: str) -> None:
        from safetensors import safe_open

        path = os.path.join(self.directory, file)
        _check_readable(path)
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    view = f.get_slice(name)
                    dtype = _DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise ConvertError(f"{path}: tensor {name} has unsupported dtype {view.get_dtype()}")
                    if name in self.infos:
                        raise ConvertError(f"{path}: tensor {name} is also in {self.infos[name].file}")
                    self.infos[name] = TensorInfo(file, tuple(view.get_shape()), dtype)
        except ConvertError:
            raise
        except Exception as err:  # safetensors raises its own SafetensorError for any malformed file
            raise ConvertError(f"{path}: corrupt safetensors file ({err})") from None

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        info = self.infos[name]
        path = os.path.join(self.directory, info.file)
        _check_readable(path)
        try:
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(name)
        except Exception as err:
            raise ConvertError(f"{path}: cannot read tensor {name} ({err})") from None


def _read_index(path: str) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: tensor name -> shard file name, both strings."""
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ConvertError(f"{path}: not a valid safetensors index ({err!r})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ConvertError(f"{path}: weight_map must map tensor names to shard file names (strings)")
    return weight_map


def _check_readable(path: str) -> None:
    """An unreadable file is reported as such (permission, I/O), not as a corrupt one."""
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise ConvertError(f"{path}: cannot read ({err.strerror})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class OutputTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def plan_shards(tensors: list[OutputTensor], max_shard_bytes: int) -> list[list[OutputTensor]]:
    """Cut ``tensors`` (in order) into consecutive shards of at most ``max_shard_bytes`` (one tensor may exceed)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = _nbytes(t.shape, t.dtype)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


class StreamingShardWriter:
    """Writes ``tensors`` into HF shards; :meth:`add` must be called in the planned order."""

    def __init__(self, directory: str, tensors: list[OutputTensor], max_shard_bytes: int) -> None:
        self.directory = directory
        self.shards = plan_shards(tensors, max_shard_bytes)
        self.files = shard_file_names(len(self.shards))
        self._order = [(shard_index, t) for shard_index, shard in enumerate(self.shards) for t in shard]
        self._next = 0
        self._stream: BinaryIO | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        shard_index, expected = self._order[self._next]
        if name != expected.name or tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
            raise ValueError(
                f"writer expected {expected.name} {expected.shape} {expected.dtype}, "
                f"got {name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        if self._stream is None:
            self._stream = self._open(shard_index)
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        self._stream.write(data.numpy().data)  # raw little-endian bytes, no copy
        self._next += 1
        if self._next == len(self._order) or self._order[self._next][0] != shard_index:
            self._stream.close()
            self._stream = None

    def _open(self, shard_index: int) -> BinaryIO:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in self.shards[shard_index]:
            nbytes = _nbytes(t.shape, t.dtype)
            header[t.name] = {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        stream = open(os.path.join(self.directory, self.files[shard_index]), "wb")  # noqa: SIM115
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        return stream

    def finish(self) -> None:
        """Check every tensor was written; write the index when there are several shards."""
        if self._next != len(self._order):
            raise ValueError(f"writer got {self._next} of {len(self._order)} tensors")
        if len(self.shards) == 1:
            return
        weight_map = {
            t.name: file for file, shard in zip(self.files, self.shards, strict=True) for t in shard
        }
        total = sum(_nbytes(t.shape, t.dtype) for shard in self.shards for t in shard)
        with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")
