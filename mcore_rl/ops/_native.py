"""Which implementation an op runs: the compiled kernels (``mcore_rl._C``) or the pure-PyTorch references.

Importing ``mcore_rl._C`` registers ``torch.ops.mcore_rl.*`` with CPU kernels (and CUDA kernels when it was
built against a CUDA torch). When the extension was not built (``MCORE_RL_NO_NATIVE=1``, or no compiler),
every op falls back to its reference in :mod:`mcore_rl.ops.reference`, which computes the same thing.

``MCORE_RL_FORCE_REFERENCE=1`` makes every op use the reference even when the extension is loaded. It is a
test-only override (read on every call, so a test can flip it with ``monkeypatch.setenv``).
"""

from __future__ import annotations

import os

import torch

_FORCE_REFERENCE_ENV = "MCORE_RL_FORCE_REFERENCE"

try:
    from mcore_rl import _C  # type: ignore[attr-defined]

    _LOAD_ERROR: str | None = None
    _WITH_CUDA = bool(_C.WITH_CUDA)
except ImportError as exc:  # not built, or built against another torch
    _LOAD_ERROR = str(exc)
    _WITH_CUDA = False

# Input dtypes the compiled kernels accept; anything else (fp64 in particular) runs the reference.
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def extension_loaded() -> bool:
    """Whether ``mcore_rl._C`` was imported, i.e. ``torch.ops.mcore_rl.*`` has kernels and schemas."""
    return _LOAD_ERROR is None


def load_error() -> str | None:
    """Why ``mcore_rl._C`` could not be imported (None when it was)."""
    return _LOAD_ERROR


def native_available() -> bool:
    """Whether ops will run the compiled kernels (built, loaded, and not overridden by the env var)."""
    return extension_loaded() and os.environ.get(_FORCE_REFERENCE_ENV, "0") != "1"


def use_native(device: torch.device, *dtypes: torch.dtype) -> bool:
    """Whether to run the compiled kernel for tensors of these dtypes on ``device``."""
    if not native_available() or any(dtype not in NATIVE_DTYPES for dtype in dtypes):
        return False
    return device.type == "cpu" or (device.type == "cuda" and _WITH_CUDA)
