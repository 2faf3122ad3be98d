"""The layout recommended on the run's own GPUs, its safety margin, tight proposals marked, and every knob a
proposal changes beyond the layout named with its reason. The cases are a new user's: Qwen2.5-7B on one node
of 8 A100-40 (the smallest fitting layout used 4 of the 8 at 99% of the usable memory and lowered the rollout
reservation unasked) and Qwen2.5-32B on 8 H100 (proposed at 76.14 of 76.65 GiB)."""

from __future__ import annotations

import json

import pytest

from mcore_rl.cli import main
from mcore_rl.engine.arch import ModelArch
from mcore_rl.planner import (
    MARGIN_FRACTION,
    PlanInput,
    plan_memory,
    recommended_layout,
    smallest_fitting_layout,
)
from mcore_rl.planner.search import has_margin, knob_changes
from tests.planner.hf_configs import QWEN25_7B, QWEN25_32B


def _qwen7b_on_a100_40(**changes) -> PlanInput:
    """``mcore-rl plan --model-config q7b --gpu A100-40`` with the flag form's defaults (8 GPUs, TP1)."""
    plan = PlanInput(
        arch=ModelArch.from_hf_config(QWEN25_7B),
        gpu="A100-40",
        world_size=8,
        seq_length=4096,
        global_batch_size=256,
        rollout_memory_fraction=0.5,
    )
    return plan.with_layout(**changes)


@pytest.fixture
def config(tmp_path):
    def write(hf_config: dict) -> str:
        path = tmp_path / f"config_{hf_config['hidden_size']}.json"
        path.write_text(json.dumps(hf_config))
        return str(path)

    return write


def test_the_7b_on_8_a100_40_is_recommended_on_all_8_gpus_with_the_margin():
    asked = _qwen7b_on_a100_40()
    recommended = recommended_layout(asked)
    assert recommended is not None and has_margin(recommended)
    p = recommended.plan
    assert recommended.headroom_bytes >= MARGIN_FRACTION * recommended.capacity_bytes
    # All 8 GPUs, DP filling what TP leaves: TP4 without recompute rather than TP2 with full recompute (also
    # 10.0% free, but a third more training compute); the asked rollout settings kept.
    assert (p.world_size, p.tp, p.pp, p.dp, p.sp, p.recompute) == (8, 4, 1, 2, True, "none")
    assert (p.rollout_tp, p.rollout_memory_fraction) == (1, 0.5)
    assert knob_changes(asked, recommended) == []
    tp2_full = plan_memory(asked.with_layout(tp=2, sp=True, recompute="full", rollout_tp=2))
    assert has_margin(tp2_full)  # fits with the margin too: the order, not memory, puts TP4 first
    # Nothing with less model parallelism (TP1 x PP1) leaves the margin, whatever recompute and rollout.
    for recompute in ("none", "selective", "full"):
        for rollout_tp in (1, 2, 4):
            for fraction in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
                tp1 = asked.with_layout(
                    recompute=recompute, rollout_tp=rollout_tp, rollout_memory_fraction=fraction
                )
                assert not has_margin(plan_memory(tp1))


def test_the_smallest_layout_keeps_the_asked_rollout_reservation_when_it_fits():
    """Half a node, TP4: its peak is the train phase at any reservation, so 0.5 stays (0.4 was proposed,
    a KV cache of 3 sequences instead of 21, and not said)."""
    proposal = smallest_fitting_layout(_qwen7b_on_a100_40())
    assert proposal is not None
    assert (proposal.plan.world_size, proposal.plan.tp, proposal.plan.rollout_memory_fraction) == (4, 4, 0.5)
    assert proposal.kv_cache_tokens == 87_878
    assert not has_margin(proposal)  # 0.42 GiB of 37 free: tight
    assert knob_changes(_qwen7b_on_a100_40(), proposal) == []


