from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One local Ray per test module (starting Ray costs several seconds on 2 cores), shut down after."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file written into the home folder
    import ray

    from mcore_rl.controller import RayConfig, init_ray

    if ray.is_initialized():  # a failed earlier module must not leave its placement groups to this one
        ray.shutdown()
    # 4 logical CPUs so that a 4-rank group fits on a 2-core machine (its ranks share the cores).
    init_ray(RayConfig(num_cpus=4, object_store_memory_bytes=128 << 20))
    yield
    ray.shutdown()
