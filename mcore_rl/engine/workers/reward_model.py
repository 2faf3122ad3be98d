"""A reward model: a value-head megatron model scoring the last response token, from an HF
sequence-classification checkpoint (``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``,
``MistralForSequenceClassification`` with ``num_labels=1``).

The HF ``score`` head [1, hidden] is the value head's weight; the body maps like the causal LM's
(``convert/mapping.py``). The score of a sequence is the head's output at its last response token, the token
HF pools on for a right-padded sequence, so the scores equal ``transformers``' logits. In our position
alignment (``types.py``) the last response token sits one column after the mask's last 1.

Rule rewards and the model combine linearly on the driver: ``reward_model.rule_weight * rules +
reward_model.weight * model``. The model lives on the actor's ranks (forward only, no optimizer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.checkpoint import load_model
from mcore_rl.engine.hf.state import load_hf_full_state
from mcore_rl.engine.model import ModelOptions
from mcore_rl.engine.train_engine import TrainEngine
from mcore_rl.engine.weights import load_full_state
from mcore_rl.engine.workers.losses import forward_values_loss
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.types import RolloutBatch


def is_model_checkpoint(path: str) -> bool:
    """Whether ``path`` is a megatron distributed checkpoint (e.g. ``mcore-rl convert hf-to-mcore``'s output)."""
    return os.path.isfile(os.path.join(path, "metadata.json"))


def reward_model_arch(path: str) -> ModelArch:
    """The body architecture of a one-label classifier: an HF folder or its converted checkpoint."""
    from mcore_rl.engine.checkpoint import MODEL_INFO_FILE, ModelCheckpointInfo
    from mcore_rl.engine.hf.score_head import arch_of_file, has_score_head, is_classifier
    from mcore_rl.io.errors import ConfigError
    from mcore_rl.io.inputs import read_json_object

    if is_model_checkpoint(path):
        info = ModelCheckpointInfo.read(path)
        where = os.path.join(path, MODEL_INFO_FILE)
        if info is None or not has_score_head(info.arch):
            raise ConfigError(f"{where}: not a converted *ForSequenceClassification model (no score head)")
        return info.arch
    config_path = os.path.join(path, "config.json")
    if not is_classifier(read_json_object(config_path)):
        names = read_json_object(config_path).get("architectures")
        raise ConfigError(f"{config_path}: architectures={names} has no *ForSequenceClassification")
    return arch_of_file(config_path)


def last_token_values(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] the value at each row's last response token ([N, S] values and mask; 0 for an empty response)."""
    positions = torch.arange(response_mask.shape[1])
    last = torch.where(response_mask > 0, positions, -1).max(dim=1).values + 1  # token after the last mask 1
    picked = values.gather(1, last.clamp(min=0, max=values.shape[1] - 1)[:, None])[:, 0]
    return torch.where(last > 0, picked, torch.zeros_like(picked))


@dataclass(frozen=True)
class RewardModelSpec:
    """What every rank builds for the reward model."""

    path: str
    """A converted checkpoint (``mcore-rl convert hf-to-mcore`` of the classifier, any layout: each rank
    reads its own shards) or the HF sequence-classification folder (every rank reads it whole)."""
    dtype: str = "float32"
    """Parameter dtype of the forward."""
    pad_token_id: int = 0
    """Token that pads rows to a common width."""


class RewardModel:
    """The reward model on one rank: a forward-only value-head engine."""

    def __init__(self, ctx: ParallelContext, spec: RewardModelSpec) -> None:
        self.ctx, self.spec = ctx, spec
        self.arch = reward_model_arch(spec.path)
        options = ModelOptions(dtype=getattr(torch, spec.dtype), value_head=True)
        self.engine = TrainEngine.forward_only(self.arch, ctx, options)
        if is_model_checkpoint(spec.path):
            load_model(self.engine.chunks, ctx, spec.path)
        else:
            full = load_hf_full_state(spec.path, self.arch, options.dtype)  # ``score`` is the value head
            load_full_state(self.engine.chunks, full, self.arch, ctx)

    def scores(self, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor | None:
        """[N] scores of this rank's rows; the owner (last stage, TP rank 0) returns them."""
        from mcore_rl.engine.packing.micro_batches import pad_width, plain_micro_batch, row_chunks

        multiple = self.ctx.sequence_multiple
        tokens = pad_width(batch.tokens, multiple, self.spec.pad_token_id)
        micro = [
            plain_micro_batch(t)
            for t in row_chunks(tokens, micro_batch_size, "reward_model.micro_batch_size_per_gpu")
        ]
        out = self.engine.forward_backward(micro, forward_values_loss(), forward_only=True)
        if not (self.ctx.is_last_stage and self.ctx.tp_rank == 0 and self.ctx.cp_rank == 0):
            return None
        values = torch.cat([m.values for m in out])[:, : batch.tokens.shape[1]]
        return last_token_values(values, batch.response_mask)


class RewardModelHost:
    """The reward model's collective methods on a worker that holds ``self.reward_model``."""

    reward_model: RewardModel | None = None
    ctx: ParallelContext

    def build_reward_model(self, spec: RewardModelSpec) -> None:
        self.reward_model = RewardModel(self.ctx, spec)

    def reward_model_scores(self, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor | None:
        if self.reward_model is None:
            raise RuntimeError("the reward model is not built: call build_reward_model first")
        return self.reward_model.scores(batch, micro_batch_size)
