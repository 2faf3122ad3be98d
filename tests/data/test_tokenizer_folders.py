"""The same tokenizer files encode the same wherever they lie: in an HF model folder (a ``config.json``
whose ``model_type`` transformers maps to a model-specific tokenizer class), in a checkpoint's
``hf_assets/`` (no ``config.json``), or alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mcore_rl.data.tokenizer import load_tokenizer, write_tokenizer_config

TEXT = "question 12 plus 36 equals 48 the answer"


def whitespace_bpe(folder: Path) -> Path:
    """A BPE over whitespace words: Qwen2's own pre-tokenizer would split its numbers into digits."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<unk>", "<|im_end|>"])
    corpus = [f"question {i} plus {3 * i} equals {4 * i} the answer" for i in range(300)]
    tokenizer.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(str(folder), eos_token="<|im_end|>", pad_token="<pad>")
    return folder


def with_model_config(source: Path, folder: Path) -> Path:
    from transformers import Qwen2Config

    shutil.copytree(source, folder)
    Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    ).save_pretrained(folder)
    return folder


def test_a_model_folder_and_its_bare_tokenizer_files_encode_alike(tmp_path: Path) -> None:
    alone = whitespace_bpe(tmp_path / "hf_assets")
    model_folder = with_model_config(alone, tmp_path / "model")
    expected = load_tokenizer(alone).encode(TEXT)
    assert len(expected) < len(TEXT.split()) + 2  # whole numbers are single tokens in this BPE
    assert load_tokenizer(model_folder).encode(TEXT) == expected
    assert load_tokenizer(model_folder).decode(expected) == load_tokenizer(alone).decode(expected)


@pytest.mark.parametrize("tokenizer_class", [None, "PreTrainedTokenizerFast", "TokenizersBackend"])
def test_a_generic_or_missing_class_reads_the_tokenizer_json_as_saved(
    tokenizer_class: str | None, tmp_path: Path
) -> None:
    alone = whitespace_bpe(tmp_path / "alone")
    config_file = alone / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("tokenizer_class")
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    config_file.write_text(json.dumps(config))
    model_folder = with_model_config(alone, tmp_path / "model")
    assert load_tokenizer(model_folder).encode(TEXT) == load_tokenizer(alone).encode(TEXT)
