"""HF safetensors folder -> megatron-core distributed checkpoint (torch_dist), streamed tensor by tensor.

Data flow, per rank::

    config.json --ModelArch--> checkpoint_plan(arch, tp, pp): chunks (key, offsets, sizes, full-state name)
                                    |  this rank's chunks (writer rank % world size)
    safetensors --read q,k,v..--> to_full() --narrow to chunk--> DCP FileSystemWriter (one at a time)

Everything that can be wrong with the input (config, missing/corrupt shard, tensor shapes, layout) is
checked from headers before any tensor is read or any output is created. The checkpoint is the one a
trainer at (tp, pp) would save, so it loads at any layout; under torchrun each rank writes only the
chunks its (tp, pp) position owns.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import WriteItem

from mcore_rl.convert.dcp_io import bytes_write_item, save_lazily, tensor_write_item
from mcore_rl.convert.dist_layout import Chunk, checkpoint_plan, writer_layout
from mcore_rl.convert.memory import release_freed_memory
from mcore_rl.convert.output import conversion_output
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import HF_ASSETS_DIR, ModelCheckpointInfo
from mcore_rl.engine.hf.mapping import (
    ConvertError,
    TensorMap,
    check_convertible,
    check_finite,
    tensor_maps,
    to_full,
)
from mcore_rl.engine.hf.safetensors_io import SafetensorsReader
from mcore_rl.engine.hf.score_head import arch_of_file
from mcore_rl.engine.hf.state import check_hf_weights
from mcore_rl.io.collective import abort_collective, begin_collective, commit_collective
from mcore_rl.io.inputs import input_file
from mcore_rl.io.output import OutputFolder, write_failure
from mcore_rl.io.side_files import HF_SIDE_FILES, copy_side_files


@dataclass(frozen=True)
class HfToMcoreOptions:
    hf_dir: str
    """HF model folder: config.json + model.safetensors or sharded safetensors with an index."""
    out: str
    """Checkpoint folder to create."""
    tp: int = 1
    """Tensor-parallel chunking of the written checkpoint (it loads at any TP)."""
    pp: int = 1
    """Pipeline stages whose ranks split the writing under torchrun."""
    ep: int = 1
    """Mixture-of-experts models: expert-parallel chunking (experts split into this many blocks)."""
    etp: int | None = None
    """Mixture-of-experts models: expert tensor-parallel chunking; None = ``tp``."""
    dtype: torch.dtype | None = None
    """Stored dtype; None keeps the HF weights' dtype."""
    overwrite: bool = False
    """Replace a non-empty ``out`` (never an input, the current directory or home)."""
    allow_nonfinite: bool = False
    """Convert weights holding NaN/Inf with a warning instead of refusing them."""


def prepare(options: HfToMcoreOptions) -> tuple[ModelArch, SafetensorsReader, torch.dtype, OutputFolder]:
    """All input validation, from headers only; raises before anything is written."""
    if not options.hf_dir or not os.path.isdir(options.hf_dir):
        raise ConvertError(f"--hf-dir {options.hf_dir!r} is not a folder")
    arch = arch_of_file(str(input_file(options.hf_dir, "config.json")))  # a causal LM or a classifier
    check_convertible(arch)
    layout = writer_layout(arch, options.tp, options.pp, options.ep, options.etp)
    layout.check_model(
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        num_layers=arch.num_layers,
        num_experts=arch.moe.num_experts if arch.moe else None,
        moe_ffn_hidden_size=arch.moe.ffn_hidden_size if arch.moe else None,
    )
    reader = SafetensorsReader(options.hf_dir)
    dtype = check_hf_weights(arch, reader, options.dtype)
    for name in HF_SIDE_FILES:  # copied at the end: a link out of the folder is refused now, not then
        input_file(options.hf_dir, name, required=False)
    output = conversion_output(options.out, [options.hf_dir], options.overwrite, kind="mcore-checkpoint")
    return arch, reader, dtype, output


class _ChunkSource:
    """Builds chunks from the HF tensors, keeping the last full-state tensor (chunks come grouped by it)."""

    def __init__(
        self, arch: ModelArch, reader: SafetensorsReader, dtype: torch.dtype, allow_nonfinite: bool
    ) -> None:
        self.arch = arch
        self.reader = reader
        self.dtype = dtype
        self.allow_nonfinite = allow_nonfinite
        self.maps: dict[str, TensorMap] = {m.full_name: m for m in tensor_maps(arch)}
        self._cached: tuple[str, torch.Tensor] | None = None

    def full(self, name: str) -> torch.Tensor:
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # free the previous tensor before reading the next
            release_freed_memory()
            tensor_map = self.maps[name]
            hf = [self.reader.get(n) for n in tensor_map.hf_names]
            for n, t in zip(tensor_map.hf_names, hf, strict=True):
                where = os.path.join(self.reader.directory, self.reader.infos[n].file)
                check_finite(t, n, where, self.allow_nonfinite)
            self._cached = (name, to_full(self.arch, tensor_map, hf).to(self.dtype))
        return self._cached[1]

    def chunk(self, chunk: Chunk) -> torch.Tensor:
        full = self.full(chunk.full_name)
        offsets, sizes = chunk.full_region
        part = full
        for dim, (start, length) in enumerate(zip(offsets, sizes, strict=True)):
            start = min(start, full.shape[dim])
            part = part.narrow(dim, start, min(length, full.shape[dim] - start))
        if tuple(part.shape) != tuple(sizes):  # vocab padding rows past the real vocab: zeros
            padded = full.new_zeros(sizes)
            padded[tuple(slice(0, s) for s in part.shape)] = part
            return padded.reshape(chunk.sizes)
        if part.numel() == full.numel():  # the whole tensor (TP=1): written from it, no second copy
            return part.reshape(chunk.sizes)
        return part.reshape(chunk.sizes).clone()  # a TP slice: the writer needs compact storage anyway


