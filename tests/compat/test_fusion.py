"""The TE / fused-softmax switches decide by what imports: CUDA alone turns neither on.

CUDA is reported present (``torch.cuda.is_available`` patched) so that the import checks themselves run; the
modules they look for are real packages written to a temporary directory on ``sys.path``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
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


_WRITTEN = (*MASKED_SOFTMAX_MODULES, "transformer_engine", "transformer_engine.pytorch")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on ``sys.path`` for the modules a test writes; they leave ``sys.modules`` with it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {name: sys.modules.pop(name) for name in _WRITTEN if name in sys.modules}
    yield tmp_path
    for name in _WRITTEN:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


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


def _bf16_train_step(arch_seq: int) -> float:
    from mcore_rl.engine.model import ModelOptions
    from mcore_rl.engine.optim import OptimConfig
    from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext
    from tests.models import tiny_arch

    arch = tiny_arch("llama")
    # batch 2 x 4 heads, 32 tokens: the shape megatron's fused softmax takes (16 < sk <= 4096, all % 4 == 0)
    tokens = torch.randint(0, arch.vocab_size, (2, arch_seq), generator=torch.Generator().manual_seed(0))
    batch = MicroBatch(tokens, torch.arange(arch_seq).expand(2, arch_seq))
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(
            arch, ctx, ModelOptions(dtype=torch.bfloat16), OptimConfig(weight_decay=0.0, lr=1e-3)
        )
        _, out = engine.train_step(
            [batch], lambda o, mb: (o.float().square().mean(), {"loss": o.float().mean()})
        )
        return float(out[0]["loss"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_megatron_step_on_gpu_with_the_fusion_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first bf16 forward on a GPU: the switch's choice runs; forcing the fusion on without the compiled
    kernels is the ModuleNotFoundError the switch avoids (megatron-core 0.16.1 ships none of them).

    Plain causal attention runs torch's fused kernel (``compat/cpu_layers.py``) and never reaches megatron's
    softmax; explicit masks, windows and softmax variants still do, so the second half takes that path."""
    import mcore_rl.engine.model as model
    from mcore_rl.compat.cpu_layers import SdpaDotProductAttention

    assert torch.isfinite(torch.tensor(_bf16_train_step(32)))  # torch's fused attention
    monkeypatch.setattr(SdpaDotProductAttention, "_plain_causal", lambda self, *args: False)
    assert torch.isfinite(torch.tensor(_bf16_train_step(32)))  # megatron's softmax, the switch's choice
    monkeypatch.setattr(model, "masked_softmax_fusion_available", lambda use_te: True)
    if model.transformer_engine_available() or masked_softmax_fusion_available(False):
        assert torch.isfinite(torch.tensor(_bf16_train_step(32)))
    else:
        with pytest.raises(ModuleNotFoundError, match="softmax_cuda"):
            _bf16_train_step(32)
        # the failed step severed the world's connections (on NCCL it aborts the communicator), as a failing
        # rank must; the next test in this process needs a fresh world
        from mcore_rl.parallel.failure import rejoin_world

        rejoin_world()
