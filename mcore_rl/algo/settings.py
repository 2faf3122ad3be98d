"""The algorithms' settings: their choice lists, one enum each (the config sections take their values from here
and the algorithms dispatch on them), and the in-reward KL controller's section. Pure Python (no torch), so the
run config loads without torch."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from mcore_rl.io.fields import NON_NEGATIVE, POSITIVE, Rule, check_section, choice


class AdvEstimator(str, Enum):
    """``algorithm.adv_estimator``: the advantage estimators an RL step runs (verl's names)."""

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    """GRPO without the std normalisation (its loss takes ``seq-mean-token-sum-norm``)."""
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    GAE = "gae"
    """PPO with a critic: token-level GAE (``compute_gae_advantages``, run by the PPO step)."""


ADV_ESTIMATOR_ALIASES = {
    "reinforce++": AdvEstimator.REINFORCE_PLUS_PLUS.value,
    "reinforce++-baseline": AdvEstimator.REINFORCE_PLUS_PLUS_BASELINE.value,
    "dr-grpo": AdvEstimator.DR_GRPO.value,
}
"""Other spellings of estimator names that verl's recipes use."""


class PolicyLossMode(str, Enum):
    """``algorithm.policy_loss``: the actor's policy-gradient loss (verl's ``policy_loss.loss_mode``)."""

    VANILLA = "vanilla"
    """PPO's clipped token ratio, with clip-higher and the dual clip (``ppo_policy_loss``)."""
    GSPO = "gspo"
    """GSPO: PPO clipping on each sequence's length-normalised ratio, seq-mean-token-mean (``gspo_policy_loss``)."""


GSPO_CLIP = (3e-4, 4e-4)
"""GSPO's clip ranges below and above 1 (Zheng et al. 2025, and verl's GSPO recipe): its sequence ratio is a
geometric mean of token ratios, much closer to 1 than any one of them."""


class LossAggMode(str, Enum):
    """How a [B, T] loss matrix becomes a scalar (verl's `loss_agg_mode`)."""

    TOKEN_MEAN = "token-mean"
    """Sum over all valid tokens / number of valid tokens (DAPO; the default)."""
    TOKEN_SUM = "token-sum"
    """Sum over all valid tokens, no normaliser: the loss (and gradient) grows with the tokens in the batch."""
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    """Per-sequence token sum, averaged over sequences."""
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    """Per-sequence token mean, averaged over sequences (original GRPO)."""
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
    """Per-sequence token sum / a constant (the max response length), averaged over sequences (Dr.GRPO)."""


class KLEstimator(str, Enum):
    """Base KL estimator names; `parse_kl_estimator` also accepts verl's aliases and the `+` suffix."""

    K1 = "k1"
    ABS = "abs"
    K2 = "k2"
    K3 = "k3"


KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def parse_kl_estimator(name: str | KLEstimator) -> tuple[KLEstimator, bool]:
    """Parse e.g. `"low_var_kl+"` into `(KLEstimator.K3, straight_through=True)`; ValueError for unknown names."""
    text = name.value if isinstance(name, KLEstimator) else str(name)
    straight_through = text.endswith("+")
    base = text[:-1] if straight_through else text
    try:
        return KLEstimator(KL_ESTIMATOR_ALIASES.get(base, base)), straight_through
    except ValueError:
        valid = sorted([m.value for m in KLEstimator] + list(KL_ESTIMATOR_ALIASES))
        raise ValueError(
            f"unknown kl estimator {name!r}; valid names: {', '.join(valid)}, each optionally with a '+' suffix"
        ) from None


class KLControlType(str, Enum):
    """``algorithm.kl_ctrl.type``: how the in-reward KL coefficient moves."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    """Ziegler et al.'s controller, steering the measured KL to ``target_kl``."""


class DPOLossType(str, Enum):
    """The per-pair losses ``dpo_loss`` knows."""

    SIGMOID = "sigmoid"
    ROBUST = "robust"
    HINGE = "hinge"
    IPO = "ipo"


@dataclass
class KLControl:
    """Coefficient of a KL penalty in the reward (verl's ``algorithm.kl_ctrl``)."""

    SECTION: ClassVar[str] = "algorithm.kl_ctrl"

    type: str = KLControlType.FIXED.value
    """fixed or adaptive."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient."""
    target_kl: float = 0.1
    """adaptive: the KL the controller steers to."""
    horizon: int = 10000
    """adaptive: steps over which the coefficient adapts."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "type": choice(KLControlType),
                "kl_coef": NON_NEGATIVE,
                "target_kl": POSITIVE,
                "horizon": POSITIVE,
            },
        )


def kl_estimator_rule() -> Rule:
    """A KL estimator name as :func:`parse_kl_estimator` reads it (``algorithm.kl_loss_type``, ``kl_penalty``)."""
    names = [m.value for m in KLEstimator] + list(KL_ESTIMATOR_ALIASES)

    def ok(value: object) -> bool:
        return isinstance(value, str) and value.removesuffix("+") in names

    return Rule(f"{', '.join(names)}, each optionally with '+'", ok, is_choice=True)


class FilterMetric(str, Enum):
    """``algorithm.filter_groups.metric``: which per-response value must vary within a kept group."""

    SEQ_REWARD = "seq_reward"
    """The step's training reward (rules or reward model, tool rewards, the overlong punishment)."""
    SCORE = "score"
    """The rule (or user) scorers' score alone."""
    ACC = "acc"
    """A dict-returning scorer's ``acc`` extra, else the score (verl's DAPO recipe sets it; a right-or-wrong
    rule such as ``math_dapo``, scored +-1, keeps the same groups either way)."""


@dataclass
class FilterGroups:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): a prompt group whose ``rollout.n``
    responses all got the same value has zero GRPO advantage, so it is dropped and more prompts are sampled
    until ``data.train_batch_size`` groups with signal are kept (``trainer/dynamic_sampling.py``)."""

    SECTION: ClassVar[str] = "algorithm.filter_groups"

    enable: bool = False
    metric: str = FilterMetric.SEQ_REWARD.value
    """seq_reward (the training reward), score (the rule scorers' alone) or acc (the scorer's ``acc`` extra,
    else its score)."""
    max_num_gen_batches: int = 10
    """Rollouts of ``data.train_batch_size`` prompts one step may sample before it stops the run naming
    the shortfall (its data too easy or too hard for the model); 0: no limit."""

    def __post_init__(self) -> None:
        check_section(self, {"metric": choice(FilterMetric), "max_num_gen_batches": NON_NEGATIVE})
