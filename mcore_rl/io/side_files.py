"""The small HF side files that travel with a model's weights: its tokenizer and generation settings.

A conversion copies them into its output, and every checkpoint a run writes keeps them in its
``hf_assets/`` so that the checkpoint alone is a model to train, evaluate or convert wherever it is moved
(verl's checkpoints keep the tokenizer in their ``huggingface/`` folder for the same reason). Each file is
copied through :func:`~mcore_rl.io.inputs.copy_input_file`, so a link in the source folder cannot pull in a
file from outside it.
"""

from __future__ import annotations

from mcore_rl.io.inputs import copy_input_file

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
"""The files that decide a tokenizer's ids (a ``tokenizer.json`` or a sentencepiece ``tokenizer.model``, the
rest as the tokenizer has them)."""
HF_SIDE_FILES = (*TOKENIZER_FILES, "chat_template.jinja", "chat_template.json", "generation_config.json")
"""Tokenizer and generation files of an HF model folder, copied verbatim when present."""
GENERATION_CONFIG = "generation_config.json"


def copy_side_files(source: str, destination: str) -> list[str]:
    """Copy the :data:`HF_SIDE_FILES` found in ``source``; returns their names."""
    return [name for name in HF_SIDE_FILES if copy_input_file(source, name, destination)]


def copy_model_assets(tokenizer_dir: str | None, model_dir: str | None, destination: str) -> list[str]:
    """What a checkpoint keeps so that it alone describes its model: the tokenizer's files, all from
    ``tokenizer_dir`` (never mixed with another folder's), and ``generation_config.json`` (the stop ids) from
    ``model_dir`` when the tokenizer folder has none. Returns the names copied."""
    copied = copy_side_files(tokenizer_dir, destination) if tokenizer_dir else []
    if (
        GENERATION_CONFIG not in copied
        and model_dir
        and copy_input_file(model_dir, GENERATION_CONFIG, destination)
    ):
        copied.append(GENERATION_CONFIG)
    return copied
