from __future__ import annotations

import pytest

from mcore_rl.cli import main
from tests.convert.hf_models import save_hf_model


@pytest.fixture(scope="session")
def hf_sharded(tmp_path_factory) -> str:
    """A tiny fp32 Llama saved by transformers in several safetensors shards with an index."""
    return save_hf_model(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", max_shard_size="100KB")


def _converted(hf_dir: str, ckpt: str) -> int:
    return main(["convert", "hf-to-mcore", "--hf-dir", hf_dir, "--out", ckpt])


@pytest.fixture(scope="session")
def ckpt(run_distributed, hf_sharded, tmp_path_factory) -> str:
    """``hf_sharded`` converted by the CLI on the 2-rank pool."""
    path = str(tmp_path_factory.mktemp("ckpt") / "llama")
    assert run_distributed(_converted, hf_sharded, path) == [0, 0]
    return path
