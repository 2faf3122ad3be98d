"""The synthetic demo task: ``aaa+bbb=`` -> the sum, with a 14-symbol character tokenizer.

The sum is written plainly (``123+456=`` -> ``579``) or reversed, least-significant digit first (``975``).
Reversed, every output digit depends only on two input digits and the carry just produced, so a small
model learns all digit positions at a similar pace; written plainly, the first digit already needs the whole
carry chain (whether the sum reaches 1000), which a tiny model learns late and unevenly (Lee et al. 2023,
"Teaching Arithmetic to Small Transformers", measured the same for addition).

Small enough for a randomly initialised 0.5M-parameter Llama to learn on two CPU cores (see
shared/notes/demo-calibration.md), and checkable by an exact-match rule, so the same task serves
supervised warm-up and RL with a verifier.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


class CharTokenizer:
    """Digits, '+', '=', plus PAD (0) and EOS (1)."""

    PAD, EOS = 0, 1
    SYMBOLS = "0123456789+="

    def __init__(self) -> None:
        self._ids = {ch: i + 2 for i, ch in enumerate(self.SYMBOLS)}
        self._chars = {i: ch for ch, i in self._ids.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.SYMBOLS) + 2

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the arithmetic vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if i == self.EOS:
                break
            out.append(self._chars.get(i, ""))
        return "".join(out)


@dataclass(frozen=True)
class AdditionProblem:
    prompt: str
    answer: str


def make_problems(count: int, seed: int, digits: int = 3, reverse: bool = False) -> list[AdditionProblem]:
    """``count`` problems drawn from ``seed``; ``reverse`` writes each answer least-significant digit first
    (the prompts are the same either way)."""
    rng = random.Random(seed)
    top = 10**digits
    problems = []
    for _ in range(count):
        a, b = rng.randrange(top), rng.randrange(top)
        answer = str(a + b)
        problems.append(
            AdditionProblem(f"{a:0{digits}d}+{b:0{digits}d}=", answer[::-1] if reverse else answer)
        )
    return problems


def sft_batch(
    problems: list[AdditionProblem], tokenizer: CharTokenizer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (tokens [B, S], next-token labels [B, S], loss mask [B, S] on answer+EOS positions)."""
    rows = [(tokenizer.encode(p.prompt), [*tokenizer.encode(p.answer), tokenizer.EOS]) for p in problems]
    length = max(len(q) + len(a) for q, a in rows)
    tokens = torch.full((len(rows), length), tokenizer.PAD, dtype=torch.long)
    labels = torch.full_like(tokens, tokenizer.PAD)
    mask = torch.zeros(len(rows), length)
    for i, (q, a) in enumerate(rows):
        seq = q + a
        tokens[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq) - 1] = torch.tensor(seq[1:])
        mask[i, len(q) - 1 : len(seq) - 1] = 1.0  # predict the answer tokens and EOS only
    return tokens, labels, mask


def exact_match(completion: str, problem: AdditionProblem) -> float:
    """The verifier: 1.0 when the completion is exactly the sum."""
    return 1.0 if completion.strip() == problem.answer else 0.0
