"""Tokenizers from local folders: Hugging Face ``tokenizer.json`` and sentencepiece ``.model``.

:func:`load_tokenizer` picks the kind from the files it finds (never the network):

* ``tokenizer_config.json`` (with ``tokenizer.json``): transformers' ``AutoTokenizer`` with
  ``local_files_only``; EOS, PAD and the chat template come from that config.
* ``tokenizer.json`` alone: the ``tokenizers`` library; EOS is the first of :data:`EOS_CANDIDATES` among
  its special tokens.
* a sentencepiece ``*.model`` (a folder holding one, or the file): EOS/PAD from the model's ids.

PAD falls back to EOS when the tokenizer has none (as verl does); the loss never sees padding.

Chat prompts go through the tokenizer's own template when it has one. Otherwise the documented fallback
renders each message as ``"<role>: <content>\\n"`` and, for the generation prompt, appends
``"assistant: "`` (a warning naming the folder says so, once); plain-text prompts are always encoded as
they are.
"""

from __future__ import annotations

import glob
import json
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

from mcore_rl.io.errors import InputError

EOS_CANDIDATES = (
    "</s>",
    "<|endoftext|>",
    "<|im_end|>",
    "<eos>",
    "<|eos|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|eot|>",
    "[SEP]",
)
"""Special tokens taken as EOS by a bare ``tokenizer.json`` (no config naming one), in this order: the
spellings of Llama/Mistral, GPT-2/Qwen, ChatML, Gemma, Llama 3, Phi-3 and BERT-style vocabularies."""

Message = dict[str, str]


class TokenizerError(InputError):
    """A tokenizer folder we cannot use; the message names the path."""


def _warn_no_template(path: str, why: str) -> None:
    warnings.warn(
        f"{path}: the tokenizer has no chat template ({why}): chat prompts are rendered as plain "
        "'role: content' lines plus 'assistant: '; if the model was trained with a template, put it in "
        "tokenizer_config.json (chat_template) next to tokenizer.json",
        UserWarning,
        stacklevel=3,
    )


