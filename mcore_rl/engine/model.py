"""megatron-core GPTModel builders for :class:`~mcore_rl.engine.arch.ModelArch` (Llama, Qwen2, Qwen3, Mistral;
Qwen3-MoE and Mixtral with megatron's MoE layer).

One builder serves the actor, the reference policy, the critic and a reward model (``value_head=True``
swaps the vocab projection for a scalar head). The layer spec is Transformer-Engine's when TE imports and
CUDA is present, megatron's local spec otherwise (the CPU path). With virtual pipeline parallelism a rank
holds several model chunks, so builders always return a list (megatron's convention).

Mixture-of-experts layers are megatron's ``MoELayer``: a ``TopKRouter`` (gating in fp32, as verl recommends, so
the rollout engine can reproduce its choices), the all-to-all token dispatcher (expert parallelism over the
ranks of ``ParallelContext``'s expert mesh; on CPU its stream-free variant, ``compat/moe.py``) and the experts as
megatron's ``SequentialMLP`` on the local spec, grouped GEMM with Transformer Engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from mcore_rl.compat.fusion import masked_softmax_fusion_available, transformer_engine_available
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rope import attention_softmax_scale, rope_attention_factor, rope_inv_freq
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.layout import padded_vocab_size

if TYPE_CHECKING:
    from mcore_rl.engine.lora_spec import LoRASpec


@dataclass(frozen=True)
class ModelOptions:
    """How to instantiate an architecture (independent of which checkpoint fills it)."""

    dtype: torch.dtype = torch.float32
    """Parameter / compute dtype: torch.float32 or torch.bfloat16 (bf16 keeps fp32 main params in the optimizer)."""
    value_head: bool = False
    """Replace the vocab projection by a scalar head (critic, reward model)."""
    use_transformer_engine: bool | None = None
    """None: use TE when it imports and CUDA is present; False forces megatron's local spec."""
    make_vocab_size_divisible_by: int = 128
    """Vocab is padded to a multiple of this times TP, as megatron does."""
    max_sequence_length: int | None = None
    """Longest prompt+response the model will see; defaults to the HF ``max_position_embeddings``."""
    recompute: str = "none"
    """Activation recomputation (``model.recompute``): none, selective (core attention) or full (each layer
    keeps its input and runs again in the backward)."""
    scaled_output_init: bool = True
    """megatron's random init of the attention and MLP output projections at ``std / sqrt(2 x layers)``;
    False: at ``std`` like every other linear layer (transformers' Llama init)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE models: weight of megatron's load-balancing loss (``aux_loss``: per layer, the switch-transformer
    loss over each micro-batch's tokens); 0 disables it (and its logging)."""
    moe_z_loss_coeff: float = 0.0
    """MoE models: weight of the router z-loss (megatron ``moe_z_loss_coeff``); 0 disables it."""
    lora: LoRASpec | None = None
    """LoRA adapters on the frozen base (``engine/lora.py``; ``TrainEngine.build`` adds them); they need
    megatron's local layer spec, which is then used on every device (TE's linears are not wrapped)."""
    keep_logits_bytes: int | None = None
    """Bytes of a micro-batch's logits the LM head's forward keeps for its backward, which then skips their
    GEMM (``model.keep_logits_gib``); None: ``engine/lm_head.py``'s default for the device."""

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {self.dtype}")
        if self.keep_logits_bytes is not None and self.keep_logits_bytes < 0:
            raise ValueError(f"model.keep_logits_gib must be at least 0, got {self.keep_logits_bytes} bytes")


