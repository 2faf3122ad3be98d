"""The small HF side files that travel with weights, and the output folder of a conversion.

Output folders are :class:`~mcore_rl.io.output.OutputFolder` (staged, published complete, never an input,
never a folder that is not ours without ``--overwrite``); side files are copied through
:func:`~mcore_rl.io.inputs.copy_input_file`, so a link in the source folder cannot pull in a file from
outside it.
"""

from __future__ import annotations

from collections.abc import Sequence

from mcore_rl.io.inputs import copy_input_file
from mcore_rl.io.output import OutputFolder

# Tokenizer and generation files of an HF model folder, copied verbatim when present.
HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_side_files(source: str, destination: str) -> list[str]:
    """Copy the :data:`HF_SIDE_FILES` found in ``source``; returns their names."""
    return [name for name in HF_SIDE_FILES if copy_input_file(source, name, destination)]


def conversion_output(out: str, inputs: Sequence[str | None], overwrite: bool, kind: str) -> OutputFolder:
    """The ``--out`` of a conversion: replaced only with ``--overwrite``, never one of ``inputs``."""
    return OutputFolder.plan(out, flag="--out", inputs=inputs, overwrite=overwrite, kind=kind)
