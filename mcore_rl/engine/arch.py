"""Model architecture read from a Hugging Face ``config.json``: the Llama family (Llama 2/3, Qwen2, Qwen3,
Mistral) and its mixture-of-experts members (Qwen3-MoE, Mixtral).

This module is pure (no megatron, no process groups, no torch): it turns the HF config into one typed record,
every field checked and named when wrong. ``engine/rope.py`` computes the rotary frequencies from it exactly
as ``transformers`` does, so that converted checkpoints reproduce HF logits; ``engine/model.py`` turns an
:class:`ModelArch` into megatron-core modules.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.io.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# What transformers' config class of each family (``LlamaConfig``, ..., ``MixtralConfig``) takes for a field a
# config.json leaves out, so that we build the model transformers builds from the same file. head_dim None:
# hidden_size // num_attention_heads; sliding_window None: full attention (read for Mistral and Mixtral only).
# Kept here rather than read from transformers' classes at run time: this module stays pure and cheap to
# import (transformers takes seconds), and needs no class an older transformers lacks (Qwen3's came in 4.51);
# tests/engine/test_arch.py holds every value to what the installed transformers builds.
HF_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": None},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": None},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": None, "sliding_window": 4096},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": None},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "head_dim": None, "sliding_window": None},
}


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts MLP of Qwen3-MoE and Mixtral: a softmax router picks ``top_k`` of ``num_experts``
    SwiGLU experts per token; layers not in :attr:`layers` keep a dense MLP of ``ModelArch.ffn_hidden_size``."""

    num_experts: int
    """Routed experts per MoE layer (HF ``num_experts`` / ``num_local_experts``; megatron ``num_moe_experts``)."""
    top_k: int
    """Experts each token is sent to (HF ``num_experts_per_tok``; megatron ``moe_router_topk``)."""
    ffn_hidden_size: int
    """Intermediate size of one expert (HF ``moe_intermediate_size``, Mixtral ``intermediate_size``)."""
    layers: tuple[int, ...]
    """Global indices of the MoE layers (Qwen3-MoE: every ``decoder_sparse_step``-th, minus ``mlp_only_layers``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k probabilities to sum to 1 (Mixtral always; Qwen3-MoE's ``norm_topk_prob``). False
    keeps the softmax over all experts (megatron ``moe_router_pre_softmax``)."""
    router_aux_loss_coef: float = 0.0
    """The checkpoint's load-balancing loss coefficient (HF ``router_aux_loss_coef``); the run decides whether
    to use it (``model.moe_aux_loss_coeff``)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{_MOE_FIELD[name]} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.top_k} is larger than the number of experts ({self.num_experts})"
            )
        if not self.layers:
            raise ConfigError(
                "no layer is a mixture-of-experts layer (decoder_sparse_step / mlp_only_layers)"
            )
        if self.top_k == 1 and self.norm_topk_prob:
            # the one expert's weight is then 1 whatever the router says: no gradient reaches the router, and
            # megatron refuses it with a command-line flag's name (--moe-router-pre-softmax)
            raise ConfigError(
                "num_experts_per_tok=1 with renormalised top-k probabilities (norm_topk_prob; always for "
                "Mixtral): the expert's weight is always 1; top-1 routing trains with norm_topk_prob=false"
            )


_MOE_FIELD = {
    "num_experts": "num_experts",
    "top_k": "num_experts_per_tok",
    "ffn_hidden_size": "moe_intermediate_size",
}


@dataclass(frozen=True)
class ModelArch:
    """Decoder-only transformer with RMSNorm, SwiGLU MLP, rotary embeddings and grouped-query attention."""

    family: str
    """'llama', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe' or 'mixtral' (the HF architecture the weights come
    from)."""
    vocab_size: int
    """Real vocabulary size (megatron pads it to a multiple of ``divisible_by * tp``)."""
    hidden_size: int
    ffn_hidden_size: int
    """Intermediate size of the gated MLP (HF ``intermediate_size``)."""
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (HF ``num_key_value_heads``); equal to the heads without GQA."""
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """HF rope parameters besides theta, e.g. ``{'rope_type': 'llama3', 'factor': 8.0, ...}``; None = plain."""
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2 always; Llama and Qwen3 with ``attention_bias``)."""
    qk_norm: bool = False
    """RMSNorm over each head's ``head_dim`` on queries and keys before rotary (Qwen3's ``q_norm``/``k_norm``;
    megatron's ``qk_layernorm``), with the model's ``norm_eps``."""
    sliding_window: int | None = None
    """Mistral's attention window in tokens (query i sees keys i-W+1..i); None = full causal attention."""
    initializer_range: float = 0.02
    moe: MoESpec | None = None
    """The mixture-of-experts MLP (Qwen3-MoE, Mixtral); None for a dense model."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """The untouched HF config, kept for writing ``config.json`` back out."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "ffn_hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_query_groups}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type={rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has the mixture-of-experts MLP."""
        return self.moe is not None and layer in self.moe.layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | os.PathLike[str]) -> ModelArch:
        """From a ``config.json`` dict, the file, or a checkpoint folder holding it."""
        source = "config"
        if isinstance(config, dict):
            raw = config
        else:
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            source = path
            try:
                with open(path) as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"{path}: no such file") from None
            except OSError as err:
                raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ConfigError(f"{path}: not valid JSON ({err})") from None
        try:
            return _arch_from_dict(raw)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None


def _arch_from_dict(cfg: dict[str, Any]) -> ModelArch:
    if not isinstance(cfg, dict):
        raise ConfigError(f"expected a JSON object, found {type(cfg).__name__}")
    architectures = cfg.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"architectures must be a list of names, got {architectures!r}")
    family = next((SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise ConfigError(
            f"architectures={architectures} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")
    if _bool(cfg, "mlp_bias", False):
        raise ConfigError("mlp_bias=true is not supported")
    if family in ("qwen2", "qwen3", "qwen3_moe") and _bool(cfg, "use_sliding_window", False):
        # refused, not ignored: HF would window some layers (max_window_layers), we would not
        raise ConfigError(f"use_sliding_window=true is not supported for {family.capitalize()}")
    for key in ("dtype", "torch_dtype"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise ConfigError(f"{key} must be a dtype name such as 'bfloat16', got {cfg[key]!r}")
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    defaults = HF_CONFIG_DEFAULTS[family]
    rope, rope_theta, partial = _rope(cfg, family, defaults["rope_theta"])
    # An absent field takes the family's default; an explicit null means hidden // heads for head_dim (as
    # transformers' attention reads it) and no window for sliding_window (Mistral v0.2+ configs say so).
    head_dim = _int(cfg, "head_dim", None) if "head_dim" in cfg else defaults["head_dim"]
    if head_dim is None and hidden % heads:
        raise ConfigError(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (no head_dim)"
        )
    window = None
    if family in ("mistral", "mixtral"):
        window = _int(cfg, "sliding_window", None) if "sliding_window" in cfg else defaults["sliding_window"]
    num_layers = _int(cfg, "num_hidden_layers")
    return ModelArch(
        family=family,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        ffn_hidden_size=_int(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_query_groups=_int(cfg, "num_key_value_heads", heads),
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=_int(cfg, "max_position_embeddings"),
        norm_eps=_float(cfg, "rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        partial_rotary_factor=partial,
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
        # transformers' Mistral and Mixtral attention has no bias, whatever a stray attention_bias says
        qkv_bias=family == "qwen2"
        or (family not in ("mistral", "mixtral") and _bool(cfg, "attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=window,
        initializer_range=_float(cfg, "initializer_range", 0.02, positive=False),
        moe=_moe(cfg, family, num_layers) if family in MOE_FAMILIES else None,
        extra=dict(cfg),
    )


def _moe(cfg: dict[str, Any], family: str, num_layers: int) -> MoESpec:
    """The MoE fields of a Qwen3-MoE or Mixtral config, each type-checked and named when wrong."""
    if family == "mixtral":
        if _float(cfg, "router_jitter_noise", 0.0, positive=False) > 0:
            # training-time noise on the router input: the rollout and the trainer would route differently
            raise ConfigError(
                "router_jitter_noise > 0 is not supported (it makes routing random in training)"
            )
        num_experts = _int(cfg, "num_local_experts")
        return MoESpec(
            num_experts=num_experts,
            top_k=_int(cfg, "num_experts_per_tok"),
            ffn_hidden_size=_int(cfg, "intermediate_size"),
            layers=tuple(range(num_layers)),
            norm_topk_prob=True,
            router_aux_loss_coef=_float(cfg, "router_aux_loss_coef", 0.001, positive=False),  # transformers
        )
    # Qwen3-MoE: hub configs say num_experts; transformers 5 saves num_local_experts (its attribute map)
    experts = {k: _int(cfg, k, None) for k in ("num_experts", "num_local_experts")}
    if None not in experts.values() and len(set(experts.values())) > 1:
        raise ConfigError(
            f"num_experts={experts['num_experts']} and num_local_experts={experts['num_local_experts']} differ"
        )
    num_experts = experts["num_experts"] or experts["num_local_experts"]
    if num_experts is None:
        raise ConfigError("missing field 'num_experts'")
    step = _int(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense
    ):
        raise ConfigError(
            f"mlp_only_layers must be a list of layer indices below {num_layers}, got {dense!r}"
        )
    if _int(cfg, "shared_expert_intermediate_size", None):
        raise ConfigError("shared_expert_intermediate_size is not supported (Qwen3-MoE has no shared expert)")
    return MoESpec(
        num_experts=num_experts,
        top_k=_int(cfg, "num_experts_per_tok"),
        ffn_hidden_size=_int(cfg, "moe_intermediate_size"),
        layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        norm_topk_prob=_bool(cfg, "norm_topk_prob", False),
        router_aux_loss_coef=_float(cfg, "router_aux_loss_coef", 0.0, positive=False),
    )


_REQUIRED = object()
# Fields each rope type needs (transformers reads them unchecked); "factor" must be > 0 for all.
_ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}


def _rope(cfg: dict[str, Any], family: str, default_theta: float) -> tuple[dict[str, Any], float, float]:
    """(rope parameters besides theta, rope_theta, partial_rotary_factor), every field type-checked;
    ``default_theta`` where the config gives no rope_theta."""
    key, rope = _rope_source(cfg)
    rope_theta = _float(
        rope, "rope_theta", _float(cfg, "rope_theta", default_theta), field=f"{key}.rope_theta"
    )
    rope.pop("rope_theta", None)
    dropped = (cfg.get("rope_parameters") or {}).get("rope_theta") if key == "rope_scaling" else None
    if dropped is not None and dropped != rope_theta:  # transformers would build it at rope_theta silently
        raise ConfigError(
            f"rope_scaling replaces rope_parameters (as transformers reads them), whose rope_theta={dropped} "
            f"would give way to {rope_theta}: put rope_theta in rope_scaling, or keep one of the two"
        )
    rope_type = rope.get("rope_type", "default")
    if not isinstance(rope_type, str):
        raise ConfigError(f"{key}.rope_type must be a name, got {rope_type!r}")
    for name in _ROPE_FIELDS.get(rope_type, ()):
        _float(rope, name, _REQUIRED, field=f"{key}.{name}")
    if rope_type == "llama3" and rope["high_freq_factor"] <= rope["low_freq_factor"]:
        raise ConfigError(f"{key}.high_freq_factor must exceed {key}.low_freq_factor")
    if rope_type == "yarn":
        _check_yarn(cfg, rope, key)
    partial = _float(rope, "partial_rotary_factor", _float(cfg, "partial_rotary_factor", 1.0))
    rope.pop("partial_rotary_factor", None)
    if partial != 1.0:  # transformers' attention for these families rotates the whole head, whatever it says
        raise ConfigError(
            f"partial_rotary_factor={partial} is not supported for {family} (1.0: the whole head)"
        )
    return rope, rope_theta, partial


def _check_yarn(cfg: dict[str, Any], rope: dict[str, Any], key: str) -> None:
    """YaRN's fields type-checked, naming each, and its pretraining length taken where transformers takes it:
    a top-level ``original_max_position_embeddings`` first (Phi-3's configs keep it there), else the rope
    object's, else ``max_position_embeddings`` (engine/rope.py reads that from the arch)."""
    if rope["factor"] < 1:
        raise ConfigError(
            f"{key}.factor must be >= 1 for yarn (how much longer the context grows), got {rope['factor']}"
        )
    if cfg.get("original_max_position_embeddings") is not None:
        rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    _int(rope, "original_max_position_embeddings", None, field=f"{key}.original_max_position_embeddings")
    for name in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        _float(rope, name, 0.0, positive=False, field=f"{key}.{name}")
    if not isinstance(rope.get("truncate", True), bool):
        raise ConfigError(f"{key}.truncate must be true or false, got {rope['truncate']!r}")


def _rope_source(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the key read, a copy of its rope object in the current spelling): ``rope_scaling`` when it is set, else
    ``rope_parameters``, as transformers reads them (its rope_scaling replaces rope_parameters whole: a
    transformers 5 config carries rope_parameters, and a user adds rope_scaling as a model card says)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{key} must be an object, got {value!r}")
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    return key, _spelled(cfg.get(key) or {})


def _spelled(rope: dict[str, Any]) -> dict[str, Any]:
    """A copy of a rope object in transformers' current spelling (``type``, before 4.45, -> ``rope_type``)."""
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def _int(cfg: dict[str, Any], key: str, default: Any = _REQUIRED, field: str | None = None) -> Any:
    """A positive integer field (JSON true/false and 4.0 are not integers); ``default`` when absent/null."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"missing field {field or key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{field or key} must be a positive integer, got {value!r}")
    return value


def _float(
    cfg: dict[str, Any], key: str, default: Any, positive: bool = True, field: str | None = None
) -> float:
    """A finite number field (> 0, or >= 0 without ``positive``); ``default`` when absent/null."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"missing field {field or key!r}")
        return float(default)
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < 0 or (positive and value == 0):
        kind = "a positive number" if positive else "a number >= 0"
        raise ConfigError(f"{field or key} must be {kind}, got {value!r}")
    return float(value)


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """A JSON true/false field: the string "false" is not false (it used to read as true)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value
