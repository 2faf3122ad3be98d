"""The output folder of a conversion.

Output folders are :class:`~mcore_rl.io.output.OutputFolder` (staged, published complete, never an input,
never a folder that is not ours without ``--overwrite``); the side files copied beside the weights are
``mcore_rl/io/side_files.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from mcore_rl.io.output import OutputFolder


def conversion_output(out: str, inputs: Sequence[str | None], overwrite: bool, kind: str) -> OutputFolder:
    """The ``--out`` of a conversion: replaced only with ``--overwrite``, never one of ``inputs``."""
    return OutputFolder.plan(out, flag="--out", inputs=inputs, overwrite=overwrite, kind=kind)