def transformer_config(arch: ModelArch, ctx: ParallelContext, options: ModelOptions) -> Any:
    """megatron ``TransformerConfig`` for ``arch`` in ``ctx``'s layout."""
    from megatron.core.transformer import TransformerConfig

    layout = ctx.layout
    layout.check_model(
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        num_layers=arch.num_layers,
        vocab_size=arch.vocab_size,
        num_experts=arch.moe.num_experts if arch.moe else None,
        moe_ffn_hidden_size=arch.moe.ffn_hidden_size if arch.moe else None,
    )
    fused = torch.cuda.is_available()  # megatron's fused kernels are CUDA-only
    bf16 = options.dtype == torch.bfloat16
    extra = _optional_config(arch, ctx, options)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,  # Qwen3: RMSNorm over head_dim on q and k before rotary
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
        cp_comm_type=_cp_comm_type(arch, layout.cp),
        params_dtype=options.dtype,
        pipeline_dtype=options.dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False,
        # On CPU, compat.megatron_cpu fills megatron's fused-SwiGLU slot with ours (compat/cpu_layers.py)
        bias_activation_fusion=True,
        masked_softmax_fusion=masked_softmax_fusion_available(_uses_te(options)),  # see compat/fusion.py
        bias_dropout_fusion=fused,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=True,  # RL batches change length every step; PP must exchange shapes
        # every loss is its share of the global token count (TrainEngine); set here, not after the build:
        # megatron's MoE router copies the flag when built and scales its losses by the tokens only with it
        calculate_per_token_loss=True,
        **extra,
    )


def _optional_config(arch: ModelArch, ctx: ParallelContext, options: ModelOptions) -> dict[str, Any]:
    """The ``TransformerConfig`` fields that only some models, layouts or options set."""
    layout = ctx.layout
    extra: dict[str, Any] = {}
    if options.recompute == "full":
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif options.recompute == "selective":  # megatron's default module list: core attention
        extra.update(recompute_granularity="selective")
    if layout.pp == 2:  # megatron crosses the shapes of a two-stage exchange (compat/pipeline_shapes.py)
        from mcore_rl.compat.pipeline_shapes import patch_shape_exchange

        patch_shape_exchange()
    if layout.vpp and layout.pp == 2:
        # Interleaved PP2 sends to the same peer in both directions at once; batched p2p then pairs the two
        # messages by posting order and swaps activations with gradients (silently: same shapes). megatron's
        # unbatched path routes the two directions through different groups.
        extra["batch_p2p_comm"] = False
    if arch.sliding_window is not None:
        extra["window_size"] = (arch.sliding_window - 1, 0)
    if rope_attention_factor(arch) != 1.0:  # YaRN: its cos/sin factor on q and k, as one logit scale
        extra["softmax_scale"] = attention_softmax_scale(arch)
    if not options.scaled_output_init:
        from megatron.core.utils import init_method_normal

        extra["output_layer_init_method"] = init_method_normal(arch.initializer_range)
    if arch.moe is not None:
        extra.update(_moe_config(arch, ctx, options))
    else:
        extra["moe_token_dispatcher_type"] = "alltoall"  # dense; megatron rejects its default without experts
    if _has_config_field("cuda_graph_scope"):
        # megatron 0.16's default "full" warns on every config built ("full scope is deprecated", on the
        # console of every eval and torchrun rank); [] is the same whole-layer scope in its newer spelling
        extra["cuda_graph_scope"] = []
    return extra


def _has_config_field(name: str) -> bool:
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    return name in {f.name for f in dataclasses.fields(TransformerConfig)}


def _cp_comm_type(arch: ModelArch, cp: int) -> str | None:
    """How TE's attention exchanges keys and values under context parallelism: its ring of point-to-point
    blocks, overlapped with compute; the all-gather for sliding windows, which TE's ring refuses. The local
    spec's CP attention is ours (``compat/context_attention.py``) and reads neither."""
    if cp == 1:
        return None
    return "all_gather" if arch.sliding_window is not None else "p2p"


def _moe_config(arch: ModelArch, ctx: ParallelContext, options: ModelOptions) -> dict[str, Any]:
    """megatron's MoE fields for ``arch.moe``: routing as HF's (softmax, top-k, renormalised when
    ``norm_topk_prob``: megatron's top-k-then-softmax is the same function), the router in fp32, no token
    dropping, the all-to-all dispatcher."""
    moe = arch.moe
    assert moe is not None
    balancing = "aux_loss" if options.moe_aux_loss_coeff > 0 else "none"
    grouped = _uses_te(options)  # TE's grouped GEMM; megatron's SequentialMLP (one GEMM per expert) otherwise
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_layer_freq": [int(arch.is_moe_layer(i)) for i in range(arch.num_layers)],
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": balancing,
        "moe_aux_loss_coeff": options.moe_aux_loss_coeff,
        "moe_z_loss_coeff": options.moe_z_loss_coeff or None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": grouped,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "expert_model_parallel_size": ctx.layout.ep,
        "expert_tensor_parallel_size": ctx.layout.expert_tp,
    }


