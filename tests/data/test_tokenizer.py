"""Local tokenizers: BPE tokenizer.json (bare and through transformers) and sentencepiece, trained here."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.data.tokenizer import TokenizerError, fallback_chat_text, load_tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]


@pytest.mark.parametrize("kind", ["bpe", "hf", "sentencepiece"])
def test_round_trip_and_special_ids(kind: str, tokenizer_dirs: dict[str, Path]) -> None:
    tok = load_tokenizer(tokenizer_dirs[kind])
    text = "the cat sat on a mat 42"
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_token_id, tok.pad_token_id]) == text  # specials skipped
    expected = {"bpe": (1, 0), "hf": (1, 0), "sentencepiece": (3, 0)}[kind]
    assert (tok.eos_token_id, tok.pad_token_id) == expected


def test_chat_template_comes_from_the_tokenizer_config(tokenizer_dirs: dict[str, Path]) -> None:
    tok = load_tokenizer(tokenizer_dirs["hf"])
    assert tok.has_chat_template
    assert tok.chat_text(MESSAGES) == "<|system|>be brief</s><|user|>the cat sat</s><|assistant|>"
    ids = tok.encode(tok.chat_text(MESSAGES))
    assert ids.count(tok.eos_token_id) == 2  # '</s>' in the template is the special token, not characters


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_tokenizers_without_a_template_use_the_documented_fallback(
    kind: str, tokenizer_dirs: dict[str, Path]
) -> None:
    tok = load_tokenizer(tokenizer_dirs[kind])
    assert not tok.has_chat_template
    assert tok.chat_text(MESSAGES) == "system: be brief\nuser: the cat sat\nassistant: "
    assert (
        fallback_chat_text(MESSAGES, add_generation_prompt=False) == "system: be brief\nuser: the cat sat\n"
    )


def test_a_sentencepiece_file_loads_directly(tokenizer_dirs: dict[str, Path]) -> None:
    tok = load_tokenizer(tokenizer_dirs["sentencepiece"] / "tokenizer.model")
    assert tok.decode(tok.encode("a big red box")) == "a big red box"


def test_unusable_folders_are_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=f"{tmp_path}: no tokenizer.json or sentencepiece .model"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no such tokenizer folder"):
        load_tokenizer(tmp_path / "absent")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    with pytest.raises(TokenizerError, match="names no EOS token"):
        load_tokenizer(tmp_path)
