"""Parallel layouts (pure rank math) and the ParallelContext that owns the process groups."""

from mcore_rl.parallel.layout import LayoutError, ParallelLayout, RankCoords, padded_vocab_size

__all__ = ["LayoutError", "ParallelLayout", "RankCoords", "padded_vocab_size"]