class ValueHead(torch.nn.Module):
    """Scalar head replacing ``GPTModel.output_layer``: hidden [s, b, h] -> values [s, b, 1].

    Replicated on every TP rank. Under sequence parallelism the hidden states arrive split by sequence,
    so they are gathered first; every rank then sees the full sequence and computes identical grads, so the
    gather's backward keeps each rank's own slice (megatron's default, a reduce-scatter for a vocab-parallel
    head whose ranks hold partial gradients, summed TP identical ones: the body's gradient x TP).
    """

    def __init__(self, hidden_size: int, config: Any, init_std: float, seed: int) -> None:
        super().__init__()
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype))
        # A private generator: identical weights on every TP/PP rank whatever RNG the model init used.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(1, hidden_size, generator=generator) * init_std)
        if torch.cuda.is_available():
            self.weight.data = self.weight.data.cuda()

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight), None


def build_model_chunks(
    arch: ModelArch, ctx: ParallelContext, options: ModelOptions | None = None
) -> list[Any]:
    """This rank's model chunks (one per virtual pipeline stage), initialised randomly.

    Load real weights afterwards (``mcore_rl.convert`` or a distributed checkpoint).
    """
    from megatron.core.models.gpt import GPTModel

    options = options or ModelOptions()
    config = transformer_config(arch, ctx, options)
    if arch.moe is not None and not _uses_te(options):
        from mcore_rl.compat import moe as moe_compat

        moe_compat.fix_router_gemm_without_te()
    vocab = padded_vocab_size(arch.vocab_size, ctx.tp_size, options.make_vocab_size_divisible_by)
    max_len = options.max_sequence_length or arch.max_position_embeddings
    inv_freq = rope_inv_freq(arch)
    chunks = []
    for vp_stage in range(ctx.layout.num_model_chunks):
        vp = vp_stage if ctx.layout.vpp else None
        post_process = ctx.holds_last_layers(vp)
        model = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(options, arch, config, ctx, vp),
            vocab_size=vocab,
            max_sequence_length=max_len,
            pre_process=ctx.holds_first_layers(vp),
            post_process=post_process,
            share_embeddings_and_output_weights=arch.tie_word_embeddings and not options.value_head,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            rotary_percent=arch.partial_rotary_factor,
            vp_stage=vp,
        )
        # transformers' exact frequencies (incl. llama3 scaling, whose constants megatron hard-codes).
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
        if options.value_head and post_process:
            model.output_layer = ValueHead(arch.hidden_size, config, arch.initializer_range, ctx.seed)
        chunks.append(model.to(ctx.device))
    return chunks


def _uses_te(options: ModelOptions) -> bool:
    """The layer spec's choice: the option when set, else whether TE's PyTorch extension imports."""
    use_te = options.use_transformer_engine
    if options.lora is not None:  # LoRA wraps the local spec's linears (engine/lora.py)
        if use_te:
            raise ValueError(
                "model.lora_rank: LoRA needs megatron's local layer spec, not Transformer Engine's"
            )
        return False
    return transformer_engine_available() if use_te is None else use_te


def _layer_spec(
    options: ModelOptions,
    arch: ModelArch,
    config: Any = None,
    ctx: ParallelContext | None = None,
    vp: int | None = None,
) -> Any:
    """The layer spec: one for every layer of a dense model; for an MoE model (``config`` and ``ctx`` needed)
    megatron's block spec, one per layer of this rank's chunk ``vp`` (MoE and dense layers mixed)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from mcore_rl.compat.cpu_layers import local_spec

    if arch.moe is not None:  # per-layer specs: MoE layers and dense ones (Qwen3-MoE's mlp_only_layers)
        assert config is not None and ctx is not None, "an MoE layer spec needs the config and the context"
        block = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=_uses_te(options),
            normalization="RMSNorm",
            vp_stage=vp,
            pp_rank=ctx.pp_rank,
        )
        if not _uses_te(options):
            block.layer_specs = [local_spec(layer) for layer in block.layer_specs]
        return block
    if _uses_te(options):
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    # The local spec with torch's fused attention: fewer elementwise passes (compat/cpu_layers.py)
    return local_spec(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm))
