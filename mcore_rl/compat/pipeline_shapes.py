"""megatron-core's shape exchange between two pipeline stages (0.16.1 and earlier: NVIDIA/Megatron-LM#5100).

With ``variable_seq_lengths`` (RL batches change length every step) each transfer between stages is preceded
by an exchange of shapes. In a pipeline group of two a stage's next and previous peer are the same rank, and
the interleaved schedule's bidirectional step posts two shape sends and two shape receives to it in one
batch, ordered ``[send_prev, recv_prev, send_next, recv_next]`` on both ranks. Point-to-point messages
between one pair of ranks meet first in, first out (NCCL and gloo alike), so one rank's ``send_prev`` met
the other's ``recv_prev``: the activation's and the gradient's shapes were crossed. Equal shapes hid it;
micro-batches of different lengths left stage 1 waiting for good (found at PP2 x VPP2 on gloo).

The replacement posts the sends as ``[next, prev]`` and the receives as ``[prev, next]``: one rank's first
send (its output, to its next stage) meets the other's first receive (from its previous stage), and the
second pair likewise. Groups of other sizes, and ring exchange, keep megatron's own exchange.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def patch_shape_exchange() -> None:
    """Install the exchange above on megatron's ``P2PCommunicator`` (idempotent; nothing on releases
    without that class)."""
    try:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    except ImportError:
        return
    original = P2PCommunicator._communicate_shapes
    if getattr(original, "_mcore_rl_patched", False):
        return

    def _communicate_shapes(
        self: Any, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool, recv_next: bool, *rest: Any
    ) -> tuple[list[int], list[int]]:
        if rest or self.next_rank != self.prev_rank or getattr(self.config, "use_ring_exchange_p2p", False):
            return original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next, *rest)
        return paired_shapes(
            self.next_rank, self.pp_group, tensor_send_next, tensor_send_prev, recv_prev, recv_next
        )

    _communicate_shapes._mcore_rl_patched = True  # type: ignore[attr-defined]
    P2PCommunicator._communicate_shapes = _communicate_shapes


def paired_shapes(
    peer: int,
    group: dist.ProcessGroup,
    send_next: torch.Tensor | None,
    send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
) -> tuple[list[int], list[int]]:
    """(shape received from the previous stage, from the next) when both are the rank ``peer``; a side not
    received is ``[0, 0, 0]``, as megatron returns it."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    ops: list[dist.P2POp] = []
    for tensor in (send_next, send_prev):  # sends: output first, then input gradient
        if tensor is not None:
            shape = torch.tensor(tensor.size(), dtype=torch.int64, device=device)
            ops.append(dist.P2POp(dist.isend, shape, peer, group))
    received = {}
    for side, wanted in (("prev", recv_prev), ("next", recv_next)):  # receives: input first, then gradient
        if wanted:
            received[side] = torch.empty(3, dtype=torch.int64, device=device)
            ops.append(dist.P2POp(dist.irecv, received[side], peer, group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        if device is not None:
            torch.cuda.synchronize()
    prev = received["prev"].tolist() if "prev" in received else [0, 0, 0]
    following = received["next"].tolist() if "next" in received else [0, 0, 0]
    return prev, following
