"""CPU tensors between the driver and Ray workers as raw bytes.

Ray pickles a ``torch.Tensor`` through torch's own reduction: every tensor becomes a small ``torch.save``
archive, read back with ``torch.load``. That costs about 0.1-0.2 ms per tensor on each side, and an RL step
moves a few dozen small tensors (rollout batch out, train batch in, log-probs and stats back): 3 ms of a
0.26 s step on 2 CPU cores, all of it on the critical path between the driver and the workers.

Here a dense CPU tensor travels as its dtype, shape and one uint8 numpy view of its bytes, which Ray's
pickle-5 path sends out of band (straight into the task or the object store). The receiver copies the bytes
into a tensor of its own. Ray also ships a zero-copy reducer (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``). It
is not used here: its tensors alias the read-only object-store buffer, so one in-place op on a received
batch would corrupt the stored object or fault, while the copy costs microseconds at these sizes.

Anything else, such as a CUDA, sparse or quantized tensor or a tensor with the conjugate or negative bit,
travels as torch's own ``torch.save`` archive (read back with ``weights_only=True``), restored where torch
restores it. A ``Parameter`` or another subclass is not ``torch.Tensor`` itself, so Ray never routes it
here.
"""

from __future__ import annotations

import io
from typing import Any

import torch

_RAW, _TORCH = "raw", "torch"


def tensor_to_wire(tensor: torch.Tensor) -> tuple[Any, ...]:
    """``tensor`` as ``('raw', dtype name, shape, requires_grad, uint8 array)`` or, when it is not a plain
    dense CPU tensor, ``('torch', torch.save bytes)``."""
    plain = (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )
    if not plain:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return (_TORCH, buffer.getvalue())
    flat = tensor.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy()
    return (_RAW, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.requires_grad, data)


def tensor_from_wire(wire: tuple[Any, ...]) -> torch.Tensor:
    """The tensor :func:`tensor_to_wire` encoded, in memory of its own (writable, not the sender's buffer)."""
    if wire[0] == _TORCH:
        return torch.load(io.BytesIO(wire[1]), weights_only=True)
    _, dtype_name, shape, requires_grad, data = wire
    dtype = getattr(torch, dtype_name)
    if data.size == 0:  # torch cannot view an empty byte array as another dtype
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.from_numpy(data.copy()).view(dtype).reshape(shape)
    return tensor.requires_grad_() if requires_grad else tensor


def register_tensor_transport() -> None:
    """Use this module's encoding for ``torch.Tensor`` in this process's Ray serialization context: the
    driver and every worker register it (each process has its own context). A no-op without Ray."""
    import ray

    if ray.is_initialized():
        ray.util.register_serializer(torch.Tensor, serializer=tensor_to_wire, deserializer=tensor_from_wire)
