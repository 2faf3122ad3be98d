"""Pure rank arithmetic for the training layout: no torch.distributed, no megatron.

Ranks are laid out the way megatron-core's ``RankGenerator`` does with its default order ``tp-cp-ep-dp-pp``
(context and expert parallelism are 1 here): tensor-parallel ranks are adjacent, then data parallel, then
pipeline stages outermost::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a TP group never straddles a node boundary when ``tp`` divides the GPUs per node. ``tests/parallel``
checks these lists against the groups megatron actually builds.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel size that does not fit the world or the model; the message names the field."""


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the (tp, dp, pp) grid."""

    tp: int
    dp: int
    pp: int


def _require_positive(**sizes: int | None) -> None:
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """A training layout over ``world_size`` ranks: ``world_size == tp * pp * dp``."""

    world_size: int
    """Total number of ranks."""
    tp: int = 1
    """Tensor-parallel size: each weight matrix is split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    vpp: int | None = None
    """Virtual pipeline (interleaved 1F1B) chunks per stage; None disables interleaving."""
    sp: bool = False
    """Sequence parallelism: activations outside attention/MLP are split over the TP group by sequence."""

    def __post_init__(self) -> None:
        _require_positive(world_size=self.world_size, tp=self.tp, pp=self.pp, vpp=self.vpp)
        if self.world_size % (self.tp * self.pp) != 0:
            raise LayoutError(
                f"world_size={self.world_size} is not divisible by tp*pp={self.tp}*{self.pp}; "
                "choose tensor_model_parallel_size and pipeline_model_parallel_size whose product divides the world"
            )
        if self.vpp is not None and self.pp < 2:
            raise LayoutError(
                f"virtual_pipeline_model_parallel_size={self.vpp} needs pipeline_model_parallel_size >= 2"
            )
        if self.sp and self.tp < 2:
            raise LayoutError("sequence_parallel=True needs tensor_model_parallel_size >= 2")

    @property
    def dp(self) -> int:
        """Data-parallel size, derived from the others."""
        return self.world_size // (self.tp * self.pp)

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world_size={self.world_size}")
        return RankCoords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def rank(self, coords: RankCoords) -> int:
        for name, value, size in (
            ("tp", coords.tp, self.tp),
            ("dp", coords.dp, self.dp),
            ("pp", coords.pp, self.pp),
        ):
            if not 0 <= value < size:
                raise LayoutError(f"{name} coordinate {value} is outside size {size}")
        return coords.tp + self.tp * (coords.dp + self.dp * coords.pp)

    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing one model replica's stage, split by tensor parallelism."""
        return [
            [self.rank(RankCoords(t, d, p)) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard of the same stage: gradients are reduced here."""
        return [
            [self.rank(RankCoords(t, d, p)) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """One pipeline: the stages of one replica's TP shard, in stage order."""
        return [
            [self.rank(RankCoords(t, d, p)) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def model_parallel_groups(self) -> list[list[int]]:
        """All ranks of one model replica (tp x pp)."""
        return [
            sorted(self.rank(RankCoords(t, d, p)) for p in range(self.pp) for t in range(self.tp))
            for d in range(self.dp)
        ]

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: they share tied embedding / output weights."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        for group in groups:
            if rank in group:
                return group
        raise LayoutError(f"rank {rank} is in none of the groups")

    def stage_layers(self, num_layers: int) -> list[list[range]]:
        """Global layer indices owned by each stage, one range per virtual chunk (``[pp][vpp]``).

        Interleaved order as megatron: chunk ``v`` of stage ``p`` holds block ``v * pp + p``.
        """
        chunks = self.pp * self.num_model_chunks
        per_chunk = num_layers // chunks
        return [
            [
                range((v * self.pp + p) * per_chunk, (v * self.pp + p + 1) * per_chunk)
                for v in range(self.num_model_chunks)
            ]
            for p in range(self.pp)
        ]

    def check_model(
        self,
        *,
        num_attention_heads: int,
        num_query_groups: int,
        num_layers: int,
        vocab_size: int | None = None,
        pad_vocab: bool = True,
        seq_length: int | None = None,
    ) -> None:
        """Raise :class:`LayoutError` naming the field when the model cannot be split this way."""
        if num_attention_heads % self.tp:
            raise LayoutError(
                f"num_attention_heads={num_attention_heads} is not divisible by tensor_model_parallel_size={self.tp}"
            )
        if num_query_groups % self.tp:
            raise LayoutError(
                f"num_key_value_heads={num_query_groups} is not divisible by tensor_model_parallel_size={self.tp}"
            )
        chunks = self.pp * self.num_model_chunks
        if num_layers % chunks:
            what = (
                f"pipeline_model_parallel_size*virtual_pipeline_model_parallel_size={chunks}"
                if self.vpp
                else (f"pipeline_model_parallel_size={self.pp}")
            )
            raise LayoutError(f"num_layers={num_layers} is not divisible by {what}")
        if vocab_size is not None and not pad_vocab and vocab_size % self.tp:
            raise LayoutError(
                f"vocab_size={vocab_size} is not divisible by tensor_model_parallel_size={self.tp} and padding is off"
            )
        if seq_length is not None and self.sp and seq_length % self.tp:
            raise LayoutError(
                f"sequence length {seq_length} is not divisible by tensor_model_parallel_size={self.tp}, "
                "which sequence_parallel requires"
            )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: the smallest multiple of ``divisible_by * tp`` that holds the vocab.

    Padding rows are never real tokens: log-probs must exclude them (see ``mcore_rl.ops``).
    """
    _require_positive(vocab_size=vocab_size, tp=tp, divisible_by=divisible_by)
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
