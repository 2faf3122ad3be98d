"""Schema section ``dpo``: direct preference optimisation (``mcore-rl dpo``), on the same model, layout,
optimizer (``optim``), data (``data``: prompt column, lengths, bad-row policy), trainer and logging keys as an
RL run. A recipe is a DPO run when it sets ``dpo.train_files``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from mcore_rl.algo.settings import DPOLossType
from mcore_rl.io.fields import (
    FREQUENCY,
    NON_NEGATIVE,
    OPTIONAL_POSITIVE,
    POSITIVE,
    FieldError,
    Rule,
    check_section,
    choice,
)


@dataclass
class DPOConfig:
    """Preference data, the DPO loss (TRL's names and defaults) and the run's length and evaluation."""

    SECTION: ClassVar[str] = "dpo"

    train_files: list[str] = field(default_factory=list)
    """Preference pairs (.parquet, .jsonl): ``data.prompt_key`` (text or chat messages) plus ``chosen_key``
    and ``rejected_key`` (text, or lists of messages that continue the prompt)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out pairs: loss, reward accuracy and margins every ``test_freq`` steps (TRL's ``eval_*``)."""
    chosen_key: str = "chosen"
    """Column holding the preferred completion."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred completion."""
    loss_type: str = DPOLossType.SIGMOID.value
    """sigmoid (DPO; cDPO with ``label_smoothing``), robust (rDPO), hinge (SLiC) or ipo (length-averaged)."""
    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference policy."""
    label_smoothing: float = 0.0
    """Assumed label-flip probability in [0, 0.5) for sigmoid (cDPO) and robust (rDPO)."""
    reference_free: bool = False
    """Compare against a uniform reference (no reference model, reference log-probs 0)."""
    precompute_ref_log_probs: bool = False
    """Compute the reference log-probs of every pair once, before training, and cache them next to the run
    (``<trainer.default_local_dir>/ref_log_probs_train.pt``, and ``ref_log_probs_val.pt`` for
    ``dpo.val_files``; reused only for the same data and initial model: ``model.path``'s files, or the seed
    of random weights); False keeps a frozen reference model in the same processes and scores each batch as
    it comes."""
    sft_loss_weight: float = 0.0
    """Add this times the chosen completion's negative log-likelihood averaged over its own tokens, then over
    the pairs: the RPO paper's form, NeMo-RL's ``sft_loss_weight`` with ``sft_average_log_probs=true``. TRL's
    ``rpo_alpha`` averages over all chosen tokens of the batch instead, NeMo-RL's default sums each
    completion's: the three agree when the chosen completions are equally long."""
    max_length: int | None = None
    """Longest prompt + completion in tokens (None: ``data.max_prompt_length + data.max_response_length``);
    longer pairs, and prompts over ``data.max_prompt_length``, follow ``data.filter_overlong_prompts``."""
    train_batch_size: int = 64
    """Pairs per optimizer step, over all data-parallel ranks."""
    micro_batch_size_per_gpu: int = 8
    """Pairs per forward/backward on one data-parallel rank (its chosen and rejected rows run together)."""
    test_freq: int = 50
    """Evaluate (held-out pairs, and greedy answers on ``data.test_files``) every this many steps; -1:
    only before and after training. Length, checkpoints and resume follow ``trainer.total_training_steps``
    (None: ``trainer.total_epochs`` passes over the pairs), ``trainer.save_freq`` and ``trainer.resume_mode``."""

    def __post_init__(self) -> None:
        if self.chosen_key == self.rejected_key:  # every pair would be (x, x): the loss stays at log 2
            raise FieldError([("dpo.rejected_key", f"={self.rejected_key!r} is dpo.chosen_key as well")])
        check_section(
            self,
            {
                "loss_type": choice(DPOLossType),
                "beta": POSITIVE,
                "label_smoothing": Rule("in [0, 0.5)", lambda v: 0 <= v < 0.5),
                "sft_loss_weight": NON_NEGATIVE,
                "max_length": OPTIONAL_POSITIVE,
                "train_batch_size": POSITIVE,
                "micro_batch_size_per_gpu": POSITIVE,
                "test_freq": FREQUENCY,
            },
        )
