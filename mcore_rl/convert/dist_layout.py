"""Where each full-state tensor lives in a megatron-core ``torch_dist`` checkpoint (pure; no megatron import).

A torch_dist checkpoint is a torch.distributed.checkpoint (DCP) folder. Every *global* tensor has a key
and is stored as chunks; loading at any TP/PP layout reads the overlapping parts of the chunks. For the
GPT model with megatron's layer specs (what ``GPTModel.sharded_state_dict()`` produces):

- per-layer tensors share one key per kind, with the layer as a prepended axis: layer ``i`` of
  ``decoder.layers.{i}.mlp.linear_fc2.weight`` is ``[i]`` of global ``decoder.layers.mlp.linear_fc2.weight``
  of shape ``[num_layers, hidden, ffn]``. The pre-attention / pre-MLP norms use Transformer-Engine's names
  (``...linear_qkv.layer_norm_weight``), whichever spec saved them;
- without the layer axis, a global tensor is exactly the full-state tensor (the qkv per-group layout and
  the [gate; up] fc1 make TP splits contiguous), except that the vocab dimension is padded to the saving
  layout's padded vocab (loading at another padding reads the overlap: megatron sets
  ``allow_shape_mismatch`` there);
- each linear layer has an ``_extra_state`` object per layer (None for the local spec);
- a mixture-of-experts model (megatron's ``moe_layer_freq`` pattern makes its layers "non-homogeneous") keeps
  one key per layer instead, without the layer axis (``decoder.layers.3.mlp.router.weight``), and stacks
  each MoE layer's experts on a prepended expert axis: expert ``e`` of ``decoder.layers.{i}.mlp.experts.
  local_experts.{e}.linear_fc1.weight`` is ``[e]`` of ``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight``
  of shape ``[num_experts, 2 * moe_ffn, hidden]``, chunked over the expert tensor-parallel split; the
  experts' ``_extra_state`` objects are numbered by expert (``shard_{e}_{num_experts}``).

``tests/convert/test_dist_layout.py`` checks this plan against what megatron itself writes at TP2 x PP2.
The plan mirrors the chunking a trainer at (tp, pp) would write, so a converted checkpoint loads exactly
like one the trainer saved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.hf.mapping import TensorMap, full_shape, tensor_maps
from mcore_rl.engine.hf.score_head import has_score_head
from mcore_rl.parallel.layout import ExpertCoords, LayoutError, ParallelLayout, RankCoords, padded_vocab_size
from mcore_rl.parallel.sharding import ShardKind, expert_index, shard_kind

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# megatron saves the local spec's norms under Transformer-Engine's fused names (spec-independent checkpoints).
_CHECKPOINT_SUFFIX = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


@dataclass(frozen=True)
class Location:
    """Where a full-state tensor sits in the checkpoint: its key and the box it fills there."""

    key: str
    prefix_shape: tuple[int, ...]
    """Axes the checkpoint prepends to the full-state shape: (num_layers,) for stacked per-layer keys,
    (num_experts,) for experts, () otherwise."""
    prefix_offsets: tuple[int, ...]
    """This tensor's index on those axes."""
    layer: int | None
    """Global layer number of a per-layer tensor; None for embedding, final norm and output layer."""


def checkpoint_location(arch: ModelArch, full_name: str) -> Location:
    """The checkpoint key and prefix axes of full-state tensor ``full_name`` (see the module docstring)."""
    match = _LAYER.match(full_name)
    if match is None:
        return Location(full_name, (), (), None)
    layer, suffix = int(match.group(1)), match.group(2)
    suffix = _CHECKPOINT_SUFFIX.get(suffix, suffix)
    if arch.moe is None:  # homogeneous layers: one stacked key per kind
        return Location(f"decoder.layers.{suffix}", (arch.num_layers,), (layer,), layer)
    expert = expert_index(full_name)
    if expert is None:
        return Location(f"decoder.layers.{layer}.{suffix}", (), (), layer)
    tail = suffix.rsplit(".", 2)  # [..., 'linear_fc1', 'weight']
    key = f"decoder.layers.{layer}.mlp.experts.experts.{tail[-2]}.{tail[-1]}"
    return Location(key, (arch.moe.num_experts,), (expert,), layer)


def stored_vocab_rows(arch: ModelArch) -> list[int]:
    """The row counts a megatron checkpoint of ``arch`` can store for a vocab tensor (embedding, LM head): the
    vocab itself, or padded as megatron pads it (:func:`~mcore_rl.parallel.layout.padded_vocab_size`: to a
    multiple of 128 x TP, our trainer's and Megatron-LM's default ``make_vocab_size_divisible_by``) at a TP the
    model admits (one dividing ``num_key_value_heads``, hence the heads)."""
    groups = arch.num_query_groups
    tps = [tp for tp in range(1, groups + 1) if groups % tp == 0]
    return sorted({arch.vocab_size, *(padded_vocab_size(arch.vocab_size, tp) for tp in tps)})


