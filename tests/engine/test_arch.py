"""HF config.json -> ModelArch, and rotary frequencies identical to transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rope import rope_attention_factor, rope_inv_freq
from mcore_rl.io.errors import ConfigError
from tests.models import tiny_hf_config


def test_llama_fields_and_gqa():
    arch = ModelArch.from_hf_config(tiny_hf_config("llama"))
    assert (arch.family, arch.num_attention_heads, arch.num_query_groups, arch.head_dim) == (
        "llama",
        4,
        2,
        16,
    )
    assert not arch.qkv_bias and not arch.tie_word_embeddings and arch.sliding_window is None


def test_qwen2_has_qkv_bias_and_mistral_keeps_window():
    assert ModelArch.from_hf_config(tiny_hf_config("qwen2")).qkv_bias
    assert ModelArch.from_hf_config(tiny_hf_config("mistral")).sliding_window == 8


def test_qwen3_has_qk_norms_and_its_own_head_dim():
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3"))
    assert arch.family == "qwen3" and arch.qk_norm and not arch.qkv_bias
    assert (arch.head_dim, arch.hidden_size // arch.num_attention_heads) == (24, 16)
    assert ModelArch.from_hf_config(tiny_hf_config("qwen3", attention_bias=True)).qkv_bias
    assert not ModelArch.from_hf_config(tiny_hf_config("qwen2")).qk_norm
    with pytest.raises(ConfigError, match="use_sliding_window=true is not supported for Qwen3"):
        ModelArch.from_hf_config(tiny_hf_config("qwen3", use_sliding_window=True))


def test_reads_a_checkpoint_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen2", vocab_size=300)))
    assert ModelArch.from_hf_config(tmp_path).vocab_size == 300


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "supported: \\['LlamaForCausalLM', 'MistralForCausalLM', 'MixtralForCausalLM', 'Qwen2ForCausalLM', "
            "'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\\]",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "missing field 'rope_scaling.factor'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5}}, "rope_scaling.factor must be >= 1 for yarn"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": "32"}},
            "rope_parameters.beta_fast must be a number >= 0, got '32'",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}},
            "rope_scaling.truncate must be true or false",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4.5}},
            "rope_scaling.original_max_position_embeddings must be a positive integer",
        ),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ],
)
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelArch.from_hf_config(tiny_hf_config("llama", **overrides))


def test_missing_field_and_file_errors(tmp_path):
    cfg = tiny_hf_config()
    del cfg["intermediate_size"]
    with pytest.raises(ConfigError, match="missing field 'intermediate_size'"):
        ModelArch.from_hf_config(cfg)
    with pytest.raises(ConfigError, match="no such file"):
        ModelArch.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        ModelArch.from_hf_config(tmp_path)


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    # Qwen3's long-context setting (its pretraining length small here, so that the ramp spans dimensions 0-4)
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    # gpt-oss's: an unrounded ramp and other betas
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    },
    "yarn-mscale": {  # DeepSeek-V3's: the attention factor from mscale over mscale_all_dim
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 32,
    },
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.8},
    # pretraining length from max_position_embeddings, factor 1: frequencies and scale untouched
    "yarn-factor-1": {"rope_type": "yarn", "factor": 1.0},
}


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_rope_inv_freq_matches_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    overrides = {"rope_theta": 500000.0, "max_position_embeddings": 256}
    if ROPE_CASES[name]:
        overrides["rope_scaling"] = ROPE_CASES[name]
    cfg = tiny_hf_config("llama", head_dim=64, **overrides)
    hf_config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    if name == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[name.split("-")[0]](hf_config, torch.device("cpu"))
    arch = ModelArch.from_hf_config(cfg)
    ours = rope_inv_freq(arch)
    assert ours.shape == (32,)
    assert torch.equal(ours, expected.float())
    assert rope_attention_factor(arch) == factor  # what transformers multiplies cos and sin by
    if name.startswith("yarn") and name != "yarn-factor-1":  # the case really scales
        assert rope_attention_factor(arch) != 1.0
        assert not torch.equal(
            ours,
            rope_inv_freq(
                ModelArch.from_hf_config(
                    tiny_hf_config(
                        "llama", **{"head_dim": 64, "rope_theta": 500000.0, "max_position_embeddings": 256}
                    )
                )
            ),
        )
    if name == "llama3":  # the low frequencies really were rescaled
        assert not torch.equal(
            ours,
            rope_inv_freq(
                ModelArch.from_hf_config(tiny_hf_config("llama", head_dim=64, rope_theta=500000.0))
            ),
        )


def test_moe_fields_read_from_qwen3_moe_and_mixtral():
    qwen = ModelArch.from_hf_config(tiny_hf_config("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[3]))
    assert qwen.moe is not None and qwen.qk_norm and qwen.head_dim == 24
    # HF: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert qwen.moe.layers == (1,)
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.ffn_hidden_size) == (4, 2, 32)
    assert qwen.moe.norm_topk_prob and qwen.moe.router_aux_loss_coef == 0.001
    assert qwen.ffn_hidden_size == 96  # the dense layers' MLP
    saved = tiny_hf_config("qwen3_moe")  # the hub's config.json says num_experts; transformers 5 saves
    saved["num_local_experts"] = saved.pop("num_experts")  # num_local_experts (its attribute map)
    assert ModelArch.from_hf_config(saved).moe.num_experts == 4
    mixtral = ModelArch.from_hf_config(tiny_hf_config("mixtral"))
    assert mixtral.moe is not None and mixtral.moe.layers == (0, 1, 2, 3)
    assert mixtral.moe.ffn_hidden_size == 48 and mixtral.moe.norm_topk_prob and mixtral.sliding_window == 8
    assert not ModelArch.from_hf_config(tiny_hf_config("qwen3")).is_moe


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        (
            "qwen3_moe",
            {"num_experts_per_tok": 5},
            "num_experts_per_tok=5 is larger than the number of experts",
        ),
        ("qwen3_moe", {"num_experts": "4"}, "num_experts must be a positive integer, got '4'"),
        ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive integer"),
        ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ("qwen3_moe", {"mlp_only_layers": [0, 9]}, "mlp_only_layers must be a list of layer indices below 4"),
        ("qwen3_moe", {"mlp_only_layers": [0, 1, 2, 3]}, "no layer is a mixture-of-experts layer"),
        (
            "qwen3_moe",
            {"num_experts": 8, "num_local_experts": 4},
            "num_experts=8 and num_local_experts=4 differ",
        ),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true is not supported for Qwen3_moe"),
        ("mixtral", {"num_local_experts": None}, "missing field 'num_local_experts'"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise > 0 is not supported"),
        # top-1 renormalised: weight 1 whatever the router says (megatron refused it naming its CLI flag)
        ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok=1 with renormalised top-k"),
        (
            "qwen3_moe",
            {"num_experts_per_tok": 1, "norm_topk_prob": True},
            "num_experts_per_tok=1 with renorm",
        ),
        (
            "mixtral",
            {"num_experts_per_tok": True},
            "num_experts_per_tok must be a positive integer, got True",
        ),
    ],
)
def test_bad_moe_configs_name_the_field(family, overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelArch.from_hf_config(tiny_hf_config(family, **overrides))


def test_top1_routing_over_the_softmax_of_all_experts_is_read():
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=False))
    assert arch.moe.top_k == 1 and not arch.moe.norm_topk_prob


def test_a_missing_aux_loss_coefficient_is_transformers_default():
    cfg = {k: v for k, v in tiny_hf_config("mixtral").items() if k != "router_aux_loss_coef"}
    assert ModelArch.from_hf_config(cfg).moe.router_aux_loss_coef == 0.001


_LEFT_OUT = ("rms_norm_eps", "rope_theta", "head_dim", "sliding_window")


def _transformers_reads(cfg):
    """(rms_norm_eps, rope_theta, head_dim, sliding_window) of the model transformers builds from ``cfg``."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))  # transformers 5 / 4
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # as attention does
    window = getattr(hf, "sliding_window", None) if cfg["model_type"] in ("mistral", "mixtral") else None
    return hf.rms_norm_eps, theta, head_dim, window


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_fields_a_config_leaves_out_take_transformers_defaults(family):
    # Mixtral's eps 1e-5 and theta 1e6, Mistral's window 4096, Qwen3's head_dim 128: we used 1e-6, 1e4, no
    # window and hidden // heads, building another model than transformers from the same config.json.
    cfg = {k: v for k, v in tiny_hf_config(family).items() if k not in _LEFT_OUT}
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.norm_eps, arch.rope_theta, arch.head_dim, arch.sliding_window) == _transformers_reads(cfg)


