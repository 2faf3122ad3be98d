"""torch.distributed.checkpoint (DCP) plumbing: save tensors produced on demand, read parts of tensors.

megatron's own ``torch_dist`` save first resolves every tensor of a rank (it copies them off the GPU
before forking writer processes), so feeding it a lazily filled state dict would still materialise the
whole model; torch's ``FileSystemWriter`` resolves lazily but keeps the last tensor written under every
key (for its safetensors mode), i.e. the embedding plus one layer's worth. :class:`StreamingWriter`
writes the same files and metadata, asking the planner for each tensor just before writing it and
dropping it right after; the planner builds the tensor from the source at that moment.

Reading asks DCP for rectangular regions of global tensors (one layer of one parameter, say); DCP reads
only the stored chunks that overlap and copies the overlap into the destination.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from mcore_rl.engine.hf.mapping import ConvertError
from mcore_rl.io.checkpoint_read import checkpoint_failure, read_dcp_metadata

# --- writing ---------------------------------------------------------------------------------------------


def tensor_write_item(
    fqn: str, global_shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype
) -> WriteItem:
    """DCP's description of one stored chunk (what ``_create_write_items`` makes for a sharded tensor)."""
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(global_shape),
        ),
    )


def bytes_write_item(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


class _LazySavePlanner(DefaultSavePlanner):
    """Plans exactly ``items`` and produces each one's data only when the writer asks for it."""

    def __init__(self, items: list[WriteItem], resolve: Callable[[WriteItem], torch.Tensor | io.BytesIO]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = items
        self._resolve = resolve

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self._resolve(write_item)


class StreamingWriter(FileSystemWriter):
    """One file per rank, items in plan order, no tensor kept once written.

    Replaces ``write_data`` only (the documented ``StorageWriter`` hook); the per-item encoding is
    torch's own ``_write_item``, so files and metadata are what ``FileSystemWriter`` writes.
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item

        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    data = data.detach().cpu()
                    if data.untyped_storage().nbytes() != data.nbytes:
                        data = data.clone()  # torch.save writes whole storages: keep only the chunk
                results.append(
                    _write_item(self.transforms, stream, data, item, file_name, self.serialization_format)
                )
                del data
            if self.sync_files:
                os.fsync(stream.fileno())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


def save_lazily(
    directory: str,
    items: list[WriteItem],
    resolve: Callable[[WriteItem], torch.Tensor | io.BytesIO],
    process_group: Any = None,
) -> None:
    """Write a DCP checkpoint of this rank's ``items`` (collective over ``process_group`` if distributed).

    ``resolve(item)`` is called once per item, in order, right before it is written; a tensor must have
    the item's chunk shape and dtype.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(
            {},
            storage_writer=StreamingWriter(directory, overwrite=False),
            planner=_LazySavePlanner(items, resolve),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as err:
        # DCP gathers every rank's exception into one; surface an input error, a signal or an OS error (a full
        # disk) as itself, on every rank.
        cause = checkpoint_failure(err)
        if cause is not None:
            raise cause from None
        raise


# --- reading ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """A box of a stored global tensor: ``global[offsets[d]:offsets[d]+sizes[d], ...]``."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Reads the requested regions into freshly allocated tensors (no state dict needed)."""

    def __init__(self, regions: list[Region], dtypes: dict[str, torch.dtype]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._regions = regions
        self.results = [torch.empty(r.sizes, dtype=dtypes[r.fqn]) for r in regions]

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by set_up_planner
        requests: list[ReadItem] = []
        for i, region in enumerate(self._regions):
            stored = self.metadata.state_dict_metadata[region.fqn]
            assert isinstance(stored, TensorStorageMetadata), region.fqn
            chunk = ChunkStorageMetadata(offsets=torch.Size(region.offsets), sizes=torch.Size(region.sizes))
            for item in create_read_items_for_chunk_list(region.fqn, stored, [chunk]):
                # The destination index tells resolve_tensor which result to fill.
                requests.append(_with_dest(item, i))
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        result_index = read_item.dest_index.index
        assert result_index is not None  # set by create_local_plan
        target = self.results[result_index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the result, filled in place


def _with_dest(item: ReadItem, result_index: int) -> ReadItem:
    return replace(item, dest_index=MetadataIndex(item.dest_index.fqn, item.dest_index.offset, result_index))


class DistCheckpointReader:
    """Random access to the tensors of a DCP folder, one region at a time, from a single process.

    ``.metadata`` is read through :func:`~mcore_rl.io.checkpoint_read.read_dcp_metadata` (a restricted
    unpickler; the data files it names must lie inside ``directory``); tensor data is read by torch with
    ``weights_only=True``.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.metadata: Metadata = read_dcp_metadata(directory)
        self._reader = _CachedMetadataReader(directory, self.metadata)
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }

    def read(self, regions: list[Region]) -> list[torch.Tensor]:
        """The requested regions, each in its stored dtype."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        dtypes = {r.fqn: self.tensors[r.fqn].properties.dtype for r in regions}
        planner = _RegionLoadPlanner(regions, dtypes)
        try:
            with warnings.catch_warnings():  # a single-process read is the intent, not a fallback
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as err:  # a damaged data file: DCP wraps the cause
            names = ", ".join(r.fqn for r in regions)
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            cause = (
                lines[-1].split(". ")[0] if lines else type(err).__name__
            )  # the root cause's first sentence
            raise ConvertError(
                f"{self.directory}: cannot read {names} from the data files ({cause})"
            ) from None
        return planner.results


class _CachedMetadataReader(FileSystemReader):
    """Skips re-reading (and unpickling) ``.metadata`` for every region request."""

    def __init__(self, directory: str, metadata: Metadata) -> None:
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata
