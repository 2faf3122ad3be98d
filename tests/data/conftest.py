"""Tiny tokenizers trained here on generated text (no downloads): a BPE ``tokenizer.json`` (bare, and with
a ``tokenizer_config.json`` carrying a chat template) and a sentencepiece ``.model``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mcore_rl.data.tokenizer import write_tokenizer_config

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "then",
    "ran",
    "to",
    "see",
    "how",
    "many",
    "apples",
    "were",
    "left",
    "in",
    "the",
    "big",
    "red",
    "box",
]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + f" {rng.randint(0, 999)}"
        for _ in range(lines)
    ]


def train_bpe(folder: Path, with_config: bool) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<pad>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if with_config:
        write_tokenizer_config(str(folder), eos_token="</s>", pad_token="<pad>", chat_template=TEMPLATE)
    return folder


def train_sentencepiece(folder: Path) -> Path:
    import sentencepiece

    folder.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=120,
        model_type="bpe",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        minloglevel=2,
    )
    return folder


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "bpe": train_bpe(root / "bpe", with_config=False),
        "hf": train_bpe(root / "hf", with_config=True),
        "sentencepiece": train_sentencepiece(root / "sp"),
    }
