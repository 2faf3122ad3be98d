"""Rollout engines: the protocol and records (``base``), the embedded PyTorch engine (``local``)."""

from mcore_rl.engine.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    SamplingParamsError,
)
from mcore_rl.engine.rollout.decoder import RolloutDecoder
from mcore_rl.engine.rollout.kv_cache import KVCache
from mcore_rl.engine.rollout.layout import RolloutLayoutError, rollout_param_shapes, rollout_shards_from_full
from mcore_rl.engine.rollout.local import LocalRolloutConfig, LocalRolloutEngine

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "GenerationOutput",
    "KVCache",
    "LocalRolloutConfig",
    "LocalRolloutEngine",
    "RolloutDecoder",
    "RolloutEngine",
    "RolloutLayoutError",
    "SamplingParams",
    "SamplingParamsError",
    "rollout_param_shapes",
    "rollout_shards_from_full",
]
