"""A bare ``tokenizer.json`` takes its EOS from the common spellings; the plain chat fallback is announced
once, naming the folder; a hub id given as a tokenizer folder is named as one."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from mcore_rl.data.tokenizer import EOS_CANDIDATES, TokenizerError, load_tokenizer, write_tokenizer_config

MESSAGES = [{"role": "user", "content": "a b"}]


def bare_tokenizer(folder: Path, special: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "<unk>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(special)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize(
    "eos", ["<|eos|>", "</s>", "<|endoftext|>", "<|im_end|>", "<eos>", "<|eot_id|>", "<|end|>"]
)
def test_a_bare_tokenizer_json_finds_the_common_eos_spellings(eos: str, tmp_path: Path) -> None:
    tok = load_tokenizer(bare_tokenizer(tmp_path, ["<pad>", eos]))
    assert (tok.eos_token_id, tok.pad_token_id) == (4, 3)
    assert eos in EOS_CANDIDATES


def test_no_eos_spelling_names_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(
        TokenizerError, match=r"names no EOS token \(none of its special tokens is one of </s>"
    ):
        load_tokenizer(bare_tokenizer(tmp_path, ["<stop>"]))


def test_the_plain_chat_fallback_warns_once_naming_the_folder(tmp_path: Path) -> None:
    folder = bare_tokenizer(tmp_path / "bare", ["<|eos|>"])
    tok = load_tokenizer(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tok.chat_text(MESSAGES) == "user: a b\nassistant: "
        tok.chat_text(MESSAGES)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"{folder}: the tokenizer has no chat template (no tokenizer_config.json)")
    # a config with a template: no warning
    write_tokenizer_config(str(folder), eos_token="<|eos|>", chat_template="{{ messages[0]['content'] }}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_tokenizer(folder).chat_text(MESSAGES) == "a b"
    assert not caught


def test_a_hub_id_as_tokenizer_folder_says_no_downloads(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        TokenizerError, match=r"Qwen/Qwen2\.5-0\.5B-Instruct: no such tokenizer folder .*no downloads"
    ):
        load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path / "absent")
    assert "no downloads" not in str(info.value)