def fallback_chat_text(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The template for tokenizers without one: ``"role: content\\n"`` per message (+ ``"assistant: "``)."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


class Tokenizer(Protocol):
    """What datasets, rollouts and rewards need from a tokenizer."""

    eos_token_id: int
    pad_token_id: int
    vocab_size: int
    has_chat_template: bool
    text_prefix: list[int]
    """What the tokenizer puts before a text it encodes on its own (Llama's BOS; [] for Qwen): a prompt given
    as plain text starts with it, as ``tokenizer(text)`` would (a chat template writes its own)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no BOS/EOS added."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def chat_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation: the tokenizer's template, else :func:`fallback_chat_text`.
        ``tools``: OpenAI function schemas the template renders (its ``tools`` argument, as transformers
        passes it); the fallback has no place for them and leaves them out."""
        ...


# tokenizer_class values that mean "the tokenizer.json as saved" rather than a model-specific class.
_GENERIC_TOKENIZER_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


def _load_transformers_tokenizer(path: str) -> Any:
    """The folder's tokenizer with the pipeline its ``tokenizer.json`` describes.

    transformers 5's ``AutoTokenizer`` prefers the class of ``config.json``'s ``model_type`` over a generic
    ``tokenizer_class``, and model classes such as ``Qwen2Tokenizer`` rebuild their own pre-tokenizer: the
    same tokenizer files would then encode differently in an HF model folder than in a checkpoint's
    ``hf_assets/`` (no ``config.json``). A generic or missing ``tokenizer_class`` therefore loads the
    ``tokenizer.json`` as saved, wherever it lies; a named class (real hub tokenizers) is honoured.
    """
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        try:
            named = json.load(f).get("tokenizer_class")
        except (ValueError, AttributeError) as err:
            raise ValueError(f"tokenizer_config.json is not a JSON object ({err})") from None
    if named in _GENERIC_TOKENIZER_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class HFTokenizer:
    """A transformers tokenizer (config present) or a bare ``tokenizers.Tokenizer``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._hf: Any = None
        self._raw: Any = None
        if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            try:
                self._hf = _load_transformers_tokenizer(path)
            except (OSError, ValueError) as err:
                raise TokenizerError(f"{path}: transformers cannot load the tokenizer: {err}") from None
            eos, pad = self._hf.eos_token_id, self._hf.pad_token_id
            self.vocab_size = len(self._hf)
            self.has_chat_template = bool(getattr(self._hf, "chat_template", None))
        else:
            from tokenizers import Tokenizer as RawTokenizer

            self._raw = RawTokenizer.from_file(os.path.join(path, "tokenizer.json"))
            special = {t.content for t in self._raw.get_added_tokens_decoder().values() if t.special}
            eos = next((self._raw.token_to_id(t) for t in EOS_CANDIDATES if t in special), None)
            pad = next(
                (self._raw.token_to_id(t) for t in ("<pad>", "[PAD]", "<|pad|>") if t in special), None
            )
            self.vocab_size = self._raw.get_vocab_size(with_added_tokens=True)
            self.has_chat_template = False
        if eos is None:
            raise TokenizerError(
                f"{path}: the tokenizer names no EOS token (none of its special tokens is one of "
                f"{' '.join(EOS_CANDIDATES)}): add a tokenizer_config.json with eos_token"
            )
        self.eos_token_id = int(eos)
        self.pad_token_id = int(eos if pad is None else pad)
        self._warned = False
        self.text_prefix = self._bos_prefix()

    def _bos_prefix(self) -> list[int]:
        if self._hf is not None:
            ids = list(self._hf.encode("", add_special_tokens=True))
            return ids if len(ids) == 1 and ids[0] == self._hf.bos_token_id else []
        encoding = self._raw.encode("", add_special_tokens=True)
        special = {t.content for t in self._raw.get_added_tokens_decoder().values() if t.special}
        return list(encoding.ids) if len(encoding.ids) == 1 and encoding.tokens[0] in special else []

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._raw.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        backend = self._hf if self._hf is not None else self._raw
        return str(backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def chat_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        if not self.has_chat_template:
            if not self._warned:
                self._warned = True
                config = (
                    "no tokenizer_config.json"
                    if self._hf is None
                    else "its tokenizer_config.json has no chat_template"
                )
                _warn_no_template(self.path, config)
            return fallback_chat_text(messages, add_generation_prompt)
        text = self._hf.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **({"tools": list(tools)} if tools else {}),
        )
        return str(text)


class SentencePieceTokenizer:
    """A sentencepiece ``.model``; it has no chat template (the fallback applies)."""

    has_chat_template = False

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self.path = model_file
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"{model_file}: not a sentencepiece model ({err})") from None
        eos, pad = self._sp.eos_id(), self._sp.pad_id()
        if eos < 0:
            raise TokenizerError(
                f"{model_file}: the sentencepiece model has no EOS id (train with eos_id >= 0)"
            )
        self.eos_token_id = int(eos)
        self.pad_token_id = int(pad if pad >= 0 else eos)
        self.vocab_size = int(self._sp.get_piece_size())
        self.text_prefix: list[int] = []  # its encode adds no BOS, and this reader never did
        self._warned = False

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        kept = [int(i) for i in ids]
        if skip_special_tokens:
            kept = [i for i in kept if not self._sp.is_control(i)]
        return str(self._sp.decode(kept))

    def chat_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        if not self._warned:
            self._warned = True
            _warn_no_template(self.path, "a sentencepiece model carries none")
        return fallback_chat_text(messages, add_generation_prompt)


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer in a local folder (or a sentencepiece ``.model`` file); see the module docstring."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".model"):
        return SentencePieceTokenizer(path)
    if not os.path.isdir(path):
        hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) and not os.path.exists(path)
        hint = "; tokenizers are read from local folders (no downloads): a hub id?" if hub_id else ""
        raise TokenizerError(f"{path}: no such tokenizer folder or .model file{hint}")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    models = sorted(glob.glob(os.path.join(path, "*.model")))
    if models:
        return SentencePieceTokenizer(models[0])
    found = ", ".join(sorted(os.listdir(path))) or "nothing"
    raise TokenizerError(f"{path}: no tokenizer.json or sentencepiece .model here (found: {found})")


def write_tokenizer_config(path: str, **fields: Any) -> None:
    """Write ``tokenizer_config.json`` next to a ``tokenizer.json`` (e.g. eos_token, chat_template)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **fields}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
