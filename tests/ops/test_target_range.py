"""Out-of-range targets are refused on every device: the CUDA kernel would return NaN where the CPU one raises,
so the Python side checks them before launching it (the same words as the CPU kernel)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.ops import vocab_parallel_logprob_entropy
from mcore_rl.ops.logprob import check_targets


@pytest.mark.parametrize("bad", [-100, 250])
def test_check_refuses_what_the_cpu_kernel_refuses(bad: int) -> None:
    targets = torch.tensor([3, bad, 7])
    with pytest.raises(ValueError, match=rf"target id {bad} of row 1 is outside \[0, vocab_size=250\)"):
        check_targets(targets, 250)
    with pytest.raises((ValueError, RuntimeError), match=r"outside \[0, vocab_size=250\)"):
        vocab_parallel_logprob_entropy(torch.randn(3, 250), targets, vocab_start=0, vocab_size=250)


def test_check_passes_real_ids_and_empty_batches() -> None:
    check_targets(torch.tensor([0, 249]), 250)
    check_targets(torch.empty(0, dtype=torch.long), 250)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_refuses_instead_of_returning_nan() -> None:
    targets = torch.tensor([3, -100, 7], device="cuda")
    with pytest.raises(ValueError, match=r"target id -100 of row 1"):
        vocab_parallel_logprob_entropy(
            torch.randn(3, 250, device="cuda"), targets, vocab_start=0, vocab_size=250
        )
