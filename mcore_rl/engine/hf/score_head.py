"""HF sequence-classification models (``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``,
``MistralForSequenceClassification`` with one label): the causal body plus the ``score`` head [1, hidden].

In megatron the model is our value-head GPT (``engine/model.py`` ``ValueHead``): the body's tensors map like
the causal LM's, and ``score.weight`` is ``output_layer.weight`` [1, hidden], replicated over TP (no vocab
padding). The body is described by the causal architecture (``ModelArch`` knows only those), untied (a
classifier has no LM head to tie), and its config carries :data:`SCORE_HEAD_KEY` with what the body form
changed, so a checkpoint's ``mcore_rl_model.json`` says it holds a score head and ``mcore-to-hf`` writes the
classifier's own config back.
"""

from __future__ import annotations

from typing import Any

from mcore_rl.engine.arch import ModelArch
from mcore_rl.io.errors import ConfigError

SCORE_HEAD_KEY = "mcore_rl_score_head"
"""Key of a body config: the classifier's original ``architectures`` and ``tie_word_embeddings``."""
_SEQ_CLS = "ForSequenceClassification"


def is_classifier(cfg: dict[str, Any]) -> bool:
    """Whether an HF config describes a ``*ForSequenceClassification`` model."""
    names = cfg.get("architectures") or []
    return isinstance(names, list) and any(isinstance(n, str) and n.endswith(_SEQ_CLS) for n in names)


def num_labels(cfg: dict[str, Any]) -> Any:
    """The label count as transformers derives it: ``id2label``'s size, else ``num_labels``, else 1."""
    id2label = cfg.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else cfg.get("num_labels", 1)


def body_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The causal-LM config of a one-label classifier's body (``where`` names the file in errors)."""
    labels = num_labels(cfg)
    if labels != 1:
        raise ConfigError(f"{where}: num_labels={labels}; a reward model scores with one label")
    causal = [n.replace(_SEQ_CLS, "ForCausalLM") for n in cfg["architectures"]]
    original = {"architectures": cfg["architectures"], "tie_word_embeddings": cfg.get("tie_word_embeddings")}
    return {**cfg, "architectures": causal, "tie_word_embeddings": False, SCORE_HEAD_KEY: original}


def arch_of_config(cfg: dict[str, Any], where: str) -> ModelArch:
    """The ``ModelArch`` of a causal LM or of a classifier's body (with the score head recorded)."""
    if is_classifier(cfg):
        cfg = body_config(cfg, where)
    try:
        return ModelArch.from_hf_config(cfg)
    except ConfigError as err:
        raise ConfigError(f"{where}: {str(err).removeprefix('config: ')}") from None


def has_score_head(arch: ModelArch) -> bool:
    """Whether ``arch`` is a classifier's body, whose output layer is the [1, hidden] score head."""
    return SCORE_HEAD_KEY in arch.extra


def hf_config_of(body: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`body_config`: the HF config to write (a causal config is returned unchanged)."""
    original = body.get(SCORE_HEAD_KEY)
    if not isinstance(original, dict):
        return dict(body)
    config = {k: v for k, v in body.items() if k != SCORE_HEAD_KEY}
    config["architectures"] = original.get("architectures")
    if original.get("tie_word_embeddings") is None:
        config.pop("tie_word_embeddings", None)
    else:
        config["tie_word_embeddings"] = original["tie_word_embeddings"]
    return config


def arch_of_file(path: str) -> ModelArch:
    """:func:`arch_of_config` of a ``config.json`` (errors name the file)."""
    import json

    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        raw = None  # ModelArch.from_hf_config reports what is wrong with the file
    if isinstance(raw, dict) and is_classifier(raw):
        return arch_of_config(raw, path)
    return ModelArch.from_hf_config(path)
