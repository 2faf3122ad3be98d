"""Pure rank arithmetic for the training layout: no torch.distributed, no megatron.

Ranks are laid out the way megatron-core's ``RankGenerator`` does with its default order ``tp-cp-ep-dp-pp``
(expert parallelism is 1 in this first mesh): tensor-parallel ranks are adjacent, then context parallel,
then data parallel, then pipeline stages outermost::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group never straddles a node boundary when ``tp`` divides the GPUs per node, and the CP ranks of one
TP shard come next (their attention exchanges keys and values every layer).

Context parallelism (``cp``) splits every sequence over ``cp`` ranks that hold the same weights: to the
weights they are data-parallel replicas (gradients are reduced over the ``dp * cp`` ranks of a shard,
megatron's data-parallel group "with context parallel"), to the data they are one replica (they read the same
rows). Each sequence is cut into ``2 * cp`` chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``
(megatron's load balancing of causal attention), so a sequence length must be a multiple of
:attr:`ParallelLayout.sequence_multiple`.

The experts of a mixture-of-experts model have a mesh of their own over the same ranks, megatron's second
``RankGenerator`` (expert tensor parallel ``etp``, expert parallel ``ep``, expert data parallel ``edp``, the
same pipeline stages): expert parallelism is folded into data parallelism, since the ranks of one stage
(``tp * cp * dp`` of them) are re-split as ``etp * ep * edp``::

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))

Attention and the other dense weights follow the first mesh; the experts of EP rank ``e`` are the e-th slice
of every MoE layer's experts, split again over ``etp``. ``tests/parallel`` checks these lists against the
groups megatron actually builds.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel size that does not fit the world or the model; the message names the field."""


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the (tp, cp, dp, pp) grid."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


@dataclass(frozen=True)
class ExpertCoords:
    """Where one rank sits in the expert mesh (etp, ep, edp, pp)."""

    etp: int
    ep: int
    edp: int
    pp: int


