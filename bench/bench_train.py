"""The step a user runs: ``mcore-rl train`` with the recipe defaults, against the bench's RLStep (the same step
in a Ray worker with nothing around it) and TRL 1.16's ``GRPOTrainer`` step, each side a fresh process per
round (what a new run costs, allocator and thread state included), interleaved.

Workloads (``--workload``):
- ``tiny``: issue 17's (Llama h256, 4 layers, 8 heads, intermediate 688, vocab 1000, fp32; 8 prompts x 4
  samples x 32 new tokens);
- ``realistic``: issue 33's (Llama h512, 8 layers, 8 query / 2 KV heads, intermediate 1376, vocab 32000,
  fp32; 8 prompts x 8 samples x 128 new tokens).
Prompts are 16 random words of a word-level tokenizer over the model's vocabulary; the reward is 1 when a
response's first word has an even id. One optimizer step per batch (verl's on-policy shortcut applies).

Sides:
- ``train``: ``python -m mcore_rl.cli train RECIPE`` (``defaults: [base]``, nothing tuned: the KL loss off
  and the fast paths at auto, as base.yaml has them), its steps read from ``metrics.jsonl``: ``time/step_s``
  (the step as the driver times it) and the gaps between the records' ``time/timestamp`` (the whole loop
  iteration: data loading, scoring, metrics, logging, progress bar included; the like-for-like ratio to TRL,
  whose timer covers its whole loop, divides by that iteration per response token);
- ``onerank``: the same ``mcore-rl train`` run laid out as the default was before 2026-12-05: one rank on all
  ``--threads`` threads (``trainer.n_gpus_per_node=1``, the whole batch one micro-batch, the optimizer
  distributed), where ``train`` now takes the default, one single-threaded rank per vCPU (data parallel over
  gloo, each rank's share one micro-batch, ``config/machine.py``): a rank whose threads span two vCPUs pays
  for where the host places them against each other (``bench/bench_machine_modes.py``);
- ``rlstep``: the same config's ``GRPOStep`` through a Ray worker, driven by this bench's loop (no logs, no
  progress bar): ``bench/bench_driver.py``'s measure, the step without the run around it;
- ``trl``: TRL's step on the same model, prompts and lengths (``bench/bench_grpo_step.py``'s subprocess).

Reported per side: the median step of each run (after ``--warmup`` steps), the median over runs, the
run-to-run spread (largest / smallest run median - 1), tokens per second (the logged response tokens / step), and
the ratios; and the step's compute limit measured in the same run (its matmul FLOPs, LM head included, over
the faster fp32 GEMM's (``torch.mm`` or oneDNN's) best rate at the step's decode and training shapes,
probed after each round: ``step_limit``) with each of our sides' share of it. Beside each run, a sample of
the machine's own speed: ``torch.mm`` at the realistic model's training shapes, timed in this process for
about a second just before and just after the run (GFLOP/s, their mean). These VMs' GEMM rate moves by tens
of percent within an hour; a run that lands in a slow spell shows it there. Two seconds do not stand for a
run of minutes, so the bench reports the rate beside the steps and does not divide by it. And the share of
the VM's CPU time its hypervisor stole during each run (``/proc/stat``; 0 on bare metal), which tells a
vCPU taken away from one that ran slowly where it was placed. For the ``train`` sides, a witness read
inside the run: the driver's rule scoring per step (pure Python in another process than the ranks', while
they wait), and the step over it: a fresh run slower in its steps and its scoring alike ran on a slower
machine (``scoring_witness``). ``--override KEY=VALUE`` applies to ``train``, ``onerank`` and ``rlstep``
alike.

Runs of a few seconds of steps land inside the host's spells; ``--steps 150`` on the tiny workload (about
40 s of steps per run) is a run of a user's length, over which the shortest spells average out (not the
host's slower minutes: README, "Step speed", and ``bench/RESULTS.md``).

    python -m bench.bench_train [--workload tiny|realistic] [--rounds 3] [--steps 6] [--warmup 2]
        [--sides train onerank rlstep trl] [--threads 2] [--override model.share_prompt_prefix=false ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from bench._measure import machine_cpu_jiffies, mm_seconds, parallel_region_us, steal_share
from bench._rollout_models import MODELS
from bench.grpo_step_limits import GemmRate, gemm_flops, gemm_shapes, linear_shapes, step_flops
from mcore_rl.engine.arch import ModelArch

REPO = Path(__file__).resolve().parents[1]
PROMPT_LEN = 16
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hf_config": {
            **MODELS["tiny"],
            "num_key_value_heads": 8,  # issue 17's model is MHA
            "initializer_range": 0.02,
        },
        "prompts": 8,
        "samples": 4,
        "new_tokens": 32,
    },
    "realistic": {"hf_config": dict(MODELS["realistic"]), "prompts": 8, "samples": 8, "new_tokens": 128},
}
SIDES = ("train", "onerank", "rlstep", "trl")


def even_first_word(data_source: str, solution_str: str, ground_truth: object, extra_info: object) -> float:
    """1 when the response's first word has an even id (about half the samples)."""
    words = solution_str.split()
    return float(bool(words) and words[0][1:].isdigit() and int(words[0][1:]) % 2 == 0)


