"""The tool demo's task (``data.generate: tool_calc``, ``recipes/tool_demo_cpu.yaml``): products of a 3-digit
and a 2-digit number, which a tiny model cannot compute but can copy from a calculator.

Written files (where the config names them; ``.parquet`` or ``.jsonl`` by suffix):

* train / validation / held-out test prompts: ``prompt`` is one user message ``"123*45="``, ``data_source``
  :data:`DATA_SOURCE`, ``reward_model.ground_truth`` the product (``"5535"``);
* SFT traces: the same columns plus ``response``, the conversation that follows the prompt: for a quarter of
  the rows (:data:`TOOL_FRACTION`) a tool-use trace ::

      assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>
      tool       5535
      assistant  5535

  and for the others the direct answer (``assistant 5535``);
  (``sft.response_key=reward_model.ground_truth`` trains the direct answer instead: the no-tool baseline);
* a tokenizer folder: a ChatML tokenizer (``<|im_start|>``, ``<|im_end|>`` = EOS, Qwen's ``<tool_call>`` and
  ``<tool_response>`` tokens) over printable ASCII, the JSON keys of a calculator call as single tokens, and
  a Qwen2.5-style chat template whose ``tool`` messages become ``<tool_response>`` blocks of a user turn.

Validation and test prompts never appear among the training or SFT prompts.
"""

from __future__ import annotations

import json
import os
import random
import string
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.rows import write_rows
from mcore_rl.data.tokenizer import write_tokenizer_config

DATA_SOURCE = "mcore_rl/tool_calc"
"""``data_source`` of the rows; the recipe scores it by exact match of the model's last turn."""
SPLIT_SIZES = {"test": 1000, "val": 200, "train": 20_000, "sft": 40_000}
TOOL_NAME = "calculator"
TOOL_FUNCTION = "mcore_rl.agent.calculator:calculator"
TOOL_FRACTION = 0.25
"""SFT traces that call the calculator; the others answer directly, as a model that often skips its tool
would (its direct products are nearly always wrong: a tiny model cannot multiply). SFT teaches the call's
format and copying the answer; whether to call is what RL has to learn."""
SPECIAL = ("<pad>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
PIECES = ('{"name": "', '", "arguments": {"expression": "', '"}}', TOOL_NAME, "user", "assistant")
"""Multi-character tokens: the fixed parts of a calculator call and the template's roles."""
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's rendering of user, assistant and tool messages, without its default system prompt (the demo's
model has a 64-token context)."""


@dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    def trace(self) -> list[dict[str, str]]:
        """The tool-use turns after the prompt (what SFT teaches)."""
        call = {"name": TOOL_NAME, "arguments": {"expression": f"{self.a}*{self.b}"}}
        return [
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "tool", "content": self.answer},
            {"role": "assistant", "content": self.answer},
        ]


def make_products(count: int, seed: int) -> list[Product]:
    rng = random.Random(seed)
    return [Product(rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(count)]


def write_tokenizer(folder: str) -> None:
    """The demo's ChatML tokenizer as an HF folder (module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate([*SPECIAL, *TOOL_TOKENS, *PIECES, *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    pieces = "|".join(_escape(p) for p in sorted(PIECES, key=len, reverse=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pieces}|[\\s\\S]"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    write_tokenizer_config(folder, eos_token="<|im_end|>", pad_token="<pad>", chat_template=CHAT_TEMPLATE)


def _escape(piece: str) -> str:
    return "".join(f"\\{c}" if c in '{}()[].*+?^$|\\"' else c for c in piece)


def rows(problems: list[Product], split: str, with_response: bool = False) -> list[dict[str, Any]]:
    """verl-format rows; SFT rows (``with_response``) hold a tool-use trace for a :data:`TOOL_FRACTION` of
    the problems (drawn per row from its index) and the direct answer for the rest."""
    out = []
    for index, p in enumerate(problems):
        row: dict[str, Any] = {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": index},
        }
        if with_response:
            uses_tool = random.Random(index).random() < TOOL_FRACTION
            row["response"] = p.trace() if uses_tool else [{"role": "assistant", "content": p.answer}]
        out.append(row)
    return out


def splits(seed: int, sizes: dict[str, int] | None = None) -> dict[str, list[Product]]:
    """Problems per split; training and SFT prompts exclude every validation and test prompt."""
    sizes = {**SPLIT_SIZES, **(sizes or {})}
    test = make_products(sizes["test"], seed=50_000 + seed)
    val = make_products(sizes["val"], seed=60_000 + seed)
    held_out = {p.prompt for p in test + val}
    out = {"test": test, "val": val}
    for offset, name in ((70_000, "train"), (80_000, "sft")):
        pool = make_products(sizes[name] + len(held_out), seed=offset + seed)
        out[name] = [p for p in pool if p.prompt not in held_out][: sizes[name]]
    return out


def write_tool_dataset(paths: dict[str, str], seed: int, sizes: dict[str, int] | None = None) -> None:
    """Write the splits named in ``paths`` (keys: train, val, test, sft, tokenizer) to those paths."""
    problems = splits(seed, sizes)
    for split, path in paths.items():
        if split == "tokenizer":
            write_tokenizer(path)
        else:
            write_rows(path, rows(problems[split], split, with_response=split == "sft"))
