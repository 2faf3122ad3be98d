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
- **Experts** (Qwen3-MoE, Mixtral; vLLM's ``FusedMoE``, 0.32 and 0.33 alike). The MoE block's ``experts`` is a
  runner module whose ``routed_experts`` submodule holds every expert of the layer stacked in two parameters,
  and the router is the block's ``gate``; Mixtral's block is ``block_sparse_moe``, Qwen3-MoE's ``mlp``
  (its ``mlp_only_layers`` keep the dense MLP's names)::

      model.layers.{i}.{mlp|block_sparse_moe}.gate.weight                       [E, hidden]
      model.layers.{i}.{mlp|block_sparse_moe}.experts.routed_experts.w13_weight [E, 2 * moe_ffn / tp, hidden]
      model.layers.{i}.{mlp|block_sparse_moe}.experts.routed_experts.w2_weight  [E, hidden, moe_ffn / tp]

  ``w13`` rows are ``[w1 (gate) shard; w3 (up) shard]``, our ``gate_up_proj`` order; expert ``e`` of our
  per-expert rollout names is slice ``e`` of the fused tensor (:func:`vllm_target`). Without vLLM's expert
  parallelism (our engine never turns it on) every rank holds all ``E`` experts, each split over the TP ranks
  like a dense MLP: the rollout layout's split. vLLM's CPU kernel pads ``moe_ffn / tp`` up to a multiple of 32
  and repacks both tensors after loading; the load path re-runs that (``vllm_compat.load_in_place``).

Everything here is pure (no vLLM import), so the default suite checks it on CPU; ``tests_vllm/`` checks the
same shapes and names against vLLM's own model classes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

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


VLLM_EXPERTS = "experts.routed_experts"
"""Where a vLLM MoE block keeps its fused expert parameters (``FusedMoE``'s runner -> ``RoutedExperts``)."""

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")
_ROUTER = re.compile(r"^layers\.(\d+)\.mlp\.gate\.weight$")
_FUSED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


class VLLMSlice(NamedTuple):
    """Where one rollout tensor goes in vLLM: a whole parameter (``expert`` None) or expert ``expert``'s slice
    (index into the first dimension) of a fused expert parameter."""

    name: str
    expert: int | None = None


def vllm_param_name(rollout_name: str) -> str:
    """Our rollout-layout name -> vLLM's parameter name (dense layers: every family shares one layout)."""
    return rollout_name if rollout_name.startswith("lm_head") else f"model.{rollout_name}"


def _moe_block(arch: ModelArch) -> str:
    return "block_sparse_moe" if arch.family == "mixtral" else "mlp"


def vllm_target(rollout_name: str, arch: ModelArch) -> VLLMSlice:
    """Our rollout-layout name -> the vLLM parameter (and expert slice) it is written into."""
    if expert := _EXPERT.match(rollout_name):
        layer, index, kind = expert.groups()
        return VLLMSlice(f"model.layers.{layer}.{_moe_block(arch)}.{VLLM_EXPERTS}.{_FUSED[kind]}", int(index))
    if router := _ROUTER.match(rollout_name):
        return VLLMSlice(f"model.layers.{router.group(1)}.{_moe_block(arch)}.gate.weight")
    return VLLMSlice(vllm_param_name(rollout_name))


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
    """vLLM name -> shape of one TP rank's parameter, for every parameter vLLM's model has (a fused expert
    parameter as loaded, before the CPU kernel pads it)."""
    rows = vllm_padded_vocab(arch.vocab_size) // tp
    vllm_vocab_divisible_by(tp)  # refuses a tp that does not divide the padding
    if arch.family == "qwen3_moe" and arch.moe is not None and tp > arch.moe.num_experts:
        raise RolloutLayoutError(  # Qwen3MoeSparseMoeBlock refuses it at construction
            f"rollout tensor_model_parallel_size={tp} is larger than num_experts={arch.moe.num_experts}: "
            "vLLM's Qwen3-MoE refuses it"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    experts: dict[str, int] = {}
    for name, shape in rollout_param_shapes(arch, tp).items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            shape = (rows, *shape[1:])
        target = vllm_target(name, arch)
        if target.expert is None:
            shapes[target.name] = shape
        else:
            experts[target.name] = max(experts.get(target.name, 0), target.expert + 1)
            shapes[target.name] = (experts[target.name], *shape)
    return shapes


def build_vllm_plan(
    arch: ModelArch,
    train: ParallelLayout,
    tp_g: int,
    *,
    bytes_per_element: int = 4,
    vocab_divisible_by: int = 128,
) -> ReshardPlan:
    """The reshard plan whose rollout side is vLLM's: consecutive TP ranks and vocab padded to 64;
    ``vocab_divisible_by``: the training engine's (``ModelOptions.make_vocab_size_divisible_by``)."""
    return build_plan(
        arch_param_specs(arch),
        train,
        tp_g,
        num_layers=arch.num_layers,
        tied_embeddings=arch.tie_word_embeddings,
        bytes_per_element=bytes_per_element,
        vocab_divisible_by=vocab_divisible_by,
        rollout_vocab_divisible_by=vllm_vocab_divisible_by(tp_g),
        consecutive_rollout_ranks=True,
    )


def check_shard_shapes(
    params: Mapping[str, tuple[int, ...]],
    shards: Mapping[VLLMSlice, tuple[int, ...]],
    *,
    tp_rank: int,
    expected: int,
) -> None:
    """Refuse a load that is not an exact match: the rank, each name, each shape (nothing is truncated), and
    every expert of a fused expert parameter (it is written whole: vLLM's CPU kernel repacks all experts).

    ``params``: vLLM's parameter shapes on this rank; ``shards``: where each tensor about to be copied goes,
    and its shape; ``tp_rank``: vLLM's TP rank of this process; ``expected``: the TP coordinate the reshard
    plan built the shards for.
    """
    if tp_rank != expected:
        raise VLLMWeightError(
            f"vLLM's tensor-parallel rank is {tp_rank} but the reshard plan built shards for coordinate "
            f"{expected}: build the plan with build_vllm_plan (consecutive rollout ranks)"
        )
    unknown = sorted({s.name for s in shards} - set(params))
    if unknown:
        raise VLLMWeightError(f"vLLM model has no parameters named {unknown}")
    experts: dict[str, set[int]] = {}
    for target, shape in shards.items():
        full = tuple(params[target.name])
        want = full if target.expert is None else full[1:]
        if target.expert is not None:
            if not 0 <= target.expert < full[0]:
                raise VLLMWeightError(f"{target.name}: expert {target.expert} of {full[0]}")
            experts.setdefault(target.name, set()).add(target.expert)
        if tuple(shape) != want:
            where = "" if target.expert is None else f" (expert {target.expert})"
            raise VLLMWeightError(
                f"{target.name}{where}: shard shape {tuple(shape)} != vLLM's {want} on TP rank {tp_rank}"
            )
    for name, seen in experts.items():
        if len(seen) != params[name][0]:
            missing = sorted(set(range(params[name][0])) - seen)
            raise VLLMWeightError(
                f"{name}: this load lacks experts {missing}; a fused expert parameter is loaded whole"
            )
        w13 = name.endswith(".w13_weight")
        sibling = name.rsplit(".", 1)[0] + (".w2_weight" if w13 else ".w13_weight")
        if sibling not in experts:
            raise VLLMWeightError(
                f"{name} without {sibling}: vLLM's CPU kernel repacks a layer's experts together"
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
    problems = vllm_sampling_problems(params.temperature, params.n)
    if problems:
        raise SamplingParamsError(problems[0])


def vllm_sampling_problems(temperature: float, n: int) -> list[str]:
    """What vLLM would reject or silently change of a temperature and a sample count, each line starting with
    the field (the run config's check prefixes its section: ``config/validate.py``)."""
    if temperature > VLLM_MAX_TEMPERATURE:
        return [f"temperature={temperature}: vLLM accepts at most {VLLM_MAX_TEMPERATURE}"]
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        return [
            f"temperature={temperature}: vLLM samples at {VLLM_MIN_TEMPERATURE} instead, so its log-probs "
            "would not be the actor's; use 0 (greedy) or at least 0.01"
        ]
    if temperature == 0 and n > 1:
        return [f"n={n} with temperature=0: vLLM's greedy sampling allows n=1 only"]
    return []
