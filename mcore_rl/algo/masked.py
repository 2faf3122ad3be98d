"""Masked reductions shared by the RL algorithms, and the input checks at their boundary.

Every function here takes a mask of the same shape as its values: a bool or float tensor whose non-zero entries
mark the valid (response) tokens. Two rules hold throughout `mcore_rl.algo`:

* Masked-out positions never influence a result. Values there are replaced with 0 by `torch.where` *before* any
  arithmetic, so a NaN or inf left in padding (common after a fused kernel or an unpadding round trip) cannot
  leak into an output or a gradient. (`values * mask` would not do: `NaN * 0 == NaN`.)
* Arithmetic runs in float32 (float64 stays float64); bf16/fp16 inputs are upcast, and results come back in the
  computation dtype.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

import torch

# verl divides masked means by `count + 1e-8`; in float32 that equals `count` for any count >= 1, and it makes an
# empty mask give 0 instead of NaN.
_MEAN_EPS = 1e-8
# verl whitens with `(x - mean) * rsqrt(var + 1e-8)`.
_WHITEN_EPS = 1e-8

E = TypeVar("E", bound=Enum)


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype arithmetic on `tensor` runs in: float64 stays float64, everything else becomes float32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def check_shape(name: str, tensor: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> None:
    """Raise ValueError naming `name` unless `tensor.shape == shape`."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def check_mask(mask: torch.Tensor) -> torch.Tensor:
    """Validate a [B, T] response mask and return it as a bool tensor."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def parse_enum(enum_cls: type[E], value: str | E, arg_name: str) -> E:
    """`enum_cls(value)`, but an unknown name raises ValueError naming `arg_name` and listing valid names."""
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(repr(member.value) for member in enum_cls)
        raise ValueError(f"unknown {arg_name} {value!r}; valid names: {valid}") from None


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` in the computation dtype with every masked-out position set to exactly 0.

    `torch.where` routes the gradient only to the kept positions, so even NaN inputs in padding give a 0 gradient.
    """
    values = values.to(compute_dtype(values))
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` over valid positions (all of them when `dim` is None, else along `dim`)."""
    valid = zero_masked(values, mask)
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over valid positions, as verl's `masked_mean`: `sum / (count + 1e-8)`; 0 for an empty mask."""
    total = masked_sum(values, mask, dim)
    count = mask.to(total.dtype).sum() if dim is None else mask.to(total.dtype).sum(dim=dim)
    return total / (count + _MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over all valid positions (verl's `masked_var`), Bessel-corrected when `unbiased`.

    Shapes: values, mask [B, T] -> scalar. Raises ValueError for an empty mask, and for a single valid position
    when `unbiased` (the corrected variance is undefined there; verl raises too).
    """
    mask = mask.bool()
    num_valid = int(mask.sum())
    if num_valid == 0 or (unbiased and num_valid < 2):
        needed = 2 if unbiased else 1
        raise ValueError(f"masked_var needs at least {needed} valid tokens in mask, got {num_valid}")
    valid = zero_masked(values, mask)
    var = masked_mean((valid - masked_mean(valid, mask)).square(), mask)
    return var * (num_valid / (num_valid - 1)) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Standardise `values` with the mean and unbiased (Bessel) variance of its valid positions.

    Shapes: values, mask [B, T]. Returns `(x - mean) * rsqrt(var + 1e-8)` at valid positions and exactly 0 at
    masked-out ones (verl leaves the shifted value there; nothing downstream reads it). Raises ValueError when
    fewer than two positions are valid, where the unbiased variance is undefined (verl raises too).
    """
    mask = mask.bool()
    num_valid = int(mask.sum())
    if num_valid < 2:
        raise ValueError(f"masked_whiten needs at least 2 valid tokens in mask, got {num_valid}")
    valid = zero_masked(values, mask)
    whitened = (valid - masked_mean(valid, mask)) * torch.rsqrt(masked_var(valid, mask) + _WHITEN_EPS)
    return torch.where(mask, whitened, torch.zeros_like(whitened))
