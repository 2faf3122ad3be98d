"""Reading torch distributed checkpoints (DCP) without running code a checkpoint carries.

A DCP folder holds two kinds of pickles:

- ``.metadata``, which torch's ``FileSystemReader.read_metadata`` reads with a plain ``pickle.load``: any
  object's ``__reduce__`` runs on load. :func:`read_dcp_metadata` reads it with
  :class:`RestrictedUnpickler`, which builds only the classes the format needs (the dataclasses of
  ``torch.distributed.checkpoint.metadata``, ``torch.Size``, dtypes, layouts, paths); anything else is
  refused with one line naming the file and the class.
- byte objects inside ``*.distcp`` (megatron's ``ShardedObject``), which torch's ``DefaultLoadPlanner``
  loads with ``torch.load(weights_only=False)``. Under :func:`safe_dcp_loading` they load with
  ``weights_only=True`` (tensors, containers and primitives only).

:func:`safe_dcp_loading` applies both to every DCP read made inside it, megatron's ``dist_checkpointing.load``
included (it builds its own readers and planners, so the two torch methods are swapped for the duration of
the block and restored after it). ``common.pt`` is checked with ``torch.load(weights_only=True)`` before
megatron reads it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from mcore_rl.io.errors import CheckpointIntegrityError, InputError, Interrupted, UnsafeInputError
from mcore_rl.io.inputs import input_file

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # looks a layout up by name in a fixed table
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that can only build the classes of DCP metadata (see the module docstring)."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)  # dtypes and memory formats pickle as module attributes
        raise UnsafeInputError(
            f"{self.source}: refers to {module}.{name}, which checkpoint metadata never needs; "
            "refusing to load it (a crafted or foreign file)"
        )


def read_dcp_metadata(folder: str) -> Any:
    """The ``Metadata`` of the DCP checkpoint in ``folder``, unpickled with :class:`RestrictedUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = input_file(folder, ".metadata")
    assert path is not None
    try:
        with open(path, "rb") as f:
            metadata = RestrictedUnpickler(f, path).load()
    except UnsafeInputError:
        raise
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    except Exception as err:  # truncated or garbage bytes: pickle raises assorted errors
        raise InputError(
            f"{path}: not a readable checkpoint metadata file ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise InputError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()  # what torch's reader fills in for old files
    _check_data_files(folder, path, metadata)
    return metadata


def _check_data_files(folder: str, path: str, metadata: Any) -> None:
    """Every data file the metadata names is a plain file name inside ``folder`` (no ``../``, no link out),
    at least as long as the last byte the metadata reads from it (a truncated copy is named here, not deep in
    torch's reader)."""
    needed: dict[Any, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        end = getattr(info, "offset", 0) + getattr(info, "length", 0)
        needed[name] = max(needed.get(name, 0), end if isinstance(end, int) else 0)
    for name, end in needed.items():
        if not isinstance(name, str) or not name or os.sep in name or name in (".", ".."):
            raise UnsafeInputError(f"{path}: names the data file {name!r}, which is not a file of {folder}")
        file = input_file(folder, name)
        assert file is not None
        size = os.path.getsize(file)
        if size < end:
            raise CheckpointIntegrityError(f"{file}: truncated ({size} bytes; {path} reads up to byte {end})")


def check_common_pt(folder: str) -> None:
    """megatron's ``common.pt`` (non-tensor state) loads with ``weights_only=True``: no code runs."""
    path = input_file(folder, "common.pt", required=False)
    if path is None:
        return
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from None
    except pickle.UnpicklingError as err:
        raise UnsafeInputError(
            f"{path}: refused by torch.load(weights_only=True) ({_weights_only_reason(err)})"
        ) from None
    except Exception as err:
        raise InputError(f"{path}: not a readable torch file ({type(err).__name__}: {err})") from None


def _weights_only_reason(err: Exception) -> str:
    """The one informative line of torch's long weights-only refusal (which global it met)."""
    for line in str(err).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(" was not")[0]
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def checkpoint_failure(err: BaseException) -> BaseException | None:
    """The rank's own exception inside torch's ``CheckpointException`` (DCP gathers every rank's failure of a
    save or load into one, on every rank), by what it means to the user: an interruption (a signal landed
    inside the save), a refused input, an OS error (disk full, no permission); None when ``err`` is not one or
    holds none of these. Rebuilt from its fields, so each rank raises a fresh one without DCP's traceback."""
    failures = getattr(err, "failures", None)
    if type(err).__name__ != "CheckpointException" or not isinstance(failures, dict):
        return None
    found = [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    for kind in (Interrupted, KeyboardInterrupt, InputError, OSError):
        for failure in found:
            if not isinstance(failure, kind):
                continue
            if isinstance(failure, Interrupted):
                return Interrupted(failure.signum)
            if isinstance(failure, OSError):
                return OSError(failure.errno, failure.strerror or str(failure), failure.filename)
            return type(failure)(str(failure))
    return None


def _describe_load_failure(failure: BaseException) -> str | None:
    """One line for a load failure the checkpoint causes, or None (then it is ours: raised as it is)."""
    if isinstance(failure, OSError):
        return f"cannot read {failure.filename or 'a data file'} ({failure.strerror or failure})"
    message = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
    if "shape mismatch" in message.lower():  # megatron: "Global shape mismatch for loaded (...) and expected"
        return f"saved for another model: {message}"
    if type(failure).__name__ in ("CheckpointingException", "UnpicklingError", "EOFError"):
        return f"cannot be loaded ({type(failure).__name__}: {message})"
    return None


def _safe_read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
    metadata = read_dcp_metadata(os.fspath(self.path))
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _safe_load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeInputError(
            f"checkpoint object {read_item.dest_index.fqn}: refused by torch.load(weights_only=True) "
            f"({_weights_only_reason(err)})"
        ) from None
    if self.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


@contextlib.contextmanager
def safe_dcp_loading(folder: str = "checkpoint") -> Iterator[None]:
    """Every DCP read inside the block uses the restricted metadata unpickler and ``weights_only`` objects.
    A read that fails for a reason the checkpoint gives (a refused input, a tensor of another shape, a file
    that cannot be read) ends as one :class:`InputError` naming ``folder`` and the cause, on every rank."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved = (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes)
    FileSystemReader.read_metadata = _safe_read_metadata  # type: ignore[method-assign]
    DefaultLoadPlanner.load_bytes = _safe_load_bytes  # type: ignore[method-assign]
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        # DCP gathers every rank's exception into one; a refused input surfaces as itself, on every rank.
        cause = checkpoint_failure(err)
        if isinstance(cause, (Interrupted, KeyboardInterrupt, InputError)):
            raise cause from None
        failures = [failure for failure, _ in err.failures.values()]
        for failure in failures:
            described = _describe_load_failure(failure)
            if described is not None:
                raise InputError(f"{folder}: {described}") from None
        raise
    finally:
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = saved  # type: ignore[method-assign]
