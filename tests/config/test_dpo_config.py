"""The ``dpo`` section's own checks."""

from __future__ import annotations

import pytest

from mcore_rl.config import ConfigError, load_config


def test_rejected_and_chosen_from_one_column_are_refused() -> None:
    """Every pair would be (x, x): the loss stays at log 2 for the whole run and nothing said why."""
    with pytest.raises(ConfigError, match=r"dpo\.rejected_key='chosen' is dpo\.chosen_key as well"):
        load_config("recipes/dpo_demo_cpu.yaml", ["dpo.rejected_key=chosen"])
