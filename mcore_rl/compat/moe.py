"""What megatron-core 0.16.1's mixture-of-experts layer needs to run here, each piece naming what it fixes.

1. :class:`CpuAlltoAllTokenDispatcher`: megatron's all-to-all token dispatcher creates a ``torch.cuda.Stream``
   when it is first built (for its device-to-host copies of the split sizes), so it cannot exist on a
   CPU-only torch. The all-gather dispatcher needs no stream, but it all-gathers the tokens of every EP rank
   with equal-size collectives, and EP ranks are data-parallel ranks whose RL micro-batches differ in length.
   So on CPU we keep the all-to-all dispatcher (variable splits, which gloo's all-to-all supports) and replace
   only its stream handling: on the host there is nothing to copy, the split sizes just become the lists
   ``all_to_all_single`` takes. With expert tensor parallelism the dispatcher also all-gathers (and
   reduce-scatters back) each expert-TP rank's tokens, whose counts differ; gloo's all-gather takes equal
   sizes only, so those two collectives pad to the largest count (:func:`gather_uneven`,
   :func:`reduce_scatter_uneven`). Applied by ``compat.megatron_cpu.apply`` (CPU only).
2. :func:`fix_router_gemm_without_te`: ``moe_utils`` imports ``te_general_gemm`` from Transformer Engine inside
   a ``try`` and, without TE, never defines the name, so the router's gating GEMM raises ``NameError`` on its
   first call. Setting it to None selects megatron's own ``torch.mm`` branch. Applied wherever TE is absent.
3. :func:`aux_loss_scale`: megatron attaches the load-balancing loss to the router's output with a
   backward scale that its schedule sets to 1 in per-token-loss mode (expecting its finalisation to divide by
   the global token count, which ours skips: see ``engine/train_engine.py``). Inside the context the scale is
   ``1 / global routed tokens``, so the aux term's gradient is that of the token-weighted mean of the
   per-micro-batch losses, whatever the DP / micro-batch split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_state: dict[str, Any] = {"dispatcher": False}


def _alltoall_dispatcher_class() -> Any:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return MoEAlltoAllTokenDispatcher


class _NoStream:
    """Stands in for megatron's class-level device-to-host stream, so its constructor creates none."""


class CpuAlltoAllTokenDispatcher(_alltoall_dispatcher_class()):  # type: ignore[misc]
    """megatron's all-to-all dispatcher with host-side split sizes instead of a CUDA side stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        base = _alltoall_dispatcher_class()
        if base.cuda_dtoh_stream is None:
            base.cuda_dtoh_stream = _NoStream()
        super().__init__(*args, **kwargs)

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: Any = None) -> Any:
        # megatron moves these to the host at its "dtoh point" (asynchronously on GPU) as numpy arrays, the form
        # its collectives and later ``.tolist()`` calls take; here they are on the host already
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert


def _padded_gather(x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    """Rows of every rank (``sizes[r]`` from rank r), concatenated in rank order, via an equal-size gather."""
    import torch.distributed as dist

    longest = max(sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def _summed_slice(x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    """This rank's rows of the sum over ranks of ``x`` (rows ordered by rank, ``sizes[r]`` each)."""
    import torch.distributed as dist

    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    rank = dist.get_rank(group)
    start = sum(sizes[:rank])
    return total[start : start + sizes[rank]]


class _GatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        return _padded_gather(x, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _summed_slice(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
        ctx.group, ctx.sizes = group, sizes
        return _summed_slice(x, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _padded_gather(grad, ctx.group, ctx.sizes), None, None


def gather_uneven(x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    """All-gather along dim 0 with per-rank row counts ``sizes``; backward: the matching reduce-scatter."""
    return _GatherUneven.apply(x, group, list(sizes))


def reduce_scatter_uneven(x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    """Sum over ranks, each keeping its ``sizes[rank]`` rows (in rank order); backward: the all-gather."""
    return _ReduceScatterUneven.apply(x, group, list(sizes))


def _dispatcher_gather(original: Any) -> Any:
    def gather(
        x: Any,
        tensor_parallel_output_grad: bool = True,
        group: Any = None,
        output_split_sizes: Any = None,
        use_global_buffer: bool = False,
    ) -> Any:
        if output_split_sizes is None:
            return original(x, tensor_parallel_output_grad, group, None, use_global_buffer)
        return gather_uneven(x, group, list(output_split_sizes))

    return gather


def _dispatcher_reduce_scatter(original: Any) -> Any:
    def reduce_scatter(
        x: Any, group: Any = None, input_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> Any:
        if input_split_sizes is None:
            return original(x, group, None, use_global_buffer)
        return reduce_scatter_uneven(x, group, list(input_split_sizes))

    return reduce_scatter


def patch_cpu_dispatcher() -> None:
    """The MoE layer builds :class:`CpuAlltoAllTokenDispatcher` where it would build megatron's, and the
    dispatchers' uneven gathers pad for gloo (CPU only)."""
    if _state["dispatcher"]:
        return
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    moe_layer.MoEAlltoAllTokenDispatcher = CpuAlltoAllTokenDispatcher
    token_dispatcher.gather_from_sequence_parallel_region = _dispatcher_gather(
        token_dispatcher.gather_from_sequence_parallel_region
    )
    token_dispatcher.reduce_scatter_to_sequence_parallel_region = _dispatcher_reduce_scatter(
        token_dispatcher.reduce_scatter_to_sequence_parallel_region
    )
    _state["dispatcher"] = True


def fix_router_gemm_without_te() -> None:
    """Define ``moe_utils.te_general_gemm`` (as None) when Transformer Engine is absent; see the docstring."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Within the block, megatron's MoE aux-loss backward scale is ``scale`` times what its schedule sets."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.set_loss_scale

    def scaled(loss_scale: torch.Tensor) -> None:
        original(loss_scale * scale)

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(scaled)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(original)


def router_token_shards(tp: int, cp: int) -> int:
    """What megatron's per-token router losses leave out before megatron-core 0.19: each TP (sequence-parallel)
    and CP rank's router multiplies its losses by its *own* tokens, a ``tp * cp``-th of the micro-batch's,
    so their gradients came out that many times too small at TP > 1 (megatron's #5047 multiplies by
    ``tp_cp_group.size()`` from 0.19 on). 1 where megatron does it itself."""
    from megatron.core import package_info

    major, minor = (int(part) for part in package_info.__version__.split(".")[:2])
    return 1 if (major, minor) >= (0, 19) else tp * cp
