"""What a run reads before any worker starts: its tokenizer and every prompt set, each row checked as its
scorer will read it (``trainer.build.row_checks``), and the SFT examples of the warm start."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import ConfigError, RunConfig
from mcore_rl.config.batch_rules import last_batch_problem
from mcore_rl.data.prompts import PromptDataset, PromptLoader
from mcore_rl.data.rows import DataError
from mcore_rl.data.sft import SFTDataset
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.trainer.build import row_checks
from mcore_rl.trainer.multi_turn import prompt_tokenizer
from mcore_rl.types import PromptBatch


@dataclass
class RunData:
    """Everything the driver reads: prompts (the answers stay here, with the scorer)."""

    tokenizer: Tokenizer
    loader: PromptLoader
    val: PromptBatch | None
    test: PromptBatch | None
    sft: SFTDataset | None
    sft_val: PromptBatch | None = None
    """The SFT stage's validation prompts (``sft.val_files``; the same batch as ``val`` when they follow
    ``data.val_files``)."""


def load_run_data(cfg: RunConfig) -> RunData:
    """Every prompt set of the run, each row checked as its scorer will read it (``row_checks``)."""
    # multi-turn tools are listed in every prompt (rollout.multi_turn.tools_in_prompt)
    tokenizer = prompt_tokenizer(cfg, load_tokenizer(cfg.model.tokenizer_path or ""))
    check = row_checks(cfg)
    train = PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data, check)
    short = last_batch_problem(cfg, len(train))
    if short is not None:
        raise ConfigError(short)

    def whole(files: list[str]) -> PromptBatch | None:
        if not files:
            return None
        dataset = PromptDataset.from_files(files, tokenizer, cfg.data, check)
        return dataset.batch(range(len(dataset)))

    sft = (
        SFTDataset.from_files(
            cfg.sft.train_files,
            tokenizer,
            cfg.data,
            cfg.sft.response_key,
            cfg.sft.max_length,
            cfg.sft.messages_key,
        )
        if cfg.sft.enable
        else None
    )
    if sft is not None and len(sft) < cfg.sft.train_batch_size:  # else the SFT stage fails at its first step
        raise DataError(
            f"{', '.join(cfg.sft.train_files)}: {len(sft)} usable examples cannot fill one batch of "
            f"sft.train_batch_size={cfg.sft.train_batch_size}"
        )
    val = whole(cfg.data.val_files)
    sft_val = None
    if sft is not None:
        sft_val = val if list(cfg.sft.val_files) == list(cfg.data.val_files) else whole(cfg.sft.val_files)
    return RunData(tokenizer, PromptLoader(train, cfg.data), val, whole(cfg.data.test_files), sft, sft_val)


def data_sources(data: RunData) -> dict[str, str]:
    """Each ``data_source`` of the training, validation and test prompts -> where its first row is."""
    found = data.loader.dataset.source_origins()
    for batch in (data.val, data.test, data.sft_val):
        if batch is not None:
            for source, origin in zip(batch.data_sources, batch.origins, strict=True):
                found.setdefault(source, origin)
    return found