def _extra_state_bytes() -> io.BytesIO:
    # What megatron stores for a local-spec layer's ShardedObject: torch.save of the list of its values.
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer


def write_checkpoint(
    directory: str, arch: ModelArch, source: _ChunkSource, dtype: torch.dtype, options: HfToMcoreOptions
) -> None:
    """Collective over the default process group: each rank writes its part of the plan into ``directory``."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    chunks, extra_states = checkpoint_plan(arch, options.tp, options.pp, options.ep, options.etp)
    mine = [c for c in chunks if c.writer % world == rank]
    by_index = {}
    items = []
    for c in mine:
        item = tensor_write_item(c.key, c.global_shape, c.offsets, c.sizes, dtype)
        by_index[item.index] = c
        items.append(item)
    items += [bytes_write_item(e.fqn) for e in extra_states if e.writer % world == rank]

    def resolve(item: WriteItem) -> torch.Tensor | io.BytesIO:
        chunk = by_index.get(item.index)
        return _extra_state_bytes() if chunk is None else source.chunk(chunk)

    save_lazily(directory, items, resolve)


def finish_checkpoint(directory: str, arch: ModelArch, dtype: torch.dtype, hf_dir: str) -> None:
    """Rank 0, after the collective write: megatron's side files and ours."""
    from mcore_rl.compat.megatron_import import import_megatron_core

    import_megatron_core()  # a conversion builds no model: on CPU, without its fusions' compile backend
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    torch.save({}, os.path.join(directory, "common.pt"))  # the model has no non-tensor state
    ModelCheckpointInfo.for_arch(arch, dtype, converted_from=os.path.abspath(hf_dir)).write(directory)
    copy_side_files(hf_dir, os.path.join(directory, HF_ASSETS_DIR))
    save_config(CheckpointingConfig("torch_dist", 1), directory)  # last: marks the checkpoint complete


def convert_hf_to_mcore(options: HfToMcoreOptions) -> str:
    """Run the conversion on every rank of the launcher's world (or alone); returns the output path.

    Collective: on return the checkpoint is complete at ``options.out`` for every rank, or every rank raises.
    """
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext

    arch, reader, dtype, output = prepare(options)
    source = _ChunkSource(arch, reader, dtype, options.allow_nonfinite)
    with ParallelContext.initialize(ParallelConfig()) as ctx:  # world from torchrun, or a world of one
        _, staging = begin_collective(lambda: output, ctx.rank)
        try:
            try:
                write_checkpoint(staging, arch, source, dtype, options)
            except BaseException:
                abort_collective(output, ctx.rank)
                raise
            finish = lambda: finish_checkpoint(staging, arch, dtype, options.hf_dir)  # noqa: E731
            commit_collective(output, ctx.rank, finish)  # aborts on failure
        except (OSError, RuntimeError) as err:  # a full disk, a quota: the partial output is gone, named
            raise _write_failed(options, err) from None
    return output.path


def _write_failed(options: HfToMcoreOptions, err: OSError | RuntimeError) -> BaseException:
    """The one-line error of a write the filesystem refused (``err`` itself when it is something else): torch's
    writer reports some as a RuntimeError (:func:`~mcore_rl.io.output.write_failure`)."""
    reason = write_failure(err, os.path.dirname(os.path.abspath(options.out)))
    if reason is None:
        return err
    if isinstance(err, OSError):
        reason = err.strerror or str(err)  # the file it names was in the staging folder, removed by now
    return ConvertError(
        f"--out {options.out}: {reason} while writing the checkpoint; the partial output was removed"
    )


def convert_in_this_process(options: HfToMcoreOptions) -> str:
    """The whole conversion written by this process alone (the RL driver: it starts no process group);
    returns the output path. In a world of one (an in-process run) the collective write is this rank's."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("convert_in_this_process runs outside a multi-rank world; use convert_hf_to_mcore")
    arch, reader, dtype, output = prepare(options)
    source = _ChunkSource(arch, reader, dtype, options.allow_nonfinite)
    staging = output.begin()
    try:
        write_checkpoint(staging, arch, source, dtype, options)
        finish_checkpoint(staging, arch, dtype, options.hf_dir)
        output.commit()
    except (OSError, RuntimeError) as err:
        output.abort()
        raise _write_failed(options, err) from None
    except BaseException:
        output.abort()
        raise
    return output.path