def test_a_null_sliding_window_is_no_window():
    # Mistral v0.2+ configs say "sliding_window": null: full attention, not the 4096 of a left-out field.
    cfg = tiny_hf_config("mistral", sliding_window=None)
    arch = ModelArch.from_hf_config(cfg)
    assert arch.sliding_window is None
    assert (arch.norm_eps, arch.rope_theta, arch.head_dim, arch.sliding_window) == _transformers_reads(cfg)


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it():
    """A transformers 5 config carries rope_parameters; a user adds rope_scaling as a model card says:
    transformers then reads rope_scaling whole (were we to read rope_parameters: plain rope, the yarn unseen)."""
    default = {"rope_type": "default", "rope_theta": 10000.0}
    linear = {"rope_type": "linear", "factor": 4.0}
    cfg = tiny_hf_config("llama", rope_parameters=default, rope_scaling=linear)
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.rope_scaling, arch.rope_theta) == ({"rope_type": "linear", "factor": 4.0}, 10000.0)
    assert arch.rope_theta == _transformers_reads(cfg)[1]
    yarn = {"rope_type": "yarn", "factor": 2.0}
    arch = ModelArch.from_hf_config(tiny_hf_config("llama", rope_parameters=default, rope_scaling=yarn))
    assert arch.rope_scaling == yarn  # the yarn is seen, not the plain rope beside it
    with pytest.raises(ConfigError, match="rope_type='longrope' is not supported"):
        ModelArch.from_hf_config(
            tiny_hf_config(
                "llama", rope_parameters=default, rope_scaling={"rope_type": "longrope", "factor": 2.0}
            )
        )
    # transformers would drop rope_parameters' theta for its default (Llama 3's 500000 -> 10000): refused
    with pytest.raises(ConfigError, match=r"rope_theta=500000.0 would give way to 10000.0"):
        ModelArch.from_hf_config(
            tiny_hf_config("llama", rope_parameters={**default, "rope_theta": 500000.0}, rope_scaling=linear)
        )


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_partial_rotary_is_refused_where_transformers_rotates_the_whole_head(family):
    with pytest.raises(ConfigError, match=f"partial_rotary_factor=0.5 is not supported for {family}"):
        ModelArch.from_hf_config(tiny_hf_config(family, partial_rotary_factor=0.5))


def test_a_stray_attention_bias_gives_mistral_no_bias_as_in_transformers():
    assert not ModelArch.from_hf_config(tiny_hf_config("mistral", attention_bias=True)).qkv_bias
    assert not ModelArch.from_hf_config(tiny_hf_config("mixtral", attention_bias=True)).qkv_bias
