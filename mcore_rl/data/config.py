"""The ``data`` section: the prompt datasets of a run (verl's ``data`` keys) and how bad rows are handled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import II

from mcore_rl.io.fields import OPTIONAL_POSITIVE, POSITIVE, check_section, one_of

GENERATED_TASKS = {"arithmetic": False, "arithmetic_reversed": True, "tool_calc": False}
"""``data.generate`` names -> whether the answers are written least-significant digit first
(:mod:`mcore_rl.data.demo_task` writes them; ``tool_calc``, the tool demo's products with calculator traces,
:mod:`mcore_rl.data.tool_task`)."""


@dataclass
class DataConfig:
    """Prompt datasets in verl's format (verl's ``data`` keys): jsonl or parquet rows with ``prompt`` (chat
    messages or plain text), ``data_source``, ``reward_model.ground_truth`` and ``extra_info``."""

    SECTION: ClassVar[str] = "data"

    train_files: list[str] = field(default_factory=list)
    """Training prompt files (.parquet, .jsonl), read in order and concatenated."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompts, scored every ``trainer.test_freq`` steps."""
    test_files: list[str] = field(default_factory=list)
    """Held-out test prompts, scored before training and at the end only."""
    prompt_key: str = "prompt"
    """Column holding the prompt."""
    reward_fn_key: str = "data_source"
    """Column whose value picks the reward function."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, chat template included."""
    max_response_length: int = 512
    """Longest response in tokens (``rollout.response_length`` follows it)."""
    train_batch_size: int = 1024
    """Prompts per RL step, over all data-parallel ranks."""
    val_batch_size: int | None = None
    """Prompts per validation generate call (validation during training, the held-out test, ``mcore-rl eval``);
    None: the whole set at once."""
    filter_overlong_prompts: bool = False
    """True drops prompts longer than ``max_prompt_length`` with one counted warning; False refuses them,
    naming the file and row."""
    skip_bad_rows: bool = False
    """True skips rows missing a needed column (counted, one warning); False stops naming file, row, column."""
    apply_chat_template: bool = True
    """Render message-list prompts through the tokenizer's chat template (plain-text prompts are encoded
    as they are)."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (deterministic from ``seed`` and the epoch)."""
    seed: int = II("trainer.seed")
    """Shuffle seed; follows ``trainer.seed``."""
    drop_last: bool = True
    """Drop an epoch's last incomplete batch (every step then has ``train_batch_size`` prompts); False keeps it
    as a shorter step, split into the same number of mini-batches (refused at the start where its sequences
    do not split over the ranks and micro-batches as a full batch's do)."""
    generate: str | None = None
    """A built-in task ('arithmetic'; 'arithmetic_reversed' writes the answers least-significant digit
    first) whose generator writes the files named by ``train_files``, ``val_files``, ``test_files``,
    ``sft.train_files`` and the tokenizer at ``model.tokenizer_path`` when they are missing (see
    :mod:`mcore_rl.data.demo_task`); None: the files must exist."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "max_prompt_length": POSITIVE,
                "max_response_length": POSITIVE,
                "train_batch_size": POSITIVE,
                "val_batch_size": OPTIONAL_POSITIVE,
                "generate": one_of(None, *GENERATED_TASKS),
            },
        )
