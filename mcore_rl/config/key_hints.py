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
    ("trainer.logger", "logging.tensorboard"),
)


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
