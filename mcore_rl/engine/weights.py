"""Move whole ("full", TP=1, unpadded-vocab) megatron state dicts in and out of a rank's model chunks.

The full form is the meeting point of checkpoint conversion, tests and weight export: ``load_full_state``
slices it into whatever (tp, pp, vpp) layout ``ctx`` has, ``gather_full_state`` rebuilds it from the
shards. Names use global layer numbers, e.g. ``decoder.layers.7.mlp.linear_fc1.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.engine.arch import ModelArch
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.reshard.naming import canonical_key
from mcore_rl.parallel.sharding import shard_kind, tp_merge, tp_shard


def unwrap(module: Any) -> Any:
    """The bare GPTModel under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _chunk_layer_offsets(arch: ModelArch, ctx: ParallelContext) -> list[int]:
    return [r.start for r in ctx.layout.stage_layers(arch.num_layers)[ctx.pp_rank]]


def local_parameters(
    chunks: list[Any], arch: ModelArch, ctx: ParallelContext
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical key, local tensor)`` for every parameter of this rank's chunks (see
    :mod:`mcore_rl.parallel.reshard.naming`: the last stage's tied output layer comes out as the embedding)."""
    tied = arch.tie_word_embeddings and not _has_value_head(chunks)
    seen: set[str] = set()
    for chunk, offset in zip(chunks, _chunk_layer_offsets(arch, ctx), strict=True):
        for name, param in unwrap(chunk).named_parameters():
            key = canonical_key(name, offset, tied=tied)
            if key in seen:  # two local tensors under one key would silently shadow each other
                raise ValueError(f"rank {ctx.rank}: parameters {name!r} and an earlier one share key {key!r}")
            seen.add(key)
            yield key, param


@torch.no_grad()
def load_full_state(
    chunks: list[Any], full: dict[str, torch.Tensor], arch: ModelArch, ctx: ParallelContext
) -> None:
    """Copy this rank's slices of ``full`` into ``chunks``; every local parameter must be covered."""
    value_head = _has_value_head(chunks)
    for name, param in local_parameters(chunks, arch, ctx):
        if name not in full:
            raise KeyError(f"state has no tensor for parameter {name!r}")
        kind = shard_kind(name, value_head)
        shard = tp_shard(full[name], kind, ctx.tp_rank, ctx.tp_size, padded_rows=param.shape[0] * ctx.tp_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}"
            )
        param.copy_(shard)


@torch.no_grad()
def gather_full_state(chunks: list[Any], arch: ModelArch, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The full state on every rank (CPU tensors), gathered over TP and PP. Small models only: it all-gathers."""
    value_head = _has_value_head(chunks)
    local: dict[str, torch.Tensor] = {}
    for name, param in local_parameters(chunks, arch, ctx):
        if ctx.tp_size > 1:
            parts = [torch.empty_like(param) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, param.detach().contiguous(), group=ctx.tp_group)
        else:
            parts = [param.detach()]
        kind = shard_kind(name, value_head)
        local[name] = tp_merge(parts, kind, real_rows=arch.vocab_size).cpu().clone()
    stages: list[dict[str, torch.Tensor] | None] = [None] * ctx.pp_size
    dist.all_gather_object(stages, local, group=ctx.pp_group)
    full: dict[str, torch.Tensor] = {}
    for stage in stages:  # a tied embedding arrives from two stages: synchronised copies, one key
        full.update(stage or {})
    return full


def _has_value_head(chunks: list[Any]) -> bool:
    from mcore_rl.engine.model import ValueHead

    return any(isinstance(getattr(unwrap(c), "output_layer", None), ValueHead) for c in chunks)
