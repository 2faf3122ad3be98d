"""Move whole ("full", TP=1, unpadded-vocab) megatron state dicts in and out of a rank's model chunks.

The full form is the meeting point of checkpoint conversion, tests and weight export: ``load_full_state``
slices it into whatever (tp, pp, vpp, ep, etp) layout ``ctx`` has, ``gather_full_state`` rebuilds it from the
shards. Names use global layer numbers and global expert indices, e.g. ``decoder.layers.7.mlp.linear_fc1.weight``
or ``decoder.layers.7.mlp.experts.local_experts.5.linear_fc2.weight``; experts split over the expert mesh
(expert TP within an expert, EP across experts), everything else over the dense one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.engine.arch import ModelArch
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.reshard.naming import canonical_key
from mcore_rl.parallel.sharding import ShardKind, is_expert_param, shard_kind, tp_merge, tp_shard


def unwrap(module: Any) -> Any:
    """The bare GPTModel under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def chunk_layer_offsets(arch: ModelArch, ctx: ParallelContext) -> list[int]:
    """The global index of the first layer of each of this rank's model chunks."""
    return [r.start for r in ctx.layout.stage_layers(arch.num_layers)[ctx.pp_rank]]


def local_parameters(
    chunks: list[Any], arch: ModelArch, ctx: ParallelContext
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical key, local tensor)`` for every parameter of this rank's chunks (see
    :mod:`mcore_rl.parallel.reshard.naming`: the last stage's tied output layer comes out as the embedding).
    LoRA adapters are not model weights and are left out (``engine/lora.py`` has their own names)."""
    tied = arch.tie_word_embeddings and not _has_value_head(chunks)
    experts = ctx.layout.local_experts(ctx.rank, arch.moe.num_experts) if arch.moe is not None else range(0)
    seen: set[str] = set()
    for chunk, offset in zip(chunks, chunk_layer_offsets(arch, ctx), strict=True):
        for name, param in unwrap(chunk).named_parameters():
            if is_adapter_param(name):
                continue
            key = canonical_key(name, offset, tied=tied, expert_offset=experts.start)
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
        if kind is ShardKind.VOCAB and full[name].shape[0] < arch.vocab_size:
            # padding rows are added here; fewer rows than the vocab left real tokens' rows zero in silence
            raise ValueError(
                f"{name}: {full[name].shape[0]} rows, fewer than the model's vocab_size {arch.vocab_size}"
            )
        rank, size = _split_of(name, ctx)
        shard = tp_shard(full[name], kind, rank, size, padded_rows=param.shape[0] * size)
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}"
            )
        param.copy_(shard)


@torch.no_grad()
def gather_full_state(
    chunks: list[Any],
    arch: ModelArch,
    ctx: ParallelContext,
    parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The full state on every rank (CPU tensors), gathered over TP and PP. Small models only: it all-gathers.
    ``parameters``: the local tensors to gather (default :func:`local_parameters`; LoRA's merged weights)."""
    value_head = _has_value_head(chunks)
    local: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, param in parameters if parameters is not None else local_parameters(chunks, arch, ctx):
        expert = is_expert_param(name)
        size = ctx.expert_tp_size if expert else ctx.tp_size
        if size > 1:
            parts = [torch.empty_like(param) for _ in range(size)]
            group = ctx.expert_tp_group if expert else ctx.tp_group
            dist.all_gather(parts, param.detach().contiguous(), group=group)
        else:
            parts = [param.detach()]
        kind = shard_kind(name, value_head)
        (experts if expert else local)[name] = tp_merge(parts, kind, real_rows=arch.vocab_size).cpu().clone()
    if ctx.ep_size > 1:  # every EP rank of the stage holds other experts
        blocks: list[dict[str, torch.Tensor] | None] = [None] * ctx.ep_size
        dist.all_gather_object(blocks, experts, group=ctx.ep_group)
        for block in blocks:
            local.update(block or {})
    else:
        local.update(experts)
    stages: list[dict[str, torch.Tensor] | None] = [None] * ctx.pp_size
    dist.all_gather_object(stages, local, group=ctx.pp_group)
    full: dict[str, torch.Tensor] = {}
    for stage in stages:  # a tied embedding arrives from two stages: synchronised copies, one key
        full.update(stage or {})
    return full


def is_adapter_param(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter matrix (``<linear>.lora_A.<projection>.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def _split_of(name: str, ctx: ParallelContext) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split that holds parameter ``name``: the expert TP group for
    experts, the TP group otherwise."""
    if is_expert_param(name):
        return ctx.expert_tp_rank, ctx.expert_tp_size
    return ctx.tp_rank, ctx.tp_size


def _has_value_head(chunks: list[Any]) -> bool:
    from mcore_rl.engine.model import ValueHead

    return any(isinstance(getattr(unwrap(c), "output_layer", None), ValueHead) for c in chunks)