def write_inputs(folder: Path, workload: dict[str, Any], rows: int) -> None:
    """A word-level tokenizer over the model's vocabulary (``w0`` is EOS and padding) and ``rows`` prompts."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from mcore_rl.data.rows import write_rows
    from mcore_rl.data.tokenizer import write_tokenizer_config

    vocab = workload["hf_config"]["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["w0"])
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(str(folder), eos_token="w0", pad_token="w0")
    ids = torch.randint(1, vocab, (rows, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [
        {"prompt": " ".join(f"w{i}" for i in r), "data_source": "bench", "reward_model": {"ground_truth": ""}}
        for r in ids
    ]
    write_rows(str(folder / "train.jsonl"), prompts)


def write_recipe(folder: Path, workload: dict[str, Any], steps: int, threads: int) -> Path:
    """A recipe a user would write for this workload: ``defaults: [base]`` and the workload, nothing tuned."""
    batch = workload["prompts"] * workload["samples"]
    recipe = {
        "defaults": ["base"],
        "model": {"hf_config": workload["hf_config"], "tokenizer_path": str(folder / "inputs")},
        "data": {
            "train_files": [str(folder / "inputs" / "train.jsonl")],
            "max_prompt_length": PROMPT_LEN,
            "max_response_length": workload["new_tokens"],
            "train_batch_size": workload["prompts"],
            "apply_chat_template": False,
            "shuffle": False,
        },
        "rollout": {"n": workload["samples"]},
        # each rank's share of the batch in one micro-batch when the run takes a rank per thread (the default)
        "algorithm": {"ppo_micro_batch_size_per_gpu": batch // threads},
        "optim": {"lr": 1.0e-5},
        "reward": {"custom_function": f"{Path(__file__).resolve()}:even_first_word"},
        "trainer": {
            "total_training_steps": steps,
            "val_before_train": False,
            "num_cpus": threads,
            "default_local_dir": str(folder / "run"),
        },
        "logging": {"plot": False},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run_train(folder: Path, recipe: Path, overrides: list[str], warmup: int) -> dict[str, list[float]]:
    """One fresh ``mcore-rl train`` run; its timed steps' ``time/step_s`` and whole-iteration gaps."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, "-m", "mcore_rl.cli", "train", str(recipe), *overrides]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"mcore-rl train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    notes = [line for line in done.stderr.splitlines() if "fast paths:" in line]
    log = folder / "run" / "logs" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["stage"] == "rl" and r.get("step", 0) > 0 and "time/step_s" in r]
    stamps = [r["time/timestamp"] for r in steps]
    return {
        "step": [r["time/step_s"] for r in steps[warmup:]],
        "iteration": [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)],
        # the loop's own cost around each step: the record gap less the step it timed (same step, same noise)
        "driver": [
            (b - a) - r["time/step_s"]
            for a, b, r in zip(stamps[warmup:], stamps[warmup + 1 :], steps[warmup + 1 :], strict=False)
        ],
        "generate": [r.get("time/generate_s", float("nan")) for r in steps[warmup:]],
        "update": [r.get("time/update_s", float("nan")) for r in steps[warmup:]],
        "score": [r.get("time/score_s", float("nan")) for r in steps[warmup:]],
        # a response may end at the stop id before new_tokens (TRL's are forced to full length)
        "response_len": [r["response_len"] for r in steps[warmup:]],
        "notes": notes,  # type: ignore[dict-item]
    }