def test_the_report_gives_both_layouts_their_headroom_and_marks_the_tight_one(config, capsys):
    argv = ["plan", "--model-config", config(QWEN25_7B), "--gpus-per-node", "8", "--gpu", "A100-40"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert (
        "smallest layout that fits: 4 x A100-40: tp=4 pp=1 dp=1 sp=True recompute=none, rollout_tp=1 "
        "rollout_memory_fraction=0.5 (peak 36.58 GiB, headroom 426.8 MiB = 1.1% of 37.00 GiB usable: TIGHT, "
        "under the 10% margin)\n"
    ) in out
    assert (
        "recommended on all 8 GPUs of the run (least recompute, then least model parallelism, leaving the 10% "
        "margin): 8 x A100-40: tp=4 pp=1 dp=2 sp=True recompute=none, rollout_tp=1 rollout_memory_fraction=0.5 "
        "(peak 32.42 GiB, headroom 4.58 GiB = 12.4% of 37.00 GiB usable)\n"
    ) in out
    assert "changes" not in out.split("recommended on all 8 GPUs")[1]  # it keeps every asked knob


def test_a_lowered_rollout_reservation_is_named_with_its_reason(config, capsys):
    asked = _qwen7b_on_a100_40(tp=4, sp=True, rollout_memory_fraction=0.9)
    proposal = smallest_fitting_layout(asked)
    assert proposal is not None
    [change] = knob_changes(asked, proposal)
    assert (change.name, change.asked, change.proposed) == ("rollout_memory_fraction", 0.9, 0.8)
    assert change.reason.startswith("rollout phase needs 39.55 GiB > 37.00 GiB usable on A100-40")
    argv = ["plan", "--model-config", config(QWEN25_7B), "--gpu", "A100-40", "--tp", "4", "--sp"]
    assert main([*argv, "--rollout-memory-fraction", "0.9"]) == 1
    out = capsys.readouterr().out
    assert (
        "    changes rollout_memory_fraction (vLLM gpu_memory_utilization) from 0.9 to 0.8: at 0.9, rollout phase "
        "needs 39.55 GiB > 37.00 GiB usable on A100-40 (largest term: kv cache); the KV cache holds 312,573 "
        "tokens per rollout rank\n"
    ) in out
    # The recommendation on the 8 GPUs lowers it further, to where its peak leaves the margin, and says so too.
    assert "changes rollout_memory_fraction (vLLM gpu_memory_utilization) from 0.9 to 0.7: at 0.9," in out


def test_the_32b_on_8_h100_has_no_layout_with_the_margin_and_says_so(config, capsys):
    argv = ["plan", "--model-config", config(QWEN25_32B), "--gpus-per-node", "8", "--gpu", "H100-80"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert (
        "smallest layout that fits: 8 x H100-80: tp=8 pp=1 dp=1 sp=True recompute=none, rollout_tp=2 "
        "rollout_memory_fraction=0.5 (peak 76.14 GiB, headroom 519.9 MiB = 0.7% of 76.65 GiB usable: TIGHT, "
        "under the 10% margin)\n"
    ) in out
    # Every fitting layout of the 8 GPUs is tight: the one with the most headroom, marked.
    assert (
        "recommended on all 8 GPUs of the run: none leaves the 10% margin; the most headroom: 8 x H100-80: tp=8 "
        "pp=1 dp=1 sp=True recompute=full, rollout_tp=2 rollout_memory_fraction=0.5 (peak 69.50 GiB, headroom "
        "7.15 GiB = 9.3% of 76.65 GiB usable: TIGHT, under the 10% margin)\n"
    ) in out


def test_a_fit_under_the_margin_is_tight_and_gets_a_recommendation(config, capsys):
    """The asked TP4 fits with 12.4% free: enough at the default margin, tight at 15% (exit 0 either way)."""
    argv = ["plan", "--model-config", config(QWEN25_7B), "--gpu", "A100-40", "--tp", "4", "--sp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "peak: 32.42 GiB per GPU, headroom 4.58 GiB = 12.4% of 37.00 GiB usable\nverdict: fits\n" in out
    assert "recommended" not in out
    assert main([*argv, "--margin", "0.15"]) == 0
    out = capsys.readouterr().out
    assert "12.4% of 37.00 GiB usable: TIGHT, under the 15% margin\nverdict: fits, but TIGHT\n" in out
    assert (
        "recommended on all 8 GPUs of the run (least recompute, then least model parallelism, leaving the 15% "
        "margin): 8 x A100-40: "
        "tp=4 pp=1 dp=2 sp=True recompute=none, rollout_tp=2 rollout_memory_fraction=0.5 (peak 25.94 GiB"
    ) in out


def test_a_margin_outside_0_to_1_is_one_line(config, capsys):
    assert main(["plan", "--model-config", config(QWEN25_7B), "--margin", "1.5"]) == 2
    assert capsys.readouterr().err.strip() == "error: --margin must be a fraction in [0, 1), got 1.5"
