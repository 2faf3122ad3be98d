"""A prompt given as plain text starts as the tokenizer starts a text it encodes on its own: Llama-3's
``<|begin_of_text|>`` first (the model never saw a sequence without it), nothing for a tokenizer that adds
none; a chat template writes its own, exactly once."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.pre_tokenizers import ByteLevel

from mcore_rl.data.prompts import encode_prompt
from mcore_rl.data.tokenizer import load_tokenizer

TEMPLATE = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}<|start_header_id|>"
    "{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _tokenizer(folder: Path, adds_bos: bool) -> str:
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    bos = tok.token_to_id("<|begin_of_text|>")
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def test_plain_text_prompts_start_with_the_bos_the_tokenizer_adds(tmp_path: Path) -> None:
    llama = load_tokenizer(_tokenizer(tmp_path / "llama", adds_bos=True))
    bos = llama.text_prefix[0]
    assert encode_prompt("Q: 1+1?", llama, chat_template=True)[:2] == [bos, llama.encode("Q")[0]]
    messages = [{"role": "user", "content": "Q: 1+1?"}]
    templated = encode_prompt(messages, llama, chat_template=True)
    assert templated[0] == bos and templated.count(bos) == 1  # the template's own, not a second
    assert encode_prompt(messages, llama, chat_template=False)[0] == bos  # joined contents are plain text

    plain = load_tokenizer(_tokenizer(tmp_path / "plain", adds_bos=False))
    assert plain.text_prefix == [] and encode_prompt("Q: 1+1?", plain, chat_template=True) == plain.encode(
        "Q: 1+1?"
    )
    assert not os.path.exists(tmp_path / "plain" / "special_tokens_map.json")  # nothing written by loading
