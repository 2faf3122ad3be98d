"""What a model's LoRA adapters are (``model.lora_rank``, ``lora_alpha``, ``target_modules``, ``lora_dropout``),
without torch: the config checks them here, the engine (``engine/lora.py``) builds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ALL_LINEAR = "all-linear"
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attention.linear_qkv", 0),
    "k_proj": ("self_attention.linear_qkv", 1),
    "v_proj": ("self_attention.linear_qkv", 2),
    "o_proj": ("self_attention.linear_proj", 0),
    "gate_proj": ("mlp.linear_fc1", 0),
    "up_proj": ("mlp.linear_fc1", 1),
    "down_proj": ("mlp.linear_fc2", 0),
}
"""HF projection -> (megatron module in a decoder layer, its segment of the module's output rows)."""
SEGMENTS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
"""Each adaptable megatron module's HF projections, in the order of its output rows."""
HF_MODULE = {
    p: "self_attn" if module.startswith("self_attention") else "mlp" for p, (module, _) in TARGETS.items()
}
"""HF projection -> its module in an HF decoder layer (``model.layers.{i}.self_attn.q_proj``)."""
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What LoRA adapts on a mixture-of-experts model (:func:`moe_targets_problem`)."""


@dataclass(frozen=True)
class LoRASpec:
    """The adapters of a model (``model.lora_rank``, ``lora_alpha``, ``target_modules``, ``lora_dropout``)."""

    rank: int
    """Inner dimension r of every adapter (A is [r, in], B is [out, r])."""
    alpha: float
    """The update is scaled by ``alpha / rank`` (peft's ``lora_alpha``; rsLoRA is not used)."""
    targets: tuple[str, ...]
    """HF projection names adapted in every decoder layer (keys of :data:`TARGETS`), in :data:`TARGETS`' order."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (peft's ``lora_dropout``)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"model.lora_rank={self.rank!r} must be an integer > 0")
        if not self.alpha > 0:
            raise ValueError(f"model.lora_alpha={self.alpha!r} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora_dropout={self.dropout!r} must be in [0, 1)")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"model.target_modules={list(self.targets)!r}: {_targets_problem(unknown)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self) -> list[str]:
        """The megatron modules (within a decoder layer) that carry at least one adapter."""
        return [m for m, segments in SEGMENTS.items() if any(s in self.targets for s in segments)]

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": list(self.targets),
            "dropout": self.dropout,
        }


def resolve_targets(value: str | Sequence[str], key: str = "model.target_modules") -> tuple[str, ...]:
    """``all-linear`` or a list of HF projection names -> the names, in :data:`TARGETS`' order. A name may
    carry its HF module (``self_attn.q_proj``, ``mlp.down_proj``), as peft accepts: it matches every layer's
    projection by suffix. One that adapts nothing (``mlp.q_proj``) or only some layers
    (``layers.0.self_attn.q_proj``, which peft would adapt in layer 0 alone) is refused."""
    if isinstance(value, str):
        if value != ALL_LINEAR:
            raise ValueError(f"{key}={value!r}: {_targets_problem([value])}")
        return tuple(TARGETS)
    names = [_projection(str(v)) for v in value]
    unknown = [str(v) for v, n in zip(value, names, strict=True) if n is None]
    if unknown or not names:
        raise ValueError(f"{key}={list(value)!r}: {_targets_problem(unknown)}")
    return tuple(t for t in TARGETS if t in names)


def moe_targets_problem(targets: Sequence[str], key: str = "model.target_modules") -> str | None:
    """Why ``targets`` cannot adapt a mixture-of-experts model, or None. There LoRA adapts the attention
    (its projections are the dense model's); an MLP projection would mean an adapter per expert, each routed
    a different share of the tokens, which megatron's expert layers do not carry. peft's ``all-linear`` on a
    transformers 5 MoE model adapts the attention and the router, not the (fused) experts either."""
    mlp = [t for t in targets if t not in ATTENTION_TARGETS]
    if not mlp:
        return None
    return (
        f"{key}: on a mixture-of-experts model LoRA adapts the attention only; {', '.join(mlp)} would adapt "
        f"the experts, which is not supported: set {key}=[{','.join(ATTENTION_TARGETS)}] or some of them"
    )


def _projection(name: str) -> str | None:
    """The HF projection ``name`` adapts in every decoder layer (``q_proj`` or ``self_attn.q_proj``); None for
    anything else."""
    parent, _, projection = name.rpartition(".")
    if projection not in TARGETS or parent not in ("", HF_MODULE[projection]):
        return None
    return projection


def _targets_problem(unknown: list[str]) -> str:
    what = f"{unknown[0]!r} matches no linear layer" if unknown else "no module is named"
    projection = unknown[0].rpartition(".")[2] if unknown else ""
    if projection in TARGETS:  # a path that is not where the projection lives in every layer
        where = f"{HF_MODULE[projection]}.{projection}"
        what = f"{unknown[0]!r} is not {projection} of every layer (write {projection} or {where})"
    return f"{what}; choose {ALL_LINEAR!r} or some of {list(TARGETS)} (the decoder's linear layers)"
