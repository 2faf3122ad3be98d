"""Every launch script passes shellcheck (following sourced files)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.launch.conftest import LAUNCH, REPO


def _shellcheck() -> str | None:
    found = shutil.which("shellcheck")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        # Debian packages it; `make install` does the same, this covers a venv built before that rule.
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True, timeout=300)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "shellcheck"], check=False, capture_output=True, timeout=300
        )
        found = shutil.which("shellcheck")
    return found


def test_launch_scripts_are_shellcheck_clean():
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed and apt-get cannot install it here (not root or no apt)")
    scripts = sorted(str(p.relative_to(REPO)) for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) >= 6
    result = subprocess.run(
        [shellcheck, "-x", "--severity=style", *scripts], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
