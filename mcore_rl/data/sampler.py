"""Deterministic epoch order with a position that saves and restores exactly (for resume).

The order of epoch ``e`` is a permutation drawn from ``seed`` and ``e`` alone, so a restored sampler does
not need the RNG state, only ``(epoch, position)``: the next batch after a restore is the one the
uninterrupted run would have drawn. The dataset's fingerprint and size are saved with it, and a resume
against different data is refused with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.data.rows import DataError


class EpochSampler:
    """Batches of dataset indices: every epoch visits each index once (the last partial batch dropped
    when ``drop_last``), in a fresh order per epoch when ``shuffle``."""

    def __init__(
        self, num_items: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool, fingerprint: str
    ) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            # e.g. DataConfig built in Python and never resolved: its seed is still "${trainer.seed}"
            raise TypeError(f"seed must be an int, got {seed!r} (resolve configs with check_config)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if num_items < (batch_size if drop_last else 1):
            raise DataError(
                f"{num_items} items cannot fill one batch of {batch_size} (data.train_batch_size) "
                "with drop_last"
            )
        self.num_items, self.batch_size = num_items, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.fingerprint = fingerprint
        self.epoch = 0
        """Epochs completed before the current one."""
        self.position = 0
        """Indices of the current epoch's order already handed out."""
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its order): one permutation per epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (0 if self.drop_last or not rest else 1)

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_items, generator=generator).tolist()

    def next_indices(self) -> list[int]:
        left = self.num_items - self.position
        if left == 0 or (self.drop_last and left < self.batch_size):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position
        self.position = min(start + self.batch_size, self.num_items)
        if self._order[0] != self.epoch:
            self._order = (self.epoch, self.order(self.epoch))
        return self._order[1][start : self.position]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_items": self.num_items,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; refuse a state saved for other data or another order."""
        for key in ("fingerprint", "num_items", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"cannot resume the data position: the saved {key} is {state.get(key)!r}, this run has "
                    f"{getattr(self, key)!r} (the dataset or its order changed)"
                )
        if not 0 <= state["position"] <= self.num_items or state["epoch"] < 0:
            raise DataError(f"saved data position {state['epoch']}:{state['position']} is out of range")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
