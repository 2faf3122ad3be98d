from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import PoolRegistry

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def run_distributed():
    """``run_distributed(fn, *args, world_size=2, timeout_s=300, **kwargs) -> [result per rank]``.

    Runs a module-level ``fn`` on every rank of a persistent gloo world (see tests/distributed.py).
    """
    registry = PoolRegistry()
    yield registry
    registry.close()
