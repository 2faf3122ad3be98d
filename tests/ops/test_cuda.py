"""CUDA kernels: every .cu compiles for A100 (sm_80) and H100 (sm_90) with a bare nvcc (no torch CUDA headers
needed), and, on a GPU, the CUDA ops agree with the pure-PyTorch references."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mcore_rl.ops import PackPlan, _native, reference, vocab_parallel_logprob_entropy
from mcore_rl.ops.logprob import _finalize

CUDA_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cuda"
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))
_TOOLKIT_NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
NVCC = shutil.which("nvcc") or (_TOOLKIT_NVCC if os.path.exists(_TOOLKIT_NVCC) else None)


def test_cuda_sources_include_no_torch_headers() -> None:
    # The kernels must build against CPU-only torch wheels, which ship no ATen/cuda or c10/cuda headers; only
    # ops_bindings.cpp (compiled in CUDA builds of torch only) may include them.
    assert CU_FILES
    for path in [*CU_FILES, *CUDA_DIR.glob("*.h")]:
        includes = re.findall(r'#include\s*[<"]([^>"]+)', path.read_text())
        assert not [i for i in includes if i.startswith(("ATen/", "c10/", "torch/"))], path.name


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_for_sm80_and_sm90(source: Path, tmp_path: Path) -> None:
    cmd = [NVCC, "-c", "-std=c++17", "-Werror", "all-warnings", str(source), "-o", str(tmp_path / "kernel.o")]
    cmd += ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "kernel.o").stat().st_size > 0


def _cuda_ops() -> None:
    if not _native.use_native(torch.device("cuda"), torch.float32):
        pytest.skip("mcore_rl._C is not built with CUDA kernels")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_logprob_kernels_match_reference(dtype: torch.dtype) -> None:
    _cuda_ops()
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(70, 5000, generator=gen) * 4).to(dtype)
    logits[:, 11] = float("-inf")
    targets = torch.randint(1000, 5500, (70,), generator=gen)
    targets[targets == 1011] = 1012
    args = (targets, 1000, 5500, 0.7)
    stats = torch.ops.mcore_rl.logprob_stats(logits.cuda(), targets.cuda(), *args[1:])
    # Sums over 4500 columns in a different order: fp32 rounding, not 1e-5 exact.
    torch.testing.assert_close(stats.cpu(), reference.logprob_stats(logits, *args), rtol=1e-4, atol=1e-4)
    _, _, softmax_stats = _finalize(reference.logprob_stats(logits, *args))
    g1, g2 = torch.randn(70, generator=gen), torch.randn(70, generator=gen)
    grad = torch.empty_like(logits).cuda()
    torch.ops.mcore_rl.logprob_entropy_backward(
        g1.cuda(), g2.cuda(), logits.cuda(), targets.cuda(), softmax_stats.cuda(), 1000, 5500, 0.7, grad
    )
    expected = torch.empty_like(logits)
    reference.logprob_entropy_backward(g1, g2, logits, targets, softmax_stats, 1000, 5500, 0.7, expected)
    torch.testing.assert_close(grad.cpu().float(), expected.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.gpu
def test_cuda_end_to_end_matches_cpu() -> None:
    _cuda_ops()
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 3000, generator=gen) * 3
    targets = torch.randint(0, 2990, (300,), generator=gen)
    results = []
    for device in ("cpu", "cuda"):
        x = logits.to(device, copy=True).requires_grad_()  # a fresh leaf: the CPU pass must not alias logits
        lp, ent = vocab_parallel_logprob_entropy(x, targets.to(device), vocab_start=0, vocab_size=2990)
        (lp + 0.5 * ent).sum().backward()
        results.append([t.detach().cpu() for t in (lp, ent, x.grad)])
    for cpu, gpu in zip(*results, strict=True):
        torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_pack_matches_reference() -> None:
    _cuda_ops()
    plan = PackPlan(src_tp=2, dst_tp=1, dst_rank=0)
    plan.add_qkv("qkv", num_heads=8, num_query_groups=2, head_dim=16, columns=64)
    plan.add_row_parallel("proj", rows=64, columns=128)
    gen = torch.Generator().manual_seed(2)
    # One query group per shard: (4 q heads + k + v) x 16 rows.
    sources = [torch.randn(96, 64, generator=gen) for _ in range(2)]
    sources += [torch.randn(64, 64, generator=gen) for _ in range(2)]
    expected = torch.empty(plan.numel, dtype=torch.bfloat16)
    reference.pack_copy(sources, plan.table(), expected)
    bucket = plan.pack(
        [s.cuda() for s in sources], torch.empty(plan.numel, dtype=torch.bfloat16, device="cuda")
    )
    assert torch.equal(bucket.cpu(), expected)
    restored = [torch.zeros_like(s).cuda() for s in sources]
    plan.unpack(bucket, restored)
    assert all(torch.equal(r.cpu(), s.bfloat16().float()) for r, s in zip(restored, sources, strict=True))
