"""Output folders that appear only when complete, and the small HF side files that travel with weights.

A conversion writes into a hidden sibling folder (``.<name>.tmp-<random>``) and renames it to the
requested path at the very end. A crash or an error leaves no folder at that path (the temporary one is
removed on errors; after a kill it stays hidden and its name says what it is). An existing non-empty
output is replaced only with ``--overwrite``, and never when it is, or contains, an input.
"""

from __future__ import annotations

import os
import shutil
import uuid

from mcore_rl.convert.mapping import ConvertError

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
    copied = []
    for name in HF_SIDE_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            os.makedirs(destination, exist_ok=True)
            shutil.copy2(path, os.path.join(destination, name))
            copied.append(name)
    return copied


class StagedOutput:
    """``out`` checked now, written under :attr:`tmp`, moved into place by :meth:`commit`."""

    def __init__(self, out: str, overwrite: bool, inputs: list[str]) -> None:
        self.out = os.path.abspath(out)
        self.overwrite = overwrite
        for source in inputs:
            source = os.path.abspath(source)
            if self.out == source or source.startswith(self.out.rstrip(os.sep) + os.sep):
                raise ConvertError(f"--out {out} is (or contains) the input {source}; choose another folder")
        if os.path.exists(self.out):
            if not os.path.isdir(self.out):
                raise ConvertError(f"--out {out} exists and is not a folder")
            if os.listdir(self.out) and not overwrite:
                raise ConvertError(f"--out {out} exists and is not empty; pass --overwrite to replace it")
        parent = os.path.dirname(self.out)
        if not os.path.isdir(parent):
            raise ConvertError(f"--out {out}: parent folder {parent} does not exist")
        self.tmp = os.path.join(parent, f".{os.path.basename(self.out)}.tmp-{uuid.uuid4().hex[:8]}")

    def begin(self) -> str:
        os.makedirs(self.tmp)
        return self.tmp

    def commit(self) -> None:
        if os.path.exists(self.out):
            # Move the old output aside before deleting it: a failure in between leaves it recoverable.
            old = f"{self.tmp}.old"
            os.rename(self.out, old)
            os.rename(self.tmp, self.out)
            shutil.rmtree(old)
        else:
            os.rename(self.tmp, self.out)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
