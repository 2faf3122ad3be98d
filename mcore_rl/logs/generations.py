"""Sample generations of validation in the run log (``logging.log_val_generations``, verl's
``trainer.log_val_generations``): one JSON object per sample appended to ``<log_dir>/generations.jsonl``::

    {"stage": "rl", "step": 50, "data_source": "openai/gsm8k", "prompt": "...", "response": "...",
     "ground_truth": "72", "score": 1.0}

and, with TensorBoard on, the same rows as a text table under ``<stage>/generations`` at that step.
"""

from __future__ import annotations

import os
from typing import Any

from mcore_rl.logs.jsonl import json_line

GENERATIONS_FILE = "generations.jsonl"
COLUMNS = ("data_source", "prompt", "response", "ground_truth", "score")


def append_generations(log_dir: str, tb: Any, stage: str, step: int, samples: list[dict[str, Any]]) -> None:
    """Append ``samples`` (dicts with :data:`COLUMNS`) with their stage and step; ``tb`` may be None."""
    if not samples:
        return
    with open(os.path.join(log_dir, GENERATIONS_FILE), "a") as f:
        f.writelines(json_line({"stage": stage, "step": step, **s}) for s in samples)
    if tb is not None:
        tb.add_text(f"{stage}/generations", markdown_table(samples), step)


def markdown_table(samples: list[dict[str, Any]]) -> str:
    """The samples as a Markdown table (TensorBoard renders its text plugin's Markdown)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(s.get(c, "")) for c in COLUMNS) + " |" for s in samples]
    return "\n".join(lines)