def writer_layout(arch: ModelArch, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> ParallelLayout:
    """The smallest trainer layout at (tp, pp, ep, etp): one data-parallel replica of the dense weights,
    enough ranks per stage for the expert mesh. Its ranks write the chunks a trainer's ranks would."""
    per_stage = tp
    expert_ranks = (tp if etp is None else etp) * ep
    while per_stage % expert_ranks:
        per_stage += tp
    layout = ParallelLayout(world_size=per_stage * pp, tp=tp, pp=pp, ep=ep, etp=etp, sp=tp > 1)
    if arch.moe is None and (ep > 1 or etp is not None):
        raise LayoutError("--ep / --etp apply to mixture-of-experts models only")
    return layout


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a global tensor and the part of the full-state tensor it holds."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    """Offsets in the global tensor (the layer first for per-layer keys)."""
    sizes: tuple[int, ...]
    full_name: str
    layer: int | None
    """Global layer number for per-layer keys (the first global axis); None otherwise."""
    writer: int
    """Rank of :func:`writer_layout` that writes it (for the dense weights: ``pp_rank * tp + tp_rank``)."""

    prefix_dims: int = 0
    """How many leading axes are the checkpoint's (layer or expert), not the full-state tensor's."""

    @property
    def full_region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) inside the full-state tensor; rows past the real vocab are zero padding."""
        return self.offsets[self.prefix_dims :], self.sizes[self.prefix_dims :]


@dataclass(frozen=True)
class ExtraState:
    """A per-layer ``_extra_state`` object (megatron ``ShardedObject``); stored under :attr:`fqn`."""

    key: str
    index: int
    """The layer (stacked keys) or expert (experts of a MoE layer) it belongs to; 0 for a per-layer key."""
    count: int
    """The number of layers or experts (1 for a per-layer key)."""
    writer: int

    @property
    def fqn(self) -> str:
        return f"{self.key}/shard_{self.index}_{self.count}"


def _split(
    dim_size: int, kind: ShardKind, dim: int, tp: int
) -> list[tuple[int, int, int, int]]:  # (dim, start, length, tp_rank)
    if kind is ShardKind.REPLICATED:
        return [(dim, 0, dim_size, 0)]
    pieces = 2 * tp if kind is ShardKind.GATED_COLUMN else tp
    length = dim_size // pieces
    return [(dim, j * length, length, j % tp) for j in range(pieces)]


def tensor_chunks(arch: ModelArch, tensor_map: TensorMap, layout: ParallelLayout) -> list[Chunk]:
    """The chunks of one full-state tensor as a trainer at ``layout`` (:func:`writer_layout`) saves them."""
    name = tensor_map.full_name
    shape = list(full_shape(arch, tensor_map))
    kind = shard_kind(name, value_head=has_score_head(arch))  # the score head is replicated, not vocab
    where = checkpoint_location(arch, name)
    expert = expert_index(name)
    tp = layout.expert_tp if expert is not None else layout.tp
    if kind is ShardKind.VOCAB:
        shape[0] = padded_vocab_size(arch.vocab_size, tp)
    if where.layer is not None:
        stage = where.layer // (arch.num_layers // layout.pp)
    else:
        stage = 0 if name.startswith("embedding") else layout.pp - 1
    split_dim = 1 if kind is ShardKind.ROW and len(shape) > 1 else 0
    if kind is ShardKind.ROW and len(shape) == 1:
        kind = ShardKind.REPLICATED
    chunks = []
    for dim, start, length, tp_rank in _split(shape[split_dim], kind, split_dim, tp):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[dim], sizes[dim] = start, length
        if expert is not None:
            ep_rank = expert // (arch.moe.num_experts // layout.ep) if arch.moe else 0
            writer = layout.expert_rank(ExpertCoords(tp_rank, ep_rank, 0, stage))
        else:
            writer = layout.rank(RankCoords(tp_rank, 0, stage))
        chunks.append(
            Chunk(
                key=where.key,
                global_shape=where.prefix_shape + tuple(shape),
                offsets=where.prefix_offsets + tuple(offsets),
                sizes=(1,) * len(where.prefix_shape) + tuple(sizes),
                full_name=name,
                layer=where.layer,
                writer=writer,
                prefix_dims=len(where.prefix_shape),
            )
        )
    return chunks


def checkpoint_plan(
    arch: ModelArch, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None
) -> tuple[list[Chunk], list[ExtraState]]:
    """Every chunk and extra-state object of ``arch``'s model checkpoint as a (tp, pp, ep, etp) trainer
    writes it.

    Chunks come grouped by full-state tensor in :func:`~mcore_rl.engine.hf.mapping.tensor_maps` order.
    """
    layout = writer_layout(arch, tp, pp, ep, etp)
    chunks = [c for m in tensor_maps(arch) for c in tensor_chunks(arch, m, layout)]
    per_stage = arch.num_layers // pp
    extra: list[ExtraState] = []
    for i in range(arch.num_layers):
        writer = layout.rank(RankCoords(0, 0, i // per_stage))
        if arch.moe is None:
            keys = [f"decoder.layers.{module}._extra_state" for module in EXTRA_STATE_MODULES]
            extra += [ExtraState(key, i, arch.num_layers, writer) for key in keys]
            continue
        dense = EXTRA_STATE_MODULES[:2] if arch.is_moe_layer(i) else EXTRA_STATE_MODULES
        extra += [ExtraState(f"decoder.layers.{i}.{m}._extra_state", 0, 1, writer) for m in dense]
        if arch.is_moe_layer(i):
            extra += _expert_extra_states(arch, i, layout)
    return chunks, extra


def _expert_extra_states(arch: ModelArch, layer: int, layout: ParallelLayout) -> list[ExtraState]:
    assert arch.moe is not None
    experts = arch.moe.num_experts
    stage = layer // (arch.num_layers // layout.pp)
    return [
        ExtraState(
            f"decoder.layers.{layer}.mlp.experts.experts.{fc}._extra_state",
            e,
            experts,
            layout.expert_rank(ExpertCoords(0, e // (experts // layout.ep), 0, stage)),
        )
        for fc in ("linear_fc1", "linear_fc2")
        for e in range(experts)
    ]
