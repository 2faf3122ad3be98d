"""bench/bench_train.py's compute limit: the step's FLOPs at the defaults' shapes over the rates probed at
those shapes."""

from __future__ import annotations

from bench.bench_train import PROMPT_LEN, WORKLOADS, step_gemm_rate, step_limit
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
    assert seconds == flops["generate"] / 50e9 + flops["update_shared"] / 100e9
    assert flops["update_shared"] < 3 * flops["log_probs"]  # each prompt computed once per group of 4
