"""vLLM's per-rank weight layout as a reshard target, and the checks that a load matches it exactly.

What differs from our embedded engine's layout (``rollout/layout.py``), read from vLLM 0.33.0:

- **Vocab padding.** ``VocabParallelEmbedding`` / ``ParallelLMHead`` pad the whole vocab to a multiple of
  ``DEFAULT_VOCAB_PADDING_SIZE = 64`` and then split it in equal row blocks, padding at the end
  (``model_executor/layers/vocab_parallel_embedding.py``). Megatron pads to ``128 * tp``. In the planner's
  units (a multiple per TP rank) vLLM's rule is ``64 // tp``, which is exact only when ``tp`` divides 64.
- **Rank order.** vLLM builds its TP groups from consecutive ranks (``distributed/parallel_state.py``:
  ``arange(world).reshape(-1, dp, pp, pcp, tp)``), so rank ``r`` holds TP coordinate ``r % tp``, whatever the
  training layout nests. The plan must be built with ``consecutive_rollout_ranks=True``.
- **Names.** vLLM's Llama/Qwen2/Mistral put ``model.`` before every name but ``lm_head``; with tied
  embeddings ``lm_head`` *is* ``embed_tokens`` (the same Parameter), so ``named_parameters()`` lists only
  ``model.embed_tokens.weight``.

Everything here is pure (no vLLM import), so the default suite checks it on CPU; ``tests_vllm/`` checks the
same shapes and names against vLLM's own model classes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout.base import SamplingParams, SamplingParamsError
from mcore_rl.engine.rollout.layout import RolloutLayoutError, rollout_param_shapes
from mcore_rl.parallel.layout import ParallelLayout, padded_vocab_size
from mcore_rl.parallel.reshard import arch_param_specs, build_plan
from mcore_rl.parallel.reshard.plan import ReshardPlan

VLLM_VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the whole vocab is padded to a multiple of this before the TP split."""

VLLM_MAX_TEMPERATURE = 2.0
"""vLLM's ``SamplingParams`` refuses a larger temperature (``_verify_args``)."""

VLLM_MIN_TEMPERATURE = 0.01
"""vLLM silently raises a temperature in ``(0, 0.01)`` to 0.01, so its log-probs would not be ours."""


class VLLMWeightError(ValueError):
    """A weight load that does not match vLLM's parameters exactly; the message names the parameter."""


def vllm_param_name(rollout_name: str) -> str:
    """Our rollout-layout name -> vLLM's parameter name (Llama/Qwen2/Mistral share one layout)."""
    return rollout_name if rollout_name.startswith("lm_head") else f"model.{rollout_name}"


def vllm_vocab_divisible_by(tp: int) -> int:
    """The planner's per-rank vocab multiple that reproduces vLLM's padding at rollout TP ``tp``."""
    if tp < 1 or VLLM_VOCAB_PADDING % tp:
        raise RolloutLayoutError(
            f"rollout tensor_parallel_size={tp} must divide vLLM's vocab padding {VLLM_VOCAB_PADDING}"
        )
    return VLLM_VOCAB_PADDING // tp


def vllm_padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocab (the same at every TP size)."""
    return padded_vocab_size(vocab_size, 1, VLLM_VOCAB_PADDING)


def vllm_param_shapes(arch: ModelArch, tp: int) -> dict[str, tuple[int, ...]]:
    """vLLM name -> shape of one TP rank's parameter, for every parameter vLLM's model has."""
    rows = vllm_padded_vocab(arch.vocab_size) // tp
    vllm_vocab_divisible_by(tp)  # refuses a tp that does not divide the padding
    shapes = {}
    for name, shape in rollout_param_shapes(arch, tp).items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            shape = (rows, *shape[1:])
        shapes[vllm_param_name(name)] = shape
    return shapes


def build_vllm_plan(
    arch: ModelArch, train: ParallelLayout, tp_g: int, *, bytes_per_element: int = 4
) -> ReshardPlan:
    """The reshard plan whose rollout side is vLLM's: consecutive TP ranks and vocab padded to 64."""
    return build_plan(
        arch_param_specs(arch),
        train,
        tp_g,
        num_layers=arch.num_layers,
        tied_embeddings=arch.tie_word_embeddings,
        bytes_per_element=bytes_per_element,
        rollout_vocab_divisible_by=vllm_vocab_divisible_by(tp_g),
        consecutive_rollout_ranks=True,
    )


def check_shard_shapes(
    params: Mapping[str, tuple[int, ...]],
    shards: Mapping[str, tuple[int, ...]],
    *,
    tp_rank: int,
    expected: int,
) -> None:
    """Refuse a load that is not an exact match: the rank, each name, each shape (nothing is truncated).

    ``params``: vLLM's parameter shapes on this rank; ``shards``: what is about to be copied; ``tp_rank``:
    vLLM's TP rank of this process; ``expected``: the TP coordinate the reshard plan built the shards for.
    """
    if tp_rank != expected:
        raise VLLMWeightError(
            f"vLLM's tensor-parallel rank is {tp_rank} but the reshard plan built shards for coordinate "
            f"{expected}: build the plan with build_vllm_plan (consecutive rollout ranks)"
        )
    unknown = sorted(set(shards) - set(params))
    if unknown:
        raise VLLMWeightError(f"vLLM model has no parameters named {unknown}")
    for name, shape in shards.items():
        if tuple(shape) != tuple(params[name]):
            raise VLLMWeightError(
                f"{name}: shard shape {tuple(shape)} != vLLM's {tuple(params[name])} on TP rank {tp_rank}"
            )


def check_covered(unloaded: Iterable[str]) -> None:
    """Refuse to generate while some parameter still holds dummy or discarded weights."""
    missing = sorted(unloaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise VLLMWeightError(
            f"load_weights has not loaded {shown} since the engine was built or slept at level 2"
        )


def check_vllm_sampling(params: SamplingParams) -> None:
    """Refuse what vLLM 0.33 would reject or silently change; the message names our field."""
    if params.temperature > VLLM_MAX_TEMPERATURE:
        raise SamplingParamsError(
            f"temperature={params.temperature}: vLLM accepts at most {VLLM_MAX_TEMPERATURE}"
        )
    if 0 < params.temperature < VLLM_MIN_TEMPERATURE:
        raise SamplingParamsError(
            f"temperature={params.temperature}: vLLM samples at {VLLM_MIN_TEMPERATURE} instead, so its log-probs "
            "would not be the actor's; use 0 (greedy) or at least 0.01"
        )
    if params.greedy and params.n > 1:
        raise SamplingParamsError(f"n={params.n} with temperature=0: vLLM's greedy sampling allows n=1 only")
