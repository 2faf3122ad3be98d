"""megatron's ``PackedSeqParams`` from segment lengths: the one builder that packed micro-batches
(``packing/token_batching.py``) and context parallelism's padded segments (``context_parallel.py``) share.

It lives apart from both because the packing imports the train engine, which imports context parallelism:
either one importing the other's builder would close that loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def packed_seq_params(
    lengths: Sequence[int], *, padded: bool = False, device: torch.device | None = None
) -> Any:
    """megatron's ``PackedSeqParams`` for rows of ``lengths`` packed into one ``thd`` sequence: the rows
    attend only within themselves and positions restart per row. The cumulative lengths live on ``device``.

    ``padded``: the segments are already padded to the context-parallel multiple, so the padded and the real
    boundaries are the same (the padding is part of each row's segment); ``cu_seqlens_*_padded`` are set to
    them, since TE's CP attention reads those for the split."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32, device=device), dim=0)
    longest = max(lengths) if lengths else 0
    padded_boundaries = {"cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu} if padded else {}
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        **padded_boundaries,
    )
