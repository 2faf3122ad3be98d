"""``rollout.name=vllm``: what the vLLM engine would refuse at its first ``generate()`` (after every worker
started and vLLM was built) is refused by the config check, naming the key; the same settings stay valid on
the embedded engine where it takes them."""

from __future__ import annotations

import pytest

from mcore_rl.config import ConfigError
from tests.trainer.common import tiny_run_config

VLLM = ["rollout.name=vllm", "model.hf_config.hidden_size=128", "rollout.kv_cache_memory_bytes=16777216"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.val_kwargs.n=2"],
            r"rollout.val_kwargs.n=2 with temperature=0: vLLM's greedy",
        ),  # greedy validation
        (["rollout.temperature=2.5"], r"rollout.temperature=2.5: vLLM accepts at most 2.0"),
        (["rollout.temperature=0.005"], r"rollout.temperature=0.005: vLLM samples at 0.01 instead"),
        (["rollout.val_kwargs.temperature=2.5"], r"rollout.val_kwargs.temperature=2.5"),
    ],
    ids=["greedy-val-n2", "rollout-T2.5", "rollout-T0.005", "val-T2.5"],
)
def test_sampling_vllm_refuses_is_refused_before_any_process_starts(tmp_path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_run_config(str(tmp_path), [*VLLM, *overrides])
    tiny_run_config(str(tmp_path), overrides)  # the embedded engine samples these


def test_a_response_budget_past_the_models_positions_is_refused(tmp_path) -> None:
    """vLLM is sized for data.max_prompt_length + rollout.response_length (16 + 20 > the 32 positions here)."""
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \+ rollout.response_length = 36 exceeds"):
        tiny_run_config(str(tmp_path), [*VLLM, "rollout.response_length=20"])
