"""bench/bench_train.py's compute limit: the step's FLOPs at the defaults' shapes over the rates probed at
those shapes; its reading of the CPU time a VM's host stole during a run; and its in-run witness of the
machine's speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._measure import machine_cpu_jiffies, steal_share
from bench.bench_train import PROMPT_LEN, WORKLOADS, scoring_witness, side_tokens, step_gemm_rate, step_limit
from bench.grpo_step_limits import step_flops
from mcore_rl.engine.arch import ModelArch


def test_bench_train_limit_is_the_step_flops_over_the_rates_at_their_shapes() -> None:
    workload = WORKLOADS["tiny"]
    rate = step_gemm_rate(workload)
    assert set(rate.shapes) == {"decode", "train"} and rate.shapes["decode"][0][0] == 32  # 8 x 4 rows
    rate.best = {"decode": 50.0, "train": 100.0}  # GFLOP/s, as a round's probe would leave them
    seconds, gflop = step_limit(workload, rate)
    flops = step_flops(ModelArch.from_hf_config(workload["hf_config"]), 32, PROMPT_LEN, 32, 4)
    assert gflop == {"generate": flops["generate"] / 1e9, "update": flops["update_shared"] / 1e9}
    # the prompts' prefill (once each) at training shapes' rate, the decode steps at decode shapes'
    expected = (
        flops["generate_prefill"] / 100e9 + flops["generate_decode"] / 50e9 + flops["update_shared"] / 100e9
    )
    assert seconds == pytest.approx(expected)
    assert flops["update_shared"] < 3 * flops["log_probs"]  # each prompt computed once per group of 4


def test_our_tokens_are_the_responses_generated_trls_the_forced_full_length() -> None:
    # a response of ours ends at the stop id (the random model samples it): 31.5 of 32 tokens on average
    workload = WORKLOADS["tiny"]  # 8 prompts x 4 samples x 32 new tokens
    ours = [{"step": [0.3, 0.3], "response_len": [31.0, 32.0]}, {"step": [0.3], "response_len": [31.5]}]
    assert side_tokens(ours, workload) == 32 * 31.5
    assert side_tokens([{"step": [0.6]}], workload) == 32 * 32  # TRL: min_new_tokens = new tokens


def test_steal_share_is_stolen_ticks_over_all_ticks_of_the_span(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice (guest inside user: not added again)
    stat.write_text("cpu  100 0 20 300 5 0 5 10 40 0\ncpu0 50 0 10 150 2 0 2 5 20 0\n")
    before = machine_cpu_jiffies(str(stat))
    assert before == (440, 10)
    stat.write_text("cpu  180 0 30 380 5 0 5 40 70 0\n")
    after = machine_cpu_jiffies(str(stat))
    assert after == (640, 40)
    assert steal_share(before, after) == 30 / 200
    assert steal_share(after, after) == 0.0  # no ticks between the readings
    assert machine_cpu_jiffies(str(tmp_path / "missing")) == (0, 0)


def test_scoring_witness_is_each_runs_step_over_its_drivers_scoring() -> None:
    fast = {"step": [0.28, 0.29, 0.30], "score": [0.0013, 0.0014, 0.0015]}
    slow = {"step": [0.37, 0.38, 0.40], "score": [0.0017, 0.0019, 0.0018]}
    witness = scoring_witness([fast, slow])
    assert witness is not None
    scoring, ratios = witness
    assert scoring == pytest.approx([1.4, 1.8])
    assert ratios == pytest.approx([0.29 / 0.0014, 0.38 / 0.0018])
    assert scoring_witness([fast, {"step": [0.6, 0.6]}]) is None  # TRL's runs log no scoring
