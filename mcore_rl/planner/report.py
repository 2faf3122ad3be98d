"""The planner's answer as text: one block per phase, terms largest first, and the verdict."""

from __future__ import annotations

from typing import Any

from mcore_rl.engine.rollout.layout import VOCAB_DIVISIBLE_BY
from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.planner.memory import MemoryPlan, PhaseMemory, gib
from mcore_rl.planner.search import MARGIN_FRACTION, has_margin, knob_changes
from mcore_rl.planner.spec import PlanInput


def _phase_lines(phase: PhaseMemory) -> list[str]:
    verdict = "fits" if phase.fits else "DOES NOT FIT"
    lines = [
        f"{phase.name}: {gib(phase.total_bytes)} of {gib(phase.capacity_bytes)} usable -> {verdict} "
        f"(largest: {phase.largest})"
    ]
    for name, size in sorted(phase.terms.items(), key=lambda item: -item[1]):
        lines.append(f"    {name:<26} {gib(size):>12}")
    return lines


def describe_layout(result: MemoryPlan) -> str:
    p = result.plan
    vpp = f" vpp={p.vpp}" if p.vpp else ""
    cp = f" cp={p.cp}" if p.cp > 1 else ""
    experts = f" ep={p.ep} etp={p.layout.expert_tp} edp={p.expert_dp}" if p.arch.moe else ""
    cast = f" rollout_dtype={p.rollout_dtype}" if p.rollout_dtype else ""
    return (
        f"{p.world_size} x {p.gpu}: tp={p.tp}{cp} pp={p.pp}{vpp} dp={p.dp}{experts} sp={p.sp} "
        f"recompute={p.recompute}, rollout_tp={p.rollout_tp}{cast} "
        f"rollout_memory_fraction={p.rollout_memory_fraction}"
    )


def _model_line(result: MemoryPlan) -> str:
    """Whole model, and what this rank holds: for MoE also the per-token count and the rank's experts."""
    p, actor = result.plan, result.actor
    line = f"model: {result.model_params:,} parameters"
    if p.arch.moe is not None:
        moe = p.arch.moe
        line += (
            f" ({result.active_params:,} active per token: {moe.top_k} of {moe.num_experts} experts in "
            f"{len(moe.layers)} MoE layers)"
        )
    line += f"; this rank holds {actor.params:,}"
    if actor.adapter_params:
        line += f", {actor.adapter_params:,} of them LoRA adapters (r={p.lora_rank}; the only ones trained)"
    if p.arch.moe is not None:
        line += (
            f", {actor.expert_params:,} of them in its {p.arch.moe.num_experts // p.ep} experts per MoE layer "
            f"(each split over etp={p.layout.expert_tp})"
        )
    return line + _padding_note(p)


def _padding_note(p: Any) -> str:
    """Why a rank can hold more than the model: megatron pads the vocabulary rows."""
    padded = padded_vocab_size(p.arch.vocab_size, p.tp, VOCAB_DIVISIBLE_BY)
    if padded == p.arch.vocab_size:
        return ""
    return (
        f" (the vocabulary padded from {p.arch.vocab_size:,} to {padded:,} rows, a multiple of "
        f"{VOCAB_DIVISIBLE_BY} x tp, as megatron does)"
    )


_KNOB_NAMES = {"rollout_memory_fraction": "rollout_memory_fraction (vLLM gpu_memory_utilization)"}


def _headroom(result: MemoryPlan, margin: float) -> str:
    """What the peak leaves free, marked TIGHT under the margin (a layout that fits at 99% is not a plan)."""
    text = (
        f"headroom {gib(result.headroom_bytes)} = {result.headroom_bytes / result.capacity_bytes:.1%} "
        f"of {gib(result.capacity_bytes)} usable"
    )
    return text if has_margin(result, margin) else f"{text}: TIGHT, under the {margin * 100:g}% margin"


def _proposal_lines(label: str, asked: PlanInput, proposal: MemoryPlan, margin: float) -> list[str]:
    """One proposed layout, its peak and headroom, and each knob beyond the layout it changes, with why."""
    lines = [
        f"{label}: {describe_layout(proposal)} (peak {gib(proposal.peak_bytes)}, {_headroom(proposal, margin)})"
    ]
    for change in knob_changes(asked, proposal, margin):
        name = _KNOB_NAMES.get(change.name, change.name)
        lines.append(
            f"    changes {name} from {change.asked} to {change.proposed}: at {change.asked}, {change.reason}"
        )
    return lines


def _recommended_lines(asked: PlanInput, recommended: MemoryPlan, margin: float) -> list[str]:
    where = f"recommended on all {asked.world_size} GPUs of the run"
    if has_margin(recommended, margin):
        label = (
            f"{where} (least recompute, then least model parallelism, leaving the {margin * 100:g}% margin)"
        )
    else:
        label = f"{where}: none leaves the {margin * 100:g}% margin; the most headroom"
    return _proposal_lines(label, asked, recommended, margin)


def format_plan(
    result: MemoryPlan,
    proposal: MemoryPlan | None = None,
    searched: bool = False,
    recommended: MemoryPlan | None = None,
    margin: float = MARGIN_FRACTION,
) -> str:
    """The report; ``proposal`` is the smallest layout that fits (when the asked one does not),
    ``recommended`` the layout on the asked GPUs (:func:`~mcore_rl.planner.search.recommended_layout`)."""
    p = result.plan
    lines = [
        _model_line(result),
        f"layout: {describe_layout(result)}",
        f"batch: {p.global_batch_size} sequences x {p.seq_length} tokens per step, micro-batch "
        f"{p.micro_batch_size}, {p.num_microbatches} micro-batches per DP rank",
    ]
    for phase in result.phases:
        lines += _phase_lines(phase)
    lines.append(
        f"rollout KV cache: {result.kv_cache_tokens:,} tokens per rollout rank "
        f"({result.kv_bytes_per_token:,} B/token, {result.kv_cache_tokens // p.seq_length} full sequences)"
    )
    if result.fits:
        lines.append(f"peak: {gib(result.peak_bytes)} per GPU, {_headroom(result, margin)}")
        lines.append("verdict: fits" + ("" if has_margin(result, margin) else ", but TIGHT"))
    else:
        lines.append(f"peak: {gib(result.peak_bytes)} per GPU")
        lines += ["verdict: DOES NOT FIT", *(f"  - {problem}" for problem in result.problems)]
        if proposal is not None:
            lines += _proposal_lines("smallest layout that fits", p, proposal, margin)
        elif searched:
            lines.append("no layout up to the search limit fits; shorten seq_length or the micro-batch")
    if recommended is not None:
        lines += _recommended_lines(p, recommended, margin)
    return "\n".join(lines)
