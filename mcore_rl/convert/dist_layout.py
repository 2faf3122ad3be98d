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
- each linear layer has an ``_extra_state`` object per layer (None for the local spec).

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
from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.parallel.sharding import ShardKind, shard_kind

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


def checkpoint_key(full_name: str) -> tuple[str, int | None]:
    """(checkpoint key, layer number or None) of a full-state tensor."""
    match = _LAYER.match(full_name)
    if match is None:
        return full_name, None
    suffix = match.group(2)
    return f"decoder.layers.{_CHECKPOINT_SUFFIX.get(suffix, suffix)}", int(match.group(1))


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
    """Rank of the (tp x pp) layout that writes it: ``pp_rank * tp + tp_rank``."""

    @property
    def full_region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) inside the full-state tensor; rows past the real vocab are zero padding."""
        skip = 0 if self.layer is None else 1
        return self.offsets[skip:], self.sizes[skip:]


@dataclass(frozen=True)
class ExtraState:
    """A per-layer ``_extra_state`` object (megatron ``ShardedObject``); stored under :attr:`fqn`."""

    key: str
    layer: int
    num_layers: int
    writer: int

    @property
    def fqn(self) -> str:
        return f"{self.key}/shard_{self.layer}_{self.num_layers}"


def _split(
    dim_size: int, kind: ShardKind, dim: int, tp: int
) -> list[tuple[int, int, int, int]]:  # (dim, start, length, tp_rank)
    if kind is ShardKind.REPLICATED:
        return [(dim, 0, dim_size, 0)]
    pieces = 2 * tp if kind is ShardKind.GATED_COLUMN else tp
    length = dim_size // pieces
    return [(dim, j * length, length, j % tp) for j in range(pieces)]


def tensor_chunks(arch: ModelArch, tensor_map: TensorMap, tp: int, pp: int) -> list[Chunk]:
    """The chunks of one full-state tensor as a (tp, pp) trainer saves them."""
    name = tensor_map.full_name
    shape = list(full_shape(arch, tensor_map))
    kind = shard_kind(name, value_head=has_score_head(arch))  # the score head is replicated, not vocab
    if kind is ShardKind.VOCAB:
        shape[0] = padded_vocab_size(arch.vocab_size, tp)
    key, layer = checkpoint_key(name)
    if layer is not None:
        stage = layer // (arch.num_layers // pp)
    else:
        stage = 0 if name.startswith("embedding") else pp - 1
    split_dim = 1 if kind is ShardKind.ROW and len(shape) > 1 else 0
    if kind is ShardKind.ROW and len(shape) == 1:
        kind = ShardKind.REPLICATED
    prefix_shape = (arch.num_layers,) if layer is not None else ()
    prefix_offsets = (layer,) if layer is not None else ()
    chunks = []
    for dim, start, length, tp_rank in _split(shape[split_dim], kind, split_dim, tp):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[dim], sizes[dim] = start, length
        chunks.append(
            Chunk(
                key=key,
                global_shape=prefix_shape + tuple(shape),
                offsets=prefix_offsets + tuple(offsets),
                sizes=(1,) * len(prefix_shape) + tuple(sizes),
                full_name=name,
                layer=layer,
                writer=stage * tp + tp_rank,
            )
        )
    return chunks


def checkpoint_plan(arch: ModelArch, tp: int = 1, pp: int = 1) -> tuple[list[Chunk], list[ExtraState]]:
    """Every chunk and extra-state object of ``arch``'s model checkpoint as a (tp, pp) trainer writes it.

    Chunks come grouped by full-state tensor in :func:`~mcore_rl.engine.hf.mapping.tensor_maps` order.
    """
    chunks = [c for m in tensor_maps(arch) for c in tensor_chunks(arch, m, tp, pp)]
    per_stage = arch.num_layers // pp
    extra = [
        ExtraState(f"decoder.layers.{module}._extra_state", i, arch.num_layers, (i // per_stage) * tp)
        for i in range(arch.num_layers)
        for module in EXTRA_STATE_MODULES
    ]
    return chunks, extra
