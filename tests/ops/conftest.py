from __future__ import annotations

import pytest

from mcore_rl.ops import _native


@pytest.fixture(params=["native", "reference"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once on the compiled kernels and once on the pure-PyTorch references."""
    if request.param == "native":
        if not _native.extension_loaded():
            pytest.skip(f"mcore_rl._C is not built: {_native.load_error()}")
        monkeypatch.delenv("MCORE_RL_FORCE_REFERENCE", raising=False)
    else:
        monkeypatch.setenv("MCORE_RL_FORCE_REFERENCE", "1")
    return request.param