def _require_positive(**sizes: int | None) -> None:
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """A training layout over ``world_size`` ranks: ``world_size == tp * cp * dp * pp``."""

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
    ep: int = 1
    """Expert-parallel size (megatron ``expert_model_parallel_size``): each MoE layer's experts are split into
    this many groups; EP ranks are data-parallel ranks of the dense weights."""
    etp: int | None = None
    """Expert tensor-parallel size (``expert_tensor_parallel_size``): each expert's matrices split over this
    many ranks; None = ``tp`` (megatron's default)."""
    cp: int = 1
    """Context-parallel size (megatron ``context_parallel_size``): every sequence is split over this many ranks
    (module docstring); to the weights they are data-parallel replicas."""

    def __post_init__(self) -> None:
        _require_positive(
            world_size=self.world_size,
            tp=self.tp,
            pp=self.pp,
            vpp=self.vpp,
            ep=self.ep,
            etp=self.etp,
            cp=self.cp,
        )
        if self.world_size % (self.tp * self.pp) != 0:
            raise LayoutError(
                f"world_size={self.world_size} is not divisible by tp*pp={self.tp}*{self.pp}; "
                "choose tensor_model_parallel_size and pipeline_model_parallel_size whose product divides the world"
            )
        if self.world_size % (self.tp * self.cp * self.pp) != 0:
            raise LayoutError(
                f"context_parallel_size={self.cp} does not divide world_size / (tp*pp) = "
                f"{self.world_size}/({self.tp}*{self.pp}) = {self.world_size // (self.tp * self.pp)}, the ranks "
                "that hold the same weight shard (CP x DP)"
            )
        if self.vpp is not None and self.pp < 2:
            raise LayoutError(
                f"virtual_pipeline_model_parallel_size={self.vpp} needs pipeline_model_parallel_size >= 2"
            )
        if self.sp and self.tp < 2:
            raise LayoutError("sequence_parallel=True needs tensor_model_parallel_size >= 2")
        stage = self.world_size // self.pp  # ranks per pipeline stage: tp * cp * dp = etp * ep * edp
        if stage % (self.expert_tp * self.ep):
            raise LayoutError(
                f"expert_tensor_parallel_size*expert_model_parallel_size={self.expert_tp}*{self.ep} must divide "
                f"the {stage} ranks of a pipeline stage (world_size / pipeline_model_parallel_size)"
            )

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (``etp``, defaulting to ``tp``)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: replicas of each expert shard (megatron's ``expert_data_parallel_size``)."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def dp(self) -> int:
        """Data-parallel size (replicas reading different rows), derived from the others."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def sequence_multiple(self) -> int:
        """What every sequence length (and, packed, every row's segment) must be a multiple of: ``2 * cp``
        chunks under context parallelism, each rank's share again split over TP under sequence parallelism."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sp else 1)

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world_size={self.world_size}")
        tp, cp, dp = self.tp, self.cp, self.dp
        return RankCoords(
            tp=rank % tp, dp=(rank // (tp * cp)) % dp, pp=rank // (tp * cp * dp), cp=(rank // tp) % cp
        )

    def rank(self, coords: RankCoords) -> int:
        for name, value, size in (
            ("tp", coords.tp, self.tp),
            ("cp", coords.cp, self.cp),
            ("dp", coords.dp, self.dp),
            ("pp", coords.pp, self.pp),
        ):
            if not 0 <= value < size:
                raise LayoutError(f"{name} coordinate {value} is outside size {size}")
        return coords.tp + self.tp * (coords.cp + self.cp * (coords.dp + self.dp * coords.pp))

    def _grid(self) -> list[RankCoords]:
        return [self.coords(rank) for rank in range(self.world_size)]

    def _groups(self, varying: tuple[str, ...]) -> list[list[int]]:
        """Partition of the ranks into groups whose (tp, cp, dp, pp) coordinates differ only in ``varying``;
        each group ordered by rank (megatron's order: the coordinates vary fastest-first), groups by first rank."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, c in enumerate(self._grid()):
            key = tuple(getattr(c, n) for n in ("tp", "cp", "dp", "pp") if n not in varying)
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values(), key=lambda g: g[0])

    def expert_coords(self, rank: int) -> ExpertCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world_size={self.world_size}")
        etp, ep, edp = self.expert_tp, self.ep, self.expert_dp
        return ExpertCoords(
            etp=rank % etp, ep=(rank // etp) % ep, edp=(rank // (etp * ep)) % edp, pp=rank // (etp * ep * edp)
        )

    def expert_rank(self, coords: ExpertCoords) -> int:
        etp, ep, edp = self.expert_tp, self.ep, self.expert_dp
        return coords.etp + etp * (coords.ep + ep * (coords.edp + edp * coords.pp))

    def _expert_groups(self, varying: str) -> list[list[int]]:
        """Partition of the ranks into groups whose expert coordinates differ only in ``varying``."""
        sizes = {"etp": self.expert_tp, "ep": self.ep, "edp": self.expert_dp, "pp": self.pp}
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.expert_coords(rank)
            key = tuple(getattr(c, n) for n in sizes if n != varying)
            groups.setdefault(key, []).append(rank)
        for group in groups.values():  # ordered by the varying coordinate, as megatron's groups
            group.sort(key=lambda r: getattr(self.expert_coords(r), varying))
        assert all(len(g) == sizes[varying] for g in groups.values())
        return sorted(groups.values(), key=lambda g: min(g))

    def ep_groups(self) -> list[list[int]]:
        """Ranks holding different experts of one expert-TP shard: tokens are exchanged here (all-to-all)."""
        return self._expert_groups("ep")

    def expert_tp_groups(self) -> list[list[int]]:
        """Ranks splitting the same experts' matrices."""
        return self._expert_groups("etp")

    def expert_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same expert shard: expert gradients are reduced here."""
        return self._expert_groups("edp")

    def local_experts(self, rank: int, num_experts: int) -> range:
        """Global indices of the experts rank ``rank`` holds (megatron: EP rank e holds the e-th block)."""
        per = num_experts // self.ep
        start = self.expert_coords(rank).ep * per
        return range(start, start + per)

    def tp_groups(self) -> list[list[int]]:
        """Ranks sharing one model replica's stage, split by tensor parallelism."""
        return self._groups(("tp",))

    def cp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard and splitting the same sequences: keys and values are exchanged here."""
        return self._groups(("cp",))

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard of the same stage and reading different rows (the split of a batch);
        without context parallelism also where gradients are reduced."""
        return self._groups(("dp",))

    def dp_cp_groups(self) -> list[list[int]]:
        """Every rank holding the same shard of the same stage: gradients are reduced here (megatron's
        data-parallel group "with context parallel"; :meth:`dp_groups` when ``cp == 1``)."""
        return self._groups(("cp", "dp"))

    def pp_groups(self) -> list[list[int]]:
        """One pipeline: the stages of one replica's TP shard, in stage order."""
        return self._groups(("pp",))

    def model_parallel_groups(self) -> list[list[int]]:
        """All ranks of one model replica (tp x pp; each CP rank holds its own)."""
        return self._groups(("tp", "pp"))

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
        num_experts: int | None = None,
        moe_ffn_hidden_size: int | None = None,
    ) -> None:
        """Raise :class:`LayoutError` naming the field when the model cannot be split this way."""
        self._check_experts(num_experts, moe_ffn_hidden_size)
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
        if seq_length is not None:
            self._check_sequence(seq_length)

    def _check_experts(self, num_experts: int | None, moe_ffn_hidden_size: int | None) -> None:
        """The expert-parallel sizes against the model's experts (none, or ``num_experts`` of
        ``moe_ffn_hidden_size``)."""
        if num_experts is not None and self.cp > 1:
            # megatron folds EP into DP x CP; our router taps and replay (engine/moe.py) follow tokens in the
            # order of one unsplit sequence, so CP x EP is refused rather than routed in a wrong order
            raise LayoutError(
                f"context_parallel_size={self.cp} with a mixture-of-experts model (num_experts={num_experts}) "
                "is not supported yet (expert parallelism, the router taps and actor.router_replay follow the "
                "tokens of unsplit sequences): set context_parallel_size=1"
            )
        if num_experts is None and (self.ep > 1 or self.etp is not None):
            raise LayoutError(
                "expert_model_parallel_size / expert_tensor_parallel_size are set but the model has no experts"
            )
        if num_experts is not None and num_experts % self.ep:
            raise LayoutError(
                f"num_experts={num_experts} is not divisible by expert_model_parallel_size={self.ep}"
            )
        if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % self.expert_tp:
            raise LayoutError(
                f"moe_intermediate_size={moe_ffn_hidden_size} is not divisible by "
                f"expert_tensor_parallel_size={self.expert_tp}"
            )
        if num_experts is not None and self.ep == 1 and self.expert_tp != self.tp:
            # megatron 0.16 treats experts as dense weights without EP and reduces their gradients over the
            # dense data-parallel group, which misses the ranks of an expert-TP split narrower than TP
            raise LayoutError(
                f"expert_tensor_parallel_size={self.expert_tp} differs from tensor_model_parallel_size={self.tp} "
                "with expert_model_parallel_size=1; set expert_model_parallel_size > 1 or leave "
                "expert_tensor_parallel_size unset"
            )
        if num_experts is not None and self.tp > 1 and not self.sp:
            # megatron-LM's rule: without SP every TP rank would route and dispatch the same tokens
            raise LayoutError(
                "a mixture-of-experts model with tensor_model_parallel_size > 1 needs sequence_parallel=true"
            )

    def _check_sequence(self, seq_length: int) -> None:
        """A sequence length against what sequence and context parallelism split it into."""
        if self.sp and seq_length % self.tp:
            raise LayoutError(
                f"sequence length {seq_length} is not divisible by tensor_model_parallel_size={self.tp}, "
                "which sequence_parallel requires"
            )
        if self.cp > 1 and seq_length % self.sequence_multiple:
            tp_part = f" x tensor_model_parallel_size={self.tp} (sequence_parallel)" if self.sp else ""
            raise LayoutError(
                f"sequence length {seq_length} is not divisible by 2 x context_parallel_size={self.cp}{tp_part} "
                f"= {self.sequence_multiple}: each CP rank holds 2 of 2 x {self.cp} equal chunks of every sequence"
            )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: the smallest multiple of ``divisible_by * tp`` that holds the vocab.

    Padding rows are never real tokens: log-probs must exclude them (see ``mcore_rl.ops``).
    """
    _require_positive(vocab_size=vocab_size, tp=tp, divisible_by=divisible_by)
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