def one_rank_overrides(workload: dict[str, Any]) -> list[str]:
    """The ``onerank`` side's layout: one rank on all the threads, the whole batch one micro-batch, the
    optimizer distributed (the defaults before ``trainer.n_gpus_per_node`` became automatic)."""
    batch = workload["prompts"] * workload["samples"]
    return [
        "trainer.n_gpus_per_node=1",
        f"algorithm.ppo_micro_batch_size_per_gpu={batch}",
        "optim.use_distributed_optimizer=true",
    ]


def rlstep_child(folder: Path, overrides: list[str], steps: int, warmup: int, threads: int) -> None:
    """The ``rlstep`` side in a process of its own: the recipe's ``GRPOStep`` through one Ray worker, stepped by
    a bare loop; prints the timed steps as one JSON line."""
    import torch

    from mcore_rl.config import load_config
    from mcore_rl.controller import RayConfig, init_ray
    from mcore_rl.data.prompts import PromptDataset
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.scoring import RewardScorer
    from mcore_rl.trainer.build import build_actor_group, worker_spec
    from mcore_rl.trainer.grpo import GRPOStep

    cfg = load_config(folder / "recipe.yaml", overrides)
    init_ray(RayConfig(num_cpus=threads))
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    dataset = PromptDataset.from_files(cfg.data.train_files, tokenizer, cfg.data)
    size = cfg.data.train_batch_size
    actors = build_actor_group(cfg, worker_spec(cfg, steps), use_ray=True)
    torch.set_num_threads(1)  # what a Ray driver keeps (build_actor_group): it only schedules
    times: list[float] = []
    lengths: list[float] = []
    try:
        with RewardScorer(cfg.reward) as scorer:
            rl_step = GRPOStep(cfg, actors, tokenizer, scorer)
            for step in range(1, steps + 1):
                prompts = dataset.batch(range((step - 1) * size, step * size))
                metrics = rl_step.run(prompts, step).metrics()
                times.append(metrics["time/step_s"])
                lengths.append(metrics["response_len"])
    finally:
        actors.shutdown()
    print(json.dumps({"step": times[warmup:], "response_len": lengths[warmup:]}))


