"""Schema section ``reward_model``: a model reward beside the rule rewards (HybridFlow's reward model worker).

The model is an HF sequence-classification checkpoint with one label, scored on the last response token
(``trainer/reward_model.py``); it runs forward-only on the actor's ranks. The step's reward is
``rule_weight * rules + weight * model``; validation and test accuracy stay the rules' alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mcore_rl.io.fields import POSITIVE, check_section


@dataclass
class RewardModelConfig:
    """Where the reward model is and how its score combines with the rules'."""

    SECTION: ClassVar[str] = "reward_model"

    path: str | None = None
    """HF folder of a ``*ForSequenceClassification`` model (Llama, Qwen2, Mistral; one label) sharing the
    actor's tokenizer, or its ``mcore-rl convert hf-to-mcore`` checkpoint (any layout; each rank then reads
    only its shards, where the HF folder is read whole on every rank); None: rule rewards only."""
    weight: float = 1.0
    """Weight of the model's score in the step's reward."""
    rule_weight: float = 1.0
    """Weight of the rule (or ``reward.custom_function``) score in the step's reward."""
    micro_batch_size_per_gpu: int = 8
    """Sequences per reward-model forward on one data-parallel rank."""

    def __post_init__(self) -> None:
        check_section(self, {"micro_batch_size_per_gpu": POSITIVE})
