"""What an unknown key most likely meant: verl's name for one of our keys (a verl user's recipe or override
such as ``actor_rollout_ref.model.path``), else the closest key allowed where it stands (a typo)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence

# verl's key prefix -> ours (verl's ppo_trainer.yaml layout). The remainder of the key is kept, and a
# suggestion is only made when the mapped key exists in our schema.
VERL_PREFIXES: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.megatron.", "parallel."),
    ("actor_rollout_ref.actor.optim.", "optim."),
    ("actor_rollout_ref.actor.", "algorithm."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("actor_rollout_ref.model.", "model."),
    ("actor_rollout_ref.ref.megatron.", "parallel."),
    ("critic.model.path", "critic.model_path"),
    ("critic.megatron.", "critic.parallel."),
    ("reward_model.model.path", "reward_model.path"),
    ("custom_reward_function.path", "reward.custom_function"),
    ("reward_model.overlong_buffer.", "reward.overlong_buffer."),
)


# verl's keys whose counterpart is not the same name under another prefix, or takes another kind of value:
# what to set instead, as the hint's whole text (found by moving a 37-key verl Megatron GRPO command over).
VERL_KEYS: dict[str, str] = {
    "trainer.logger": "verl's trainer.logger list is our logging.wandb, logging.tensorboard and logging.mlflow "
    "(true or false each; the console always logs)",
    "trainer.critic_warmup": "verl's trainer.critic_warmup is our critic.warmup_steps",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "verl's gradient checkpointing is our "
    "model.recompute=full (or selective: attention only; none: off)",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "verl's warm-up ratio is our optim.lr_warmup_steps, "
    "a step count (ratio x total steps)",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "the log-prob passes take "
    "algorithm.ppo_micro_batch_size_per_gpu rows (or algorithm.ppo_max_token_len_per_gpu tokens)",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "the log-prob passes take "
    "algorithm.ppo_micro_batch_size_per_gpu rows (or algorithm.ppo_max_token_len_per_gpu tokens)",
    "actor_rollout_ref.actor.megatron.param_offload": "the weights stay where they train; between phases "
    "rollout.hybrid.offload_optimizer and rollout.hybrid.offload_grad_buffers free the rest (both on by "
    "default), rollout.hybrid.sleep_level the rollout's copy",
    "actor_rollout_ref.actor.megatron.grad_offload": "verl's grad_offload is our "
    "rollout.hybrid.offload_grad_buffers (on by default)",
    "actor_rollout_ref.actor.megatron.optimizer_offload": "verl's optimizer_offload is our "
    "rollout.hybrid.offload_optimizer (on by default)",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "verl's tool_config_path is our "
    "rollout.multi_turn.tools, a list of tool files",
    "data.truncation": "a prompt longer than data.max_prompt_length is refused naming its row "
    "(verl's truncation=error); data.filter_overlong_prompts=true drops such prompts instead",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "verl's policy_loss.loss_mode is our "
    "algorithm.policy_loss (vanilla or gspo)",
    "reward_model.reward_manager": "the scoring rule follows each row's data_source (reward.sources maps a "
    "source to a rule), or reward.custom_function scores every row",
}


# verl's keys with no single key of ours: what to set instead (the closest spelling would mislead: verl's
# symmetric clip_ratio is closest to clip_ratio_c, the dual-clip bound).
VERL_SPLIT_KEYS: dict[str, str] = {
    "clip_ratio": "set both algorithm.clip_ratio_low and algorithm.clip_ratio_high (verl's symmetric clip_ratio)",
}


def schema_has(schema: type, dotted: str) -> bool:
    """``dotted`` names a field of ``schema`` (nested sections followed; an optional section counts)."""
    node: typing.Any = schema
    for part in dotted.split("."):
        if not (dataclasses.is_dataclass(node) and isinstance(node, type)):
            return False
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        node = _section(hints[part])
    return True


def _section(hint: typing.Any) -> typing.Any:
    """The dataclass inside ``X | None``, else the hint itself."""
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(options) == 1 and dataclasses.is_dataclass(options[0]):
        return options[0]
    return hint


def key_hint(schema: type, dotted: str, allowed: Sequence[str], prefix: str) -> str:
    """``; verl's K is our K2`` or ``; did you mean K2?`` for the unknown key ``dotted`` (whose section,
    at ``prefix``, allows ``allowed``); empty when nothing is close."""
    if dotted in VERL_KEYS:
        return f"; {VERL_KEYS[dotted]}"
    split = VERL_SPLIT_KEYS.get(dotted.rsplit(".", 1)[-1])
    if split is not None and dotted.split(".")[0] in ("algorithm", "actor_rollout_ref"):
        return f"; {split}"
    for verl, ours in VERL_PREFIXES:
        if dotted == verl or (dotted.startswith(verl) and verl.endswith(".")):
            mapped = ours + dotted[len(verl) :]
            if schema_has(schema, mapped):
                return f"; verl's {dotted} is our {mapped}"
    leaf = dotted[len(prefix) :].split(".")[0]
    close = difflib.get_close_matches(leaf, list(allowed), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""
