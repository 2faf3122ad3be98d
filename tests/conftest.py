from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from tests.distributed import PoolRegistry

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# After the -m / -k deselection, so that only the tests that run decide which modules use Ray.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _run_ray_modules_last(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _run_ray_modules_last(items: list[pytest.Item]) -> None:
    """The modules that use ``ray_session`` run last, one after another, so that they share one local Ray.

    A start is gcs, raylet and five Python daemons (the dashboard's API server among them, even with
    ``include_dashboard=False``): ~3.5 s of a quiet 2-core machine, several times that beside other load, once
    per module before. The sort is stable: each module's tests stay together and in order, and so do the
    modules of each group."""
    on_ray = {item.path for item in items if "ray_session" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.path in on_ray)


@pytest.fixture(scope="session")
def run_distributed():
    """``run_distributed(fn, *args, world_size=2, timeout_s=300, **kwargs) -> [result per rank]``.

    Runs a module-level ``fn`` on every rank of a persistent gloo world (see tests/distributed.py).
    """
    registry = PoolRegistry()
    yield registry
    registry.close()


_SHARED_RAY: dict[str, str] = {}
"""The GCS address of the local Ray that ``ray_session`` started, while it runs."""


@pytest.fixture(scope="session")
def _shared_ray_stopped_at_exit() -> Iterator[None]:
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_session(_shared_ray_stopped_at_exit: None) -> Iterator[None]:
    """A local Ray for this module, kept for the next module that asks for it (they run last, one after
    another: ``_run_ray_modules_last``). Each module still starts on a clean cluster: one that a module left
    an actor or a placement group in is shut down, and so is any Ray this fixture did not start (an earlier
    module's own, left by a failure)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file written into the home folder
    import ray

    from mcore_rl.controller import RayConfig, init_ray

    if ray.is_initialized() and ray.get_runtime_context().gcs_address != _SHARED_RAY.get("address"):
        ray.shutdown()
    if not ray.is_initialized():
        # 4 logical CPUs so that a 4-rank group fits on a 2-core machine (its ranks share the cores).
        init_ray(RayConfig(num_cpus=4, object_store_memory_bytes=128 << 20))
        _SHARED_RAY["address"] = ray.get_runtime_context().gcs_address
    yield
    if ray.is_initialized() and not _ray_is_clean():
        ray.shutdown()


def _ray_is_clean(wait_s: float = 5.0) -> bool:
    """No actor left alive and every placement group removed; polled, since Ray kills and removes them
    asynchronously."""
    from ray._private.state import actors  # the GCS tables themselves (the state API needs the dashboard)
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + wait_s
    while True:
        alive = [a for a in actors().values() if a["State"] != "DEAD"]
        groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if not alive and not groups:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
