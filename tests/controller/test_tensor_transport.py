"""Tensors between the driver and Ray workers as raw bytes (``controller/tensor_transport.py``)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.controller.tensor_transport import tensor_from_wire, tensor_to_wire
from mcore_rl.engine.workers.base import Worker


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    leaf = torch.randn(3, generator=g).requires_grad_()
    return {
        "float32": base,
        "bfloat16": base.bfloat16(),
        "float16": base.half(),
        "int64": torch.randint(-(2**40), 2**40, (5, 2), generator=g),
        "int8": torch.randint(-128, 127, (7,), generator=g, dtype=torch.int8),
        "bool": base > 0,
        "complex64": torch.randn(3, dtype=torch.complex64, generator=g),
        "0-dim": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "strided slice": base[::2, 1::3],
        "requires_grad leaf": leaf,
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_round_trip_is_exact_writable_and_owns_its_memory(name: str) -> None:
    tensor = _cases()[name]
    wire = tensor_to_wire(tensor)
    assert wire[0] == "raw"  # every plain dense CPU tensor takes the byte path
    back = tensor_from_wire(wire)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert back.requires_grad == tensor.requires_grad
    assert torch.equal(back.detach(), tensor.detach())
    if back.numel():
        assert back.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        back.detach().view(-1)[0] = 0  # writable: not the read-only wire buffer


def test_conjugate_and_negative_views_keep_torch_reduction() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for view in (z.conj(), torch._neg_view(z)):
        wire = tensor_to_wire(view)
        assert wire[0] == "torch"
        assert torch.equal(tensor_from_wire(wire), view.resolve_conj().resolve_neg())


class _TransposeWorker(Worker):
    def transposed(self) -> torch.Tensor:
        """A non-contiguous tensor, made and sent by the worker."""
        return torch.arange(6, dtype=torch.float32).reshape(2, 3).t()

    def bump(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.add_(1)  # in place on the received argument


def test_driver_and_worker_both_send_tensors_as_bytes(ray_session: None) -> None:
    """torch's own reduction keeps a tensor's strides; the byte path sends its values in row-major order, so
    a transposed tensor arrives contiguous. That shows which path the sender used, on each side."""
    import ray

    from mcore_rl.controller import init_ray

    init_ray()  # already connected: registers this driver's encoding
    transposed = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    got = ray.get(ray.put(transposed))  # the driver's encoding
    assert torch.equal(got, transposed) and got.is_contiguous()
    from mcore_rl.controller.worker_group import ray_actor_class

    actor = ray.remote(ray_actor_class(_TransposeWorker)).options(num_cpus=1).remote(0, 1, 1)
    try:
        got = ray.get(
            actor.transposed.remote()
        )  # the worker's encoding (registered by the controller's Ray mixin)
        assert torch.equal(got, transposed) and got.is_contiguous()
        base = torch.zeros(3)
        assert torch.equal(ray.get(actor.bump.remote(base)), torch.ones(3))
    finally:
        ray.kill(actor)
    assert torch.equal(base, torch.zeros(3))  # the sender's tensor is untouched
