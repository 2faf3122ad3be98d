"""megatron-core's first import in a CPU process, without the two libraries it loads for nothing there.

``import megatron.core`` takes 10-13 s of a 2-core machine, paid by every rank, ``mcore-rl`` command and
Ray worker that builds a model. A third of it is not megatron's own code:

* its fusions (``megatron.core.jit.jit_fuser``: fused bias-GeLU/GeGLU/SwiGLU, bias-dropout-add, the fused
  cross-entropy, the MoE router's and ~30 more) are ``torch.compile``d as they are defined, and the first
  decoration loads dynamo's inductor backend (~3 s). They are fusions of CUDA kernels; on CPU our layers
  fill the SwiGLU slot (``compat.cpu_layers``), the bias-dropout and rotary fusions are off
  (``engine/model.py``), and what is left runs as the plain PyTorch functions, megatron's own
  ``disable_jit_fuser()`` (its choice where ``torch.compile`` is missing): no C++ compile of a few
  elementwise ops in the first step of every rank. The functions ``megatron.core``'s import defines are
  decorated before that switch can be called, so dynamo is disabled while they are.
* its dynamic inference context imports ``wandb`` when installed (~1.5 s), only to log its own inference
  engine's statistics, which we do not use. The run's own tracker (``logs/trackers.py``) imports wandb
  when ``logging.wandb`` asks for it, unaffected: the import is hidden only while megatron's runs.

Both are scoped to that one import: ``torch.compile`` called afterwards (vLLM's CPU build compiles its model)
compiles as before. With CUDA, megatron is imported as it is, fusions compiled.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

DYNAMO_DISABLE_VARIABLE = "TORCHDYNAMO_DISABLE"
"""Read by ``torch._dynamo.eval_frame._optimize`` at each ``torch.compile`` decoration: "1" returns the
function undecorated, before the backend is looked up (and imported)."""
UNUSED_AT_IMPORT = ("wandb",)
"""Optional libraries megatron's import picks up only to serve code paths we do not run."""


@contextlib.contextmanager
def _environment_variable(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def _hidden_modules(names: tuple[str, ...]) -> Iterator[None]:
    """``import name`` raises ImportError inside (a ``None`` entry in ``sys.modules``); a module imported
    before stays visible, and every hidden name is importable again after."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def import_megatron_core() -> ModuleType:
    """``megatron.core``; on CPU with its fusions plain functions (those of modules imported later too),
    imported the first time without loading inductor or wandb."""
    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu and "megatron.core" not in sys.modules:
        with _environment_variable(DYNAMO_DISABLE_VARIABLE, "1"), _hidden_modules(UNUSED_AT_IMPORT):
            import megatron.core
    import megatron.core

    if on_cpu:
        from megatron.core import jit

        jit.disable_jit_fuser()  # read by each megatron module as it is imported: the ones imported from now on
    return megatron.core
