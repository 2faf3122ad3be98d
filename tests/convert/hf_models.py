"""Tiny HF models built locally with transformers (random weights, no hub) for conversion tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.models import tiny_hf_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny model's positions and frequencies fall in every llama3 band.
    "original_max_position_embeddings": 16,
}
# Qwen3's long-context setting as its model card gives it (factor 4 over the pretraining length), that length
# a quarter of the tiny model's 64 positions, so that transformers finds the two consistent
QWEN3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> (family, overrides): the variants every correctness test covers.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2-tied-bias": ("qwen2", {}),
    "mistral-window": ("mistral", {}),
    "qwen3-qk-norm": ("qwen3", {}),  # q/k RMSNorm per head, head_dim 24 (not hidden / heads = 16)
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),  # as Qwen3-0.6B to 4B ship
    "qwen3-yarn": ("qwen3", {"rope_parameters": QWEN3_YARN}),  # YaRN's frequencies and attention factor
}
# The mixture-of-experts variants (routing, per-expert names); tests/convert/test_moe.py covers them.
MOE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": ("qwen3_moe", {}),  # top-2 of 4 renormalised, layer 1 dense (mlp_only_layers)
    "qwen3-moe-unnormed": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": []}),
    "mixtral": ("mixtral", {}),  # sliding window 8 honoured
}


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model of ``tiny_hf_config(family)`` with every weight random (biases and norms too)."""
    import transformers

    cfg = tiny_hf_config(family, **overrides)
    architecture = cfg.pop("architectures")[0]
    config = transformers.AutoConfig.for_model(**cfg, architectures=[architecture])
    model = getattr(transformers, architecture)(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.05
            param.copy_(1.0 + noise if "norm" in name else noise)
    return model.eval()


def save_hf_model(
    directory: str,
    family: str,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    with_tokenizer: bool = False,
    **overrides: Any,
) -> str:
    model = build_hf_model(family, **overrides).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    if with_tokenizer:
        save_word_tokenizer(directory)
    return directory


def save_word_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)


@torch.no_grad()
def hf_logits(directory: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [b, s, vocab] for a saved model folder."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model(input_ids=tokens).logits.float()


def listing(directory: str) -> list[str]:
    return sorted(os.listdir(directory))
