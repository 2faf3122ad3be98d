"""Fused log-prob + entropy (single shard): agreement with the fp64 naive path, gradients, padding,
temperature, chunking, masked logits, the fused linear variant, and opcheck."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.ops import _native, linear_logprob_entropy, reference, vocab_parallel_logprob_entropy


def _problem(n: int, v: int, *, seed: int = 0, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
    return logits, torch.randint(0, v, (n,), generator=gen)


def _oracle(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float, g1, g2):
    """fp64 values and d(g1.logprob + g2.entropy)/dlogits by autograd of the naive path."""
    x = logits.detach().double().requires_grad_()
    lp, ent = reference.naive_logprob_entropy(x, targets, vocab_size=vocab_size, temperature=temperature)
    (lp * g1.double() + ent * g2.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def _run(logits: torch.Tensor, targets: torch.Tensor, g1, g2, **kwargs):
    x = logits.detach().clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy(x, targets, vocab_start=0, **kwargs)
    (lp * g1 + ent * g2).sum().backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fp32_matches_fp64_naive_path_values_and_grads(impl: str, temperature: float) -> None:
    logits, targets = _problem(67, 1500)
    g1, g2 = torch.randn(67), torch.randn(67)
    lp, ent, grad = _run(
        logits.float(), targets, g1, g2, vocab_size=1500, temperature=temperature, chunk_size=16
    )
    lp0, ent0, grad0 = _oracle(logits.float(), targets, 1500, temperature, g1, g2)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent0, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), grad0, rtol=0, atol=1e-5)


def test_bf16_inputs(impl: str) -> None:
    logits, targets = _problem(40, 2100, seed=1)
    x = logits.bfloat16()
    g1, g2 = torch.randn(40), torch.randn(40)
    lp, ent, grad = _run(x, targets, g1, g2, vocab_size=2100, temperature=0.8)
    # The oracle sees the same bf16-rounded logits, so only the kernel's own error is measured: values are
    # fp32 (held to 1e-5); the gradient is rounded to bf16 like its input (held to bf16 precision, 2e-2).
    lp0, ent0, grad0 = _oracle(x, targets, 2100, 0.8, g1, g2)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent0, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), grad0, rtol=2e-2, atol=1e-6)


def test_padding_columns_are_ignored(impl: str) -> None:
    logits, targets = _problem(30, 1000, seed=2)
    padded = torch.cat([logits, torch.full((30, 24), 50.0, dtype=torch.float64)], dim=1).float()
    g1, g2 = torch.randn(30), torch.randn(30)
    lp, ent, grad = _run(padded, targets, g1, g2, vocab_size=1000)
    lp0, ent0, grad0 = _oracle(logits.float(), targets, 1000, 1.0, g1, g2)
    torch.testing.assert_close(lp.double(), lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent0, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad[:, :1000].double(), grad0, rtol=0, atol=1e-5)
    assert torch.count_nonzero(grad[:, 1000:]) == 0


@pytest.mark.parametrize("n", [1, 7, 8, 9, 33])
def test_chunk_boundaries_do_not_change_results(impl: str, n: int) -> None:
    logits, targets = _problem(n, 300, seed=n)
    g1, g2 = torch.randn(n), torch.randn(n)
    whole = _run(logits.float(), targets, g1, g2, vocab_size=300, chunk_size=1024)
    chunked = _run(logits.float(), targets, g1, g2, vocab_size=300, chunk_size=8)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_leading_dims_and_masked_logits(impl: str) -> None:
    logits, targets = _problem(2 * 5, 2500, seed=3)
    targets[targets == 7] = 8
    logits[:, 7] = float("-inf")  # a banned token: p = 0, and no NaN in the value or the gradient
    x, t = logits.float().view(2, 5, 2500), targets.view(2, 5)
    g1, g2 = torch.randn(2, 5), torch.randn(2, 5)
    lp, ent, grad = _run(x, t, g1, g2, vocab_size=2500)
    # Oracle: the same problem with the banned column removed.
    kept = torch.cat([logits[:, :7], logits[:, 8:]], dim=1).float()
    lp0, ent0, grad0 = _oracle(
        kept, targets - (targets > 7).long(), 2499, 1.0, g1.reshape(-1), g2.reshape(-1)
    )
    assert lp.shape == ent.shape == (2, 5)
    torch.testing.assert_close(lp.reshape(-1).double(), lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.reshape(-1).double(), ent0, rtol=0, atol=1e-5)
    grad = grad.reshape(10, 2500)
    assert torch.isfinite(grad).all() and torch.count_nonzero(grad[:, 7]) == 0
    torch.testing.assert_close(
        torch.cat([grad[:, :7], grad[:, 8:]], dim=1).double(), grad0, rtol=0, atol=1e-5
    )


def test_entropy_of_peaked_distribution_has_tiny_absolute_error(impl: str) -> None:
    # One logit 40 above the rest: H ~ 1e-13. verl's lse - sum p z subtracts two numbers ~40 and, in fp32,
    # returns noise of ~1e-6; log s + |w| / s adds two non-negative terms and stays within ~1e-15.
    logits = torch.zeros(3, 500)
    logits[:, 0] = 40.0
    targets = torch.zeros(3, dtype=torch.long)
    _, ent = vocab_parallel_logprob_entropy(logits, targets, vocab_start=0, vocab_size=500)
    log_p = torch.log_softmax(logits.double(), -1)
    expected = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(ent.double(), expected, rtol=0.05, atol=1e-14)


def test_invalid_targets_raise(impl: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match="outside"):
        vocab_parallel_logprob_entropy(
            torch.zeros(2, 10), torch.tensor([0, -100]), vocab_start=0, vocab_size=10
        )
    with pytest.raises((ValueError, RuntimeError), match="outside"):
        vocab_parallel_logprob_entropy(
            torch.zeros(2, 12), torch.tensor([0, 10]), vocab_start=0, vocab_size=10
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_variant_matches_unfused_path(impl: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(21, 32, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(1030, 32, generator=gen) / 3).to(dtype).requires_grad_()  # 6 padding rows
    targets = torch.randint(0, 1024, (21,), generator=gen)
    g1, g2 = torch.randn(21), torch.randn(21)
    lp, ent = linear_logprob_entropy(
        hidden, weight, targets, vocab_start=0, vocab_size=1024, temperature=0.9, vocab_chunk_size=300
    )
    (lp * g1 + ent * g2).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    lp0, ent0 = reference.naive_logprob_entropy(h64 @ w64.T, targets, vocab_size=1024, temperature=0.9)
    (lp0 * g1.double() + ent0 * g2.double()).sum().backward()
    # bf16: logits are produced by a bf16 matmul, as in the unfused model, so allow bf16 precision.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lp.double(), lp0.detach(), rtol=0, atol=tol * max(1.0, lp0.abs().max().item()))
    torch.testing.assert_close(ent.double(), ent0.detach(), rtol=0, atol=tol * 10)
    # The input gradients come out of bf16 GEMMs whose accumulation order is the BLAS library's (it varies with
    # its blocking and threads): one element in a full-suite run was 0.037 off at |g| < 1, so bf16 gets 5e-2.
    grad_tol = tol if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=grad_tol, atol=grad_tol)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=grad_tol, atol=grad_tol)
    assert torch.count_nonzero(weight.grad[1024:]) == 0


@pytest.mark.parametrize("vocab", [1, 3, 7, 9, 15, 2049, 2055, 4103])
def test_the_last_columns_of_a_block_count(impl: str, vocab: int) -> None:
    """Vocab sizes that leave under one SIMD vector of columns at the end of a 2048-column block, the largest
    logit among them: the kernel left those columns out of the block's maximum (a row of 3 columns came out
    +inf / NaN, a 1-column last block was dropped from the softmax, a leading tail logit overflowed exp)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen, dtype=torch.float64)
    logits[0, -1] = 10.0  # the target leads by a little
    logits[1, -1] = 100.0  # leads by more than exp's fp32 range
    logits[2, (vocab - 1) // 2] = 40.0  # a peak elsewhere with a tail target
    targets = torch.tensor([vocab - 1, vocab - 1, vocab - 1, 0])
    g1, g2 = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    lp, ent, grad = _run(logits.float(), targets, g1, g2, vocab_size=vocab, temperature=0.5)
    lp0, ent0, grad0 = _oracle(logits.float(), targets, vocab, 0.5, g1, g2)
    torch.testing.assert_close(lp.double(), lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent0, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), grad0, rtol=0, atol=1e-5)


