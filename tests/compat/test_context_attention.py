"""Causal attention under context parallelism (``compat/context_attention.py``), pure: every CP rank's share
against a plain fp64 attention, forward and backward, padded and packed, with and without a sliding window;
the chunk order against megatron's own split."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.compat.context_attention import (
    context_attention,
    local_token_index,
    natural_order,
    pos_emb_on_this_cp_rank,
    reference_attention,
)

CASES = {  # name -> (cp, rows b, segments, window)
    "cp2-padded": (2, 2, [16], None),
    "cp2-packed": (2, 1, [8, 12, 4, 8], None),
    "cp3-packed-window": (3, 1, [12, 6, 18], 4),
    "cp4-padded-window": (4, 2, [32], 6),
}


class _Group:
    """What megatron's split reads of a CP group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _inputs(b: int, total: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = [(b, 4, total, 8), (b, 2, total, 8), (b, 2, total, 8)]  # 4 heads over 2 KV groups (GQA)
    return [
        torch.randn(s, generator=generator, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_matches_fp64_attention_forward_and_backward(case):
    cp, b, segments, window = CASES[case]
    total, scale = sum(segments), 8**-0.5
    q, k, v = _inputs(b, total, torch.float32)
    rq, rk, rv = _inputs(b, total, torch.float64)
    grad = torch.randn(b, 4, total, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = reference_attention(rq, rk, rv, segments, scale, window)
    (reference * grad).sum().backward()
    loss = torch.zeros((), dtype=torch.float64)
    for rank in range(cp):
        held = local_token_index(segments, cp, rank)
        out = context_attention(q[:, :, held], k, v, segments, cp, rank, scale, window)
        torch.testing.assert_close(out.double(), reference[:, :, held].detach(), atol=1e-5, rtol=0)
        loss = loss + (out.double() * grad[:, :, held]).sum()
    loss.backward()  # the ranks' shares together: every K / V gradient summed over the ranks that read it
    for ours, theirs in ((q, rq), (k, rk), (v, rv)):
        assert ours.grad is not None and theirs.grad is not None
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=1e-5, rtol=0)


def test_the_window_and_the_chunk_order_matter():
    # the oracle distinguishes what the test checks: a window changes the output, and a rank's queries read
    # against the wrong chunk positions do not match
    q, k, v = _inputs(1, 16, torch.float64)
    full = reference_attention(q, k, v, [16], 1.0)
    assert not torch.allclose(full, reference_attention(q, k, v, [16], 1.0, window=3))
    held = local_token_index([16], 2, 0)
    swapped = context_attention(q[:, :, held], k, v, [16], 2, 1, 1.0)  # rank 0's queries as if rank 1's
    assert not torch.allclose(swapped, full[:, :, held])


@pytest.mark.parametrize("cp", [2, 4])
def test_the_split_is_megatrons(cp, monkeypatch):
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(
        torch.distributed, "is_initialized", lambda: True
    )  # megatron reads the group only then

    tokens = torch.arange(3 * 8 * cp).view(3, 8 * cp)
    emb = torch.arange(8 * cp, dtype=torch.float32).view(8 * cp, 1, 1, 1)
    for rank in range(cp):
        theirs = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, _Group(cp, rank))["tokens"]
        assert torch.equal(tokens[:, local_token_index([8 * cp], cp, rank)], theirs)
        angles = pos_emb_on_this_cp_rank(emb, 0, _Group(cp, rank))
        assert angles.flatten().long().tolist() == local_token_index([8 * cp], cp, rank).tolist()
    order = natural_order([8 * cp, 4 * cp], cp)
    gathered = torch.cat([local_token_index([8 * cp, 4 * cp], cp, r) for r in range(cp)])
    assert gathered[order].tolist() == list(range(12 * cp))


def test_a_segment_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="2 x context_parallel_size=2"):
        local_token_index([8, 6], 2, 0)
