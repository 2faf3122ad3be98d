"""Schema sections for the model and how it is trained: ``model``, ``parallel``, ``rollout``, ``algorithm``,
``optim``.

Plain dataclasses with a docstring per field; OmegaConf reads them as structured configs, so a YAML recipe
or ``key=value`` override of the wrong type fails where it is loaded. Value ranges and cross-field rules live
in :mod:`mcore_rl.config.validate` (one table that names each full dotted key). Fields whose default is
``II("...")`` are OmegaConf interpolations: they follow another key unless set (verl does the same).

Nothing here imports megatron or torch: ``mcore-rl config show`` stays instant. The ``to_*`` methods build
the component configs the engines take (they import those modules when called).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import II

if TYPE_CHECKING:
    from mcore_rl.engine.arch import ModelArch
    from mcore_rl.engine.rollout.base import SamplingParams
    from mcore_rl.engine.train_engine import OptimizerConfig
    from mcore_rl.parallel.context import ParallelConfig
    from mcore_rl.parallel.reshard.hybrid import HybridConfig


@dataclass
class ModelConfig:
    """The policy model: a local Hugging Face folder, or an inline architecture trained from scratch."""

    path: str | None = None
    """Local HF model folder (``config.json``, safetensors weights, tokenizer files). None: the architecture
    is ``hf_config`` alone and the weights start random."""
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
    use_remove_padding: bool = False
    """Pack each micro-batch's rows end to end (megatron's ``PackedSeqParams``, ``thd``) for the actor's,
    reference's and critic's passes and SFT, so no padding column is computed (verl's ``use_remove_padding``); losses and
    gradients equal the padded path's. Attention within rows: Transformer Engine's fused attention on a GPU,
    ours on the local spec. Needs ``parallel.pipeline_model_parallel_size=1``."""
    share_prompt_prefix: bool = False
    """Pack the actor's, reference's and SFT micro-batches with each prompt once for all the rows that share it
    (GRPO's n samples): ``(n - 1) x prompt`` fewer tokens per group, log-probs and gradients equal to the
    padded path's within fp32 rounding (``trainer/shared_prefix.py``). Implies ``use_remove_padding`` for
    those passes. The local layer spec on CPU only (Transformer Engine's attention has no such mask); needs
    ``parallel.pipeline_model_parallel_size=1``."""

    def hf_config_dict(self) -> dict[str, Any]:
        """The effective ``config.json``: the folder's (when ``path`` is set) updated by ``hf_config``."""
        import json

        merged: dict[str, Any] = {}
        if self.path is not None:
            file = os.path.join(self.path, "config.json")
            try:
                with open(file) as f:
                    merged = json.load(f)
            except FileNotFoundError:
                from mcore_rl.config.errors import ConfigError

                raise ConfigError(f"model.path: {file} does not exist") from None
        merged.update(self.hf_config)
        return merged

    def arch(self) -> ModelArch:
        from mcore_rl.engine.arch import ModelArch

        return ModelArch.from_hf_config(self.hf_config_dict())


@dataclass
class ParallelSection:
    """The training (actor and reference) layout; names as megatron-core and verl's megatron worker."""

    tensor_model_parallel_size: int = 1
    """Ranks that split every weight matrix. Keep within one node."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages the layers are split into."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per stage (interleaved 1F1B); None disables interleaving. Needs pipeline size >= 2."""
    sequence_parallel: bool = False
    """Split norm/dropout activations by sequence over the TP group (needs TP >= 2)."""
    data_parallel_size: int | None = None
    """Replicas; None derives it (world size / (TP * PP)). When set it must equal the derived value."""
    backend: str | None = None
    """torch.distributed backend: nccl or gloo; None picks nccl with CUDA and gloo without."""
    timeout_minutes: int = 30
    """Collective timeout before a hung rank fails the job."""

    def to_parallel_config(self, seed: int) -> ParallelConfig:
        from mcore_rl.parallel.context import ParallelConfig

        return ParallelConfig(
            tensor_parallel_size=self.tensor_model_parallel_size,
            pipeline_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_parallel_size=self.virtual_pipeline_model_parallel_size,
            sequence_parallel=self.sequence_parallel,
            seed=seed,
            backend=self.backend,
            timeout_minutes=self.timeout_minutes,
        )


@dataclass
class HybridSection:
    """The train <-> rollout switch (:class:`~mcore_rl.parallel.reshard.hybrid.HybridConfig`, field for field,
    except the dtype, which is written by name)."""

    offload_optimizer: bool = True
    """Move optimizer state to host memory during rollout (GPU only; a no-op on CPU)."""
    offload_grad_buffers: bool = True
    """Free the DDP gradient buffers during rollout."""
    sleep_level: int = 1
    """Rollout sleep between phases: 1 frees the KV cache, 2 also drops the rollout weights."""
    bucket_bytes: int = 256 << 20
    """Largest p2p message during resharding."""
    max_inflight_bytes: int | None = None
    """Most bytes a rank sends plus receives per reshard round (None: ``2 * bucket_bytes``)."""
    rollout_dtype: str | None = None
    """Cast weights to this dtype (float32, bfloat16, float16) while resharding; None keeps the train dtype."""

    def to_hybrid_config(self) -> HybridConfig:
        import torch

        from mcore_rl.parallel.reshard.hybrid import HybridConfig

        return HybridConfig(
            offload_optimizer=self.offload_optimizer,
            offload_grad_buffers=self.offload_grad_buffers,
            sleep_level=self.sleep_level,
            bucket_bytes=self.bucket_bytes,
            max_inflight_bytes=self.max_inflight_bytes,
            rollout_dtype=getattr(torch, self.rollout_dtype) if self.rollout_dtype else None,
        )


@dataclass
class ValSampling:
    """Sampling for validation and held-out tests (verl's ``rollout.val_kwargs``); greedy by default."""

    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    """Samples per prompt; accuracy averages over them."""


@dataclass
class RolloutConfig:
    """The rollout engine and how it samples (verl's ``actor_rollout_ref.rollout``)."""

    name: str = "local"
    """Engine: local (our KV-cached PyTorch sampler, any device) or vllm (GPU, in the same processes)."""
    tensor_model_parallel_size: int = 1
    """Rollout TP: must divide the world size and the attention (and key/value) heads."""
    n: int = 1
    """Responses sampled per prompt (the GRPO group size)."""
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
    """vllm only: fraction of GPU memory for weights plus KV cache."""
    val_kwargs: ValSampling = field(default_factory=ValSampling)
    """Sampling for validation and the held-out test."""
    hybrid: HybridSection = field(default_factory=HybridSection)
    """Memory handling of the train <-> rollout switch."""
    colocate: bool = True
    """True: the rollout engines live in the actor's processes and get its weights through the hybrid
    engine's reshard (HybridFlow's colocated placement). False: a rollout pool of ``num_ranks`` ranks of
    its own (``name=local``), sent the actor's weights after each update; with ``trainer.one_step_off`` the
    next rollout then runs on that pool while the actor updates (verl's one-step-off placement)."""
    num_ranks: int = 1
    """Ranks of the rollout pool (``colocate=false``): ``num_ranks / tensor_model_parallel_size`` replicas."""

    def sampling_params(
        self, eos_token_id: int, pad_token_id: int, seed: int | None, validation: bool = False
    ) -> SamplingParams:
        """Engine sampling parameters; stop ids are ``eos_token_id`` plus ``stop_token_ids``."""
        from mcore_rl.engine.rollout.base import SamplingParams

        source: RolloutConfig | ValSampling = self.val_kwargs if validation else self
        stops = [eos_token_id, *(t for t in self.stop_token_ids if t != eos_token_id)]
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


ADV_ESTIMATOR_ALIASES = {
    "reinforce++": "reinforce_plus_plus",
    "reinforce++-baseline": "reinforce_plus_plus_baseline",
    "dr-grpo": "dr_grpo",
}


@dataclass
class KLControl:
    """Coefficient of a KL penalty in the reward (verl's ``algorithm.kl_ctrl``)."""

    type: str = "fixed"
    """fixed or adaptive."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient."""
    target_kl: float = 0.1
    """adaptive: the KL the controller steers to."""
    horizon: int = 10000
    """adaptive: steps over which the coefficient adapts."""


@dataclass
class AlgorithmConfig:
    """Advantage estimator and the PPO-style actor loss (verl's ``algorithm`` plus its actor loss keys)."""

    adv_estimator: str = "grpo"
    """grpo, dr_grpo (GRPO without std normalisation, seq-mean-token-sum-norm loss), rloo,
    reinforce_plus_plus, reinforce_plus_plus_baseline, gae (PPO with the ``critic``); 'reinforce++' and
    'reinforce++-baseline' are accepted spellings."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (False for dr_grpo whatever this says)."""
    gamma: float = 1.0
    """Discount of the REINFORCE++ return."""
    lam: float = 1.0
    """GAE lambda (``adv_estimator=gae``; the critic-free estimators ignore it)."""
    use_kl_loss: bool = False
    """Add KL(actor || reference) to the loss; needs reference log-probs."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3), each optionally with '+' (straight-through)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from the token rewards instead (verl's in-reward KL)."""
    kl_penalty: str = "kl"
    """Estimator of the in-reward KL (same names as ``kl_loss_type``)."""
    kl_ctrl: KLControl = field(default_factory=KLControl)
    """Coefficient of the in-reward KL."""
    clip_ratio_low: float = 0.2
    """PPO ratio clip below 1: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO ratio clip above 1 (DAPO's clip-higher when larger than ``clip_ratio_low``)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (0 disables)."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    ppo_mini_batch_size: int = II("data.train_batch_size")
    """Prompts per optimizer step (each brings ``rollout.n`` responses); follows the train batch size,
    which makes the update on-policy."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Sequences per forward/backward on one data-parallel rank (gradient accumulation over the rest)."""
    ppo_max_token_len_per_gpu: int | None = None
    """Token budget of an actor update micro-batch (rows x longest row) instead of
    ``ppo_micro_batch_size_per_gpu`` rows; each mini-batch's rows are also balanced over the data-parallel
    ranks by tokens and each micro-batch is trimmed to its longest row (``trainer/token_batching.py``).
    Needs pipeline_model_parallel_size=1; null: a fixed number of rows."""
    recompute_old_log_probs: str = "auto"
    """The actor's forward pass for the PPO ratio's old log-probs before the update. auto (verl's on-policy
    shortcut): skipped when the update is one optimizer step (``ppo_epochs=1``, ``ppo_mini_batch_size =
    data.train_batch_size``) on a rollout of the current weights (not a ``trainer.one_step_off`` lagged
    one) and nothing else reads them first (not ``use_kl_in_reward``; the PPO step always keeps the pass):
    the old log-probs are then the update's own forward log-probs, detached (ratio 1), and
    ``token_mult_prob_error`` is taken from that forward. always: run the pass every step (same numbers,
    one actor forward more per step)."""
    rollout_is_threshold: float | None = 2.0
    """Truncated importance sampling of lagged rollouts (``trainer.one_step_off``, policy lag 1): each response
    token's policy loss is weighted by ``min(pi_old / pi_rollout, rollout_is_threshold)`` (detached), where
    pi_old is the recomputed old log-prob of the actor being updated and pi_rollout the log-prob of the
    weights that sampled it: the samples come from the policy one update before the one PPO's ratio is
    centred on (decoupled PPO; verl's ``rollout_is``, TIS). Logged as ``rollout_is/*``. null: no correction.
    On-policy rollouts (lag 0) are never weighted."""

    def __post_init__(self) -> None:
        # Store one spelling so the driver compares against one name.
        self.adv_estimator = ADV_ESTIMATOR_ALIASES.get(self.adv_estimator, self.adv_estimator)


@dataclass
class OptimConfig:
    """Adam(W) and the learning-rate schedule (megatron's ``OptimizerParamScheduler`` names)."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    lr_decay_style: str = "constant"
    """constant, linear, cosine or inverse-square-root, after the warmup."""
    lr_decay_steps: int | None = None
    """Steps from the start to the end of the decay; None: the run's total optimizer steps."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global grad-norm clip (0 disables)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    def to_optimizer_config(self) -> OptimizerConfig:
        from mcore_rl.engine.train_engine import OptimizerConfig

        return OptimizerConfig(
            lr=self.lr,
            weight_decay=self.weight_decay,
            adam_beta1=self.adam_beta1,
            adam_beta2=self.adam_beta2,
            adam_eps=self.adam_eps,
            clip_grad=self.clip_grad,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