def test_a_one_column_last_vocab_chunk_of_the_linear_op_counts(impl: str) -> None:
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(6, 16, generator=gen), torch.randn(4097, 16, generator=gen) / 2
    weight[4096] = hidden[0] * 2  # the last vocab row leads row 0's logits
    targets = torch.tensor([4096, 4096, 1, 2, 3, 4])
    lp, ent = linear_logprob_entropy(hidden, weight, targets, vocab_start=0, vocab_size=4097)
    lp0, ent0 = reference.naive_logprob_entropy(hidden.double() @ weight.double().T, targets, vocab_size=4097)
    torch.testing.assert_close(lp.double(), lp0, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent.double(), ent0, rtol=0, atol=1e-4)


def test_fp64_inputs_run_the_reference_in_fp64() -> None:
    logits, targets = _problem(5, 100)
    lp, ent = vocab_parallel_logprob_entropy(logits, targets, vocab_start=0, vocab_size=100)
    lp0, ent0 = reference.naive_logprob_entropy(logits, targets, vocab_size=100)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, lp0, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent0, rtol=0, atol=1e-12)


def test_opcheck_composite_ops(impl: str) -> None:
    logits, targets = _problem(9, 70, seed=5)
    x = logits.float().requires_grad_()
    torch.library.opcheck(
        torch.ops.mcore_rl.vocab_parallel_logprob_entropy.default, (x, targets, 0, 64, 1.25, 4, None)
    )
    h, w = torch.randn(9, 8, requires_grad=True), torch.randn(70, 8, requires_grad=True)
    for keep_chunks in (0, 1, 2):  # every chunk recomputed in the backward; one kept; both kept
        torch.library.opcheck(
            torch.ops.mcore_rl.linear_logprob_entropy.default,
            (h, w, targets % 64, 0, 64, 1.0, 32, None, keep_chunks),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit(impl: str, dtype: torch.dtype) -> None:
    """``keep_logits_bytes``: the forward keeps its leading vocab chunks' logits for the backward, which skips
    their GEMM and recomputes only the rest; log-probs, entropy and both gradients are the same bits for no
    chunk kept, some (a budget between chunk boundaries) and all. Without a gradient nothing is kept."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(21, 32, generator=gen).to(dtype)
    weight = (torch.randn(1030, 32, generator=gen) / 3).to(dtype)  # 6 padding rows: chunks 300, 300, 300, 124
    targets = torch.randint(0, 1024, (21,), generator=gen)
    g1, g2 = torch.randn(21, generator=gen), torch.randn(21, generator=gen)
    row_bytes = 21 * hidden.element_size()
    results = []
    for budget in (0, 450 * row_bytes, 1024 * row_bytes, 10**9):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = linear_logprob_entropy(
            h, w, targets, vocab_start=0, vocab_size=1024, vocab_chunk_size=300, keep_logits_bytes=budget
        )
        (lp * g1 + ent * g2).sum().backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for other in results[1:]:
        for mine, theirs in zip(results[0], other, strict=True):
            assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="keep_logits_bytes"):
        linear_logprob_entropy(hidden, weight, targets, vocab_start=0, vocab_size=1024, keep_logits_bytes=-1)


def test_logits_are_kept_only_for_a_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op is asked to keep chunks only where a backward will read them, and as many whole chunks as the
    budget holds."""
    import mcore_rl.ops.logprob as logprob

    asked: list[int] = []
    op = logprob._linear_logprob_entropy_op

    def spy(*args: object) -> object:
        asked.append(int(args[-1]))  # type: ignore[call-overload]
        return op(*args)

    monkeypatch.setattr(logprob, "_linear_logprob_entropy_op", spy)
    hidden, weight, targets = torch.randn(4, 8), torch.randn(100, 8), torch.randint(0, 100, (4,))
    budget = 70 * 4 * 4  # 70 columns of 4 fp32 rows: chunks of 32 -> two whole ones
    kwargs = {"vocab_start": 0, "vocab_size": 100, "vocab_chunk_size": 32, "keep_logits_bytes": budget}
    linear_logprob_entropy(hidden, weight, targets, **kwargs)  # no tensor needs a gradient
    linear_logprob_entropy(hidden, weight.requires_grad_(), targets, **kwargs)
    with torch.no_grad():
        linear_logprob_entropy(hidden, weight, targets, **kwargs)
    assert asked == [0, 2, 0]


def test_the_kept_logits_get_no_zero_gradient_of_their_size() -> None:
    """The kept logits are an output no loss reads: autograd used to hand the backward a zero gradient for
    them, a second block of their size zeroed at every backward (up to ``model.keep_logits_gib``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargeResults(TorchDispatchMode):
        def __init__(self, at_least: int) -> None:
            super().__init__()
            self.at_least, self.seen = at_least, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() >= self.at_least and "zero" in str(func):
                self.seen.append(str(func))
            return out

    hidden, weight = torch.randn(64, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (64,))
    kwargs = {"vocab_start": 0, "vocab_size": 300, "vocab_chunk_size": 64, "keep_logits_bytes": 1 << 30}
    lp, _ = linear_logprob_entropy(hidden, weight, targets, **kwargs)  # all five chunks kept
    with LargeResults(at_least=64 * 300) as spy:
        lp.sum().backward()
    assert spy.seen == []
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_head_gets_no_weight_gradient_work(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """LoRA freezes the output layer: the backward then neither allocates a [vocab, hidden] gradient nor runs
    its GEMM per chunk (a third of the head's backward), and the hidden gradient is the trainable head's."""
    import mcore_rl.ops.logprob as logprob

    gen = torch.Generator().manual_seed(7)
    hidden0 = torch.randn(9, 16, generator=gen).to(dtype)
    weight0 = (torch.randn(300, 16, generator=gen) / 3).to(dtype)
    targets, g1, g2 = torch.randint(0, 300, (9,), generator=gen), torch.randn(9), torch.randn(9)
    kwargs = {"vocab_start": 0, "vocab_size": 300, "vocab_chunk_size": 64}
    products: list[tuple[int, ...]] = []
    gemm, mm = logprob.gemm_into, torch.Tensor.__matmul__

    def counted_gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
        products.append(tuple(out.shape))
        gemm(out, a, b, accumulate)

    def counted_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = mm(a, b)
        products.append(tuple(out.shape))
        return out

    monkeypatch.setattr(logprob, "gemm_into", counted_gemm)
    monkeypatch.setattr(torch.Tensor, "__matmul__", counted_mm)
    grads, weight_products = [], []
    for trainable in (True, False):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_(trainable)
        lp, ent = linear_logprob_entropy(hidden, weight, targets, **kwargs)
        products.clear()
        (lp * g1 + ent * g2).sum().backward()
        grads.append(hidden.grad)
        weight_products.append(sum(1 for shape in products if shape[-1] == 16 and shape[0] != 9))
        assert (weight.grad is not None) == trainable
    assert weight_products == [5, 0]  # one per vocab chunk of 64 rows, none when frozen
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_native_kernels(dtype: torch.dtype) -> None:
    logits, targets = _problem(6, 50, seed=6)
    x = logits.to(dtype)
    torch.library.opcheck(torch.ops.mcore_rl.logprob_stats.default, (x, targets % 40, 10, 40, 0.5))
    stats = torch.randn(6, 2)
    args = (torch.randn(6), torch.randn(6), x, targets % 40, stats, 10, 40, 0.5, torch.empty_like(x))
    torch.library.opcheck(torch.ops.mcore_rl.logprob_entropy_backward.default, args)


@pytest.mark.skipif(not _native.extension_loaded(), reason="mcore_rl._C is not built")
def test_native_kernels_match_their_references() -> None:
    logits, targets = _problem(13, 5000, seed=7)  # several 2048-column blocks, ragged tail
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        native = torch.ops.mcore_rl.logprob_stats(x, targets, 1000, 5500, 0.7)
        ref = reference.logprob_stats(x, targets, 1000, 5500, 0.7)
        torch.testing.assert_close(native, ref, rtol=1e-5, atol=1e-5)


def test_the_linear_op_projects_real_vocab_rows_only() -> None:
    """megatron pads the vocab (1000 -> 1024 at TP1): no GEMM of the fused LM-head op reaches a padding row."""
    from mcore_rl.ops.logprob import vocab_chunks

    assert vocab_chunks(1024, 0, 1000, 1024) == [(0, 1000)]
    assert vocab_chunks(1024, 0, 1000, 300) == [(0, 300), (300, 600), (600, 900), (900, 1000)]
    assert vocab_chunks(512, 512, 1000, 512) == [(0, 488)]  # the last TP2 shard: 488 real rows
    assert vocab_chunks(512, 1024, 1000, 512) == []  # a shard of padding only
