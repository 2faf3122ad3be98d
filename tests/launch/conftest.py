"""Run the launch scripts as a user would: bash, a clean environment, the repository as working directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"


def run_script(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """``bash argv...`` with only PATH/HOME from this process plus ``env``; output as text."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "USER": "tester"}
    return subprocess.run(
        ["bash", *argv],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def launch_dir() -> Path:
    return LAUNCH