def run_rlstep(
    folder: Path, overrides: list[str], steps: int, warmup: int, threads: int
) -> dict[str, list[float]]:
    cmd = [sys.executable, "-m", "bench.bench_train", "--child-rlstep", str(folder)]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    cmd += [arg for o in overrides for arg in ("--override", o)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"rlstep child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_trl(workload: dict[str, Any], steps: int, warmup: int, threads: int) -> dict[str, list[float]]:
    """TRL's ``GRPOTrainer`` step on the workload's model and the first batch of the same prompts, in a fresh
    TRL process (``bench/bench_grpo_step.py``'s ``TrlBaseline``)."""
    import torch

    from bench.bench_grpo_step import TRL_PYTHON, TrlBaseline

    vocab = workload["hf_config"]["vocab_size"]
    ids = torch.randint(
        1, vocab, (workload["prompts"], PROMPT_LEN), generator=torch.Generator().manual_seed(0)
    )
    args = argparse.Namespace(
        n=workload["samples"],
        new_tokens=workload["new_tokens"],
        threads=threads,
        hf_config=workload["hf_config"],
    )
    trl = TrlBaseline(TRL_PYTHON, ids, args)
    try:
        rows = [trl.step(ids, step) for step in range(steps)]
    finally:
        trl.close()
    timed = rows[warmup:]
    return {
        "step": [r["step"] for r in timed],
        "generate": [r["generate"] for r in timed],
        "update": [r["step"] - r["generate"] for r in timed],
    }


def gemm_probe_gflops() -> float:
    """The machine's fp32 GEMM rate of the moment (the faster of ``torch.mm`` and oneDNN's; about a second):
    the realistic model's linear layers over 4096 tokens and its LM head over 2048, one product each."""
    arch = ModelArch.from_hf_config(WORKLOADS["realistic"]["hf_config"])
    gemms = [(4096, k, c, 1) for k, c in linear_shapes(arch)] + [(2048, arch.hidden_size, arch.vocab_size, 1)]
    seconds = sum(mm_seconds(m, k, c, reps=5) for m, k, c, _ in gemms)
    return gemm_flops(gemms) / seconds / 1e9


def step_limit(workload: dict[str, Any], rate: GemmRate) -> tuple[float, dict[str, float]]:
    """The step's compute limit: its matmul FLOPs (generation's decode steps at decode shapes and each prompt's
    prefill, once, at training shapes, the update's forward and
    backward at training shapes, LM head included, each prompt once per group as the defaults compute it; no
    separate log-prob pass: the on-policy shortcut) over ``torch.mm``'s best rate at those shapes in this run
    (``bench/grpo_step_limits.py``). -> (seconds, the phases' GFLOP)."""
    arch = ModelArch.from_hf_config(workload["hf_config"])
    n, samples = workload["prompts"] * workload["samples"], workload["samples"]
    flops = step_flops(arch, n, PROMPT_LEN, workload["new_tokens"], samples)
    train_rate, decode_rate = rate.best["train"] * 1e9, rate.best["decode"] * 1e9
    seconds = (
        flops["generate_prefill"] / train_rate  # each prompt once, at training-sized shapes
        + flops["generate_decode"] / decode_rate
        + flops["update_shared"] / train_rate
    )
    return seconds, {"generate": flops["generate"] / 1e9, "update": flops["update_shared"] / 1e9}


def step_gemm_rate(workload: dict[str, Any]) -> GemmRate:
    """``torch.mm`` at the workload's decode and training shapes (:func:`step_limit`), probed after each round."""
    arch = ModelArch.from_hf_config(workload["hf_config"])
    n = workload["prompts"] * workload["samples"]
    return GemmRate(gemm_shapes(arch, n, PROMPT_LEN, workload["new_tokens"]))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _per_round(runs: dict[str, list[dict[str, Any]]], numerator: str, denominator: str) -> list[float]:
    """Each round's ratio of two sides' run medians (the sides of one round ran back to back)."""
    return [
        _median(a["step"]) / _median(b["step"])
        for a, b in zip(runs[numerator], runs[denominator], strict=True)
    ]


def _spread(values: list[float]) -> float:
    return max(values) / min(values) - 1


def scoring_witness(per_run: list[dict[str, Any]]) -> tuple[list[float], list[float]] | None:
    """The machine's speed read inside each run: the median of the driver's rule scoring per step
    (``time/score_s``: pure Python in the driver's process, with ``reward.num_workers: 0``, while the ranks
    wait for the next call, so it shares no state with them), and each run's median step over it.
    -> (scoring ms per run, step / scoring per run); None for a side that does not log it (TRL)."""
    if not all(r.get("score") for r in per_run):
        return None
    scoring = [_median(r["score"]) for r in per_run]
    return [s * 1e3 for s in scoring], [_median(r["step"]) / s for r, s in zip(per_run, scoring, strict=True)]


def side_tokens(per_run: list[dict[str, Any]], workload: dict[str, Any]) -> float:
    """Response tokens a side generates per step: ``mcore-rl train``'s as its records count them (a response
    ends at the stop id), else (TRL's, forced to full length) prompts x samples x new tokens."""
    lengths = [v for r in per_run for v in r.get("response_len", [])]
    per_sequence = statistics.fmean(lengths) if lengths else workload["new_tokens"]
    return workload["prompts"] * workload["samples"] * per_sequence


def _print_side(side: str, per_run: list[dict[str, Any]], tokens: float, threads: int) -> float:
    """One side's lines of the report; returns the median over its runs' median steps."""
    run_medians = [_median(r["step"]) for r in per_run]
    median = _median(run_medians)
    cells = " ".join(f"{m:.3f}" for m in run_medians)
    print(
        f"  {side:<7} step {median:.3f} s (runs: {cells}; run-to-run spread {_spread(run_medians):.1%}), "
        f"{tokens / median:.0f} tokens/s ({tokens:.0f} response tokens per step)"
    )
    # what a user's run delivers is its tokens over its time: the mean step, which a run longer than the
    # machine's spells of speed (tens of seconds, bench/bench_machine_modes.py) averages over them
    run_means = [statistics.fmean(r["step"]) for r in per_run]
    print(
        f"          run mean   {' '.join(f'{m:.3f}' for m in run_means)} s (run-to-run spread "
        f"{_spread(run_means):.1%}; {sum(len(r['step']) for r in per_run) // len(per_run)} timed steps per run)"
    )
    rates = " ".join(f"{r['probe_gflops']:.0f}" for r in per_run)
    print(f"          machine    {rates} GFLOP/s (fastest fp32 GEMM around each run)")
    # the threads' meeting cost moves with where the host runs the vCPUs (bench/bench_machine_modes.py)
    regions = " ".join(f"{r['probe_region_us'][0]:.1f}->{r['probe_region_us'][1]:.1f}" for r in per_run)
    print(f"          vCPUs      {regions} us per {threads}-thread region (before -> after each run)")
    # a VM's vCPUs can also be descheduled by its host: the share of the run's CPU time that was stolen
    steal = " ".join(f"{r['steal']:.1%}" for r in per_run)
    print(f"          stolen     {steal} of the machine's CPU time during each run (/proc/stat)")
    # a run that is slow everywhere, the driver's own Python included, ran on a slower machine, not in a
    # slower state of ours: the step over a witness that shares nothing with the ranks
    witness = scoring_witness(per_run)
    if witness is not None:
        scoring, ratios = witness
        print(
            f"          scoring    {' '.join(f'{s:.3f}' for s in scoring)} ms per step on the driver (the "
            f"machine's speed inside each run); step / scoring {' '.join(f'{r:.0f}' for r in ratios)} "
            f"(run-to-run spread {_spread(ratios):.1%})"
        )
    # a spread between runs that the steps within one run also show is the machine's, not a run's state
    steps = " | ".join(
        " ".join(f"{s:.2f}" for s in r["step"])
        if len(r["step"]) <= 12
        else f"{min(r['step']):.2f}-{max(r['step']):.2f}"
        for r in per_run
    )
    within = max(_spread(r["step"]) for r in per_run)
    print(f"          steps      {steps} s (largest spread within a run: {within:.1%})")
    for phase in ("iteration", "driver", "generate", "update"):
        values = [v for r in per_run for v in r.get(phase, [])]
        if values:
            print(f"          {phase:<10} {_median(values):.3f} s (median over runs' steps)")
    return median


def report(
    workload_name: str, runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, rate: GemmRate
) -> None:
    workload = WORKLOADS[workload_name]
    tokens = {side: side_tokens(per_run, workload) for side, per_run in runs.items()}
    print(
        f"workload {workload_name}: {workload['prompts']} prompts x {workload['samples']} samples x "
        f"{workload['new_tokens']} new tokens; {args.rounds} rounds, each side a fresh process per round, "
        f"{args.steps} steps per run, median after {args.warmup} warm-up; {args.threads} threads"
        f"{'; overrides ' + ' '.join(args.override) if args.override else ''}"
    )
    medians = {side: _print_side(side, per_run, tokens[side], args.threads) for side, per_run in runs.items()}
    limit, gflop = step_limit(workload, rate)
    print(
        f"  compute limit {limit:.3f} s per step: generate {gflop['generate']:.0f} GFLOP at "
        f"{rate.best['decode']:.0f} GFLOP/s (decode shapes), update {gflop['update']:.0f} GFLOP at "
        f"{rate.best['train']:.0f} GFLOP/s (training shapes); fastest fp32 GEMM's best after each round, "
        f"{args.threads} threads"
    )
    for side in ("train", "onerank", "rlstep"):
        if side in medians:
            print(f"  {side} at {limit / medians[side]:.0%} of the compute limit (limit / median step)")
    if "train" in medians and "onerank" in medians:
        print(
            f"  onerank / train: step {medians['onerank'] / medians['train']:.3f} (medians); per round "
            f"{', '.join(f'{r:.3f}' for r in _per_round(runs, 'onerank', 'train'))}"
        )
    if "train" in medians and "rlstep" in medians:
        train_iter = _median([v for r in runs["train"] for v in r["iteration"]])
        print(
            f"  mcore-rl train / bench RLStep: step {medians['train'] / medians['rlstep']:.3f}, whole iteration "
            f"{train_iter / medians['rlstep']:.3f}"
        )
    if "trl" in medians:
        for side in ("train", "onerank", "rlstep"):
            if side in medians:
                per_token = (medians["trl"] / tokens["trl"]) / (medians[side] / tokens[side])
                print(
                    f"  TRL / {side}: {medians['trl'] / medians[side]:.2f}x (medians), {per_token:.2f}x per "
                    f"response token; per round {', '.join(f'{r:.2f}x' for r in _per_round(runs, 'trl', side))}"
                )
        if "train" in medians:  # like for like: TRL's timer covers its whole loop, the driver's work included
            iteration = _median([v for r in runs["train"] for v in r["iteration"]])
            like = (medians["trl"] / tokens["trl"]) / (iteration / tokens["train"])
            print(f"  TRL / train, our whole iteration per response token (like for like): {like:.2f}x")
    notes = runs.get("train", [{}])[0].get("notes")
    if notes:
        print("  mcore-rl train's fast-path notes: " + " | ".join(n.split("note: ")[-1] for n in notes))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE for train and rlstep")
    parser.add_argument("--child-rlstep", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup >= args.steps - 1:
        parser.error(f"--warmup={args.warmup} leaves fewer than 2 timed steps of --steps={args.steps}")
    if args.child_rlstep is not None:
        rlstep_child(args.child_rlstep, args.override, args.steps, args.warmup, args.threads)
        return 0
    workload = WORKLOADS[args.workload]
    batch = workload["prompts"] * workload["samples"]
    if batch % args.threads:  # the recipe's micro-batch is a rank's share at one rank per thread
        parser.error(f"--threads={args.threads} does not divide the workload's {batch} sequences")
    train_overrides = {"train": args.override, "onerank": args.override + one_rank_overrides(workload)}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in args.sides}
    rate = step_gemm_rate(workload)
    for r in range(args.rounds):
        order = args.sides[r % len(args.sides) :] + args.sides[: r % len(args.sides)]
        for side in order:
            with tempfile.TemporaryDirectory(prefix=f"bench_train_{side}_") as tmp:
                folder = Path(tmp)
                write_inputs(folder / "inputs", workload, workload["prompts"] * args.steps)
                recipe = write_recipe(folder, workload, args.steps, args.threads)
                rate_before, region_before = gemm_probe_gflops(), parallel_region_us(args.threads)
                cpu_before, start = machine_cpu_jiffies(), time.perf_counter()
                if side in train_overrides:
                    runs[side].append(run_train(folder, recipe, train_overrides[side], args.warmup))
                elif side == "rlstep":
                    runs[side].append(
                        run_rlstep(folder, args.override, args.steps, args.warmup, args.threads)
                    )
                else:
                    runs[side].append(run_trl(workload, args.steps, args.warmup, args.threads))
                seconds = time.perf_counter() - start
                runs[side][-1]["steal"] = steal_share(cpu_before, machine_cpu_jiffies())
                runs[side][-1]["probe_gflops"] = (rate_before + gemm_probe_gflops()) / 2
                region_after = parallel_region_us(args.threads)
                runs[side][-1]["probe_region_us"] = (region_before, region_after)
                print(
                    f"round {r + 1} {side}: {seconds:.0f} s, machine {runs[side][-1]['probe_gflops']:.0f} "
                    f"GFLOP/s, {region_before:.2f} -> {region_after:.2f} us per parallel region",
                    file=sys.stderr,
                    flush=True,
                )
        rate.step(torch.empty(0), r)
    report(args.workload, runs, args, rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
