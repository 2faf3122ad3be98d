"""The TE / fused-softmax switches decide by what imports: CUDA alone turns neither on.

CUDA is reported present (``torch.cuda.is_available`` patched) so that the import checks themselves run; the
modules they look for are real packages written to a temporary directory on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mcore_rl.compat.fusion import (
    MASKED_SOFTMAX_MODULES,
    masked_softmax_fusion_available,
    transformer_engine_available,
)


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [*MASKED_SOFTMAX_MODULES, "transformer_engine", "transformer_engine.pytorch"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_nothing_is_on_without_cuda() -> None:
    assert not masked_softmax_fusion_available(True)
    assert not transformer_engine_available()


def test_fused_softmax_needs_megatrons_compiled_kernels(cuda_present: None, site: Path) -> None:
    """The megatron-core wheel ships none of them: CUDA alone must not turn the fusion on."""
    assert not masked_softmax_fusion_available(False)
    assert masked_softmax_fusion_available(True)  # TE's spec brings its own softmax
    for name in MASKED_SOFTMAX_MODULES[:-1]:
        (site / f"{name}.py").write_text("")
    assert not masked_softmax_fusion_available(False)  # one kernel still missing
    (site / f"{MASKED_SOFTMAX_MODULES[-1]}.py").write_text("")
    assert masked_softmax_fusion_available(False)


def test_te_whose_pytorch_extension_fails_is_unavailable(cuda_present: None, site: Path) -> None:
    """TE's own __init__ swallows a failing ``from . import pytorch``; the top-level import then succeeds."""
    package = site / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("try:\n    from . import pytorch\nexcept ImportError:\n    pass\n")
    (package / "pytorch" / "__init__.py").write_text(
        "raise ImportError('libtransformer_engine.so: ABI mismatch')\n"
    )
    import transformer_engine  # noqa: F401  # the check the old code made: it passes

    assert not transformer_engine_available()
