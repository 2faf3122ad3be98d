"""``mcore-rl demo``: the main job, a tiny GRPO run on CPU that visibly learns, in a few minutes.

A randomly initialised 0.5M-parameter Llama learns the synthetic addition task through the real stack
(ParallelContext, megatron-core GPTModel, DDP, distributed optimizer, our loss functions, the hybrid engine's
resharding and the embedded rollout engine):

1. SFT warm-up on labelled examples, stopped as soon as held-out accuracy reaches ``--sft-target`` (30%):
   a policy that sometimes gets the answer right, so GRPO groups have mixed rewards.
2. GRPO on fresh prompts whose answers are never shown to the model: only the exact-match verifier scores
   the sampled completions (see mcore_rl/demo_grpo.py).

Greedy exact match on 1000 held-out prompts is printed before training, after SFT and after GRPO. Honest
framing (shared/notes/demo-calibration.md): with labels available, more SFT would beat GRPO from the same
checkpoint; the demo shows RL improving a policy from a verifier alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, TextIO

import torch
from tqdm import tqdm

from mcore_rl.algo import aggregate_loss, log_probs_from_logits
from mcore_rl.data.arithmetic import AdditionProblem, CharTokenizer, make_problems, sft_batch
from mcore_rl.demo_grpo import GRPOConfig, build_hybrid, greedy_accuracy, grpo_step
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import LocalRolloutEngine
from mcore_rl.engine.train_engine import MicroBatch, OptimizerConfig, TrainEngine
from mcore_rl.io.flags import fraction, nonnegative_float, positive_float, positive_int
from mcore_rl.io.output import OutputFolder
from mcore_rl.parallel.context import ParallelConfig, ParallelContext
from mcore_rl.parallel.reshard.hybrid import HybridEngine

TOKENIZER = CharTokenizer()
ARCH = ModelArch.from_hf_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": TOKENIZER.vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sft-steps", type=positive_int, default=1500, help="SFT steps at most")
    parser.add_argument(
        "--sft-target", type=fraction, default=0.3, help="stop SFT at this validation accuracy (200 prompts)"
    )
    parser.add_argument("--sft-lr", type=positive_float, default=1e-3)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="SFT sequences per step")
    parser.add_argument("--eval-every", type=positive_int, default=50, help="SFT steps between evaluations")
    parser.add_argument("--grpo-seconds", type=nonnegative_float, default=120.0, help="GRPO stage length")
    parser.add_argument("--grpo-lr", type=positive_float, default=5e-5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out",
        default="runs/demo",
        help="run folder for metrics.jsonl; appears when the run ends, replacing an earlier demo run's",
    )


def _sft_loss(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_probs = log_probs_from_logits(output[..., : ARCH.vocab_size], mb.extras["labels"])
    loss = aggregate_loss(-log_probs, mb.extras["mask"], "token-mean")
    return loss, {"loss": loss.detach().clone()}


def run(args: argparse.Namespace) -> int:
    if args.out.strip():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # runs/ on a first run
    # A run folder from before run folders carried our marker holds metrics.jsonl alone: ours to replace.
    legacy = os.path.isdir(args.out) and os.listdir(args.out) == ["metrics.jsonl"]
    output = OutputFolder.plan(args.out, overwrite=legacy, replace_ours=True, kind="demo-run")
    staging = output.begin()
    try:
        after_sft, after = _run(args, staging)
        output.commit()
    except BaseException:
        output.abort()
        raise
    print(f"metrics: {os.path.join(args.out, 'metrics.jsonl')}")
    if after <= after_sft:  # a noisy short run can miss: a warning, not a failure
        print(
            "warning: GRPO did not raise held-out accuracy in this run (noise at this size; see README for "
            "figures over several seeds)"
        )
    return 0


def _run(args: argparse.Namespace, run_dir: str) -> tuple[float, float]:
    """The three stages; returns held-out accuracy after SFT and after GRPO."""
    held_out = make_problems(1000, seed=10_000 + args.seed)  # the before / after scores
    validation = make_problems(200, seed=20_000 + args.seed)  # SFT's stopping rule and the progress bars
    with (
        ParallelContext.initialize(ParallelConfig(seed=args.seed)) as ctx,
        open(os.path.join(run_dir, "metrics.jsonl"), "w") as log,
    ):
        engine = TrainEngine.build(
            ARCH, ctx, optim=OptimizerConfig(lr=args.sft_lr, adam_beta2=0.99, clip_grad=1.0)
        )
        hybrid, rollout = build_hybrid(engine)
        before = greedy_accuracy(hybrid, rollout, held_out, TOKENIZER)
        print(f"held-out exact match before training: {before:.1%} (1000 prompts)")
        sft_steps = _sft(engine, hybrid, rollout, args, validation, log)
        after_sft = greedy_accuracy(hybrid, rollout, held_out, TOKENIZER)
        print(f"after {sft_steps} SFT steps: {after_sft:.1%}")
        _set_lr(engine, args.grpo_lr)
        grpo_steps = _grpo(hybrid, rollout, args, validation, log)
        after = greedy_accuracy(hybrid, rollout, held_out, TOKENIZER)
    print(
        f"held-out exact match (1000 prompts): {before:.1%} before, {after_sft:.1%} after SFT, "
        f"{after:.1%} after {grpo_steps} GRPO steps ({after - after_sft:+.1%} from the verifier alone)"
    )
    return after_sft, after


def _set_lr(engine: TrainEngine, lr: float) -> None:
    """The GRPO stage continues with the same optimizer (and its moments) at its own learning rate."""
    for optimizer in engine.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
            group["max_lr"] = group["min_lr"] = lr


def _sft(
    engine: TrainEngine,
    hybrid: HybridEngine,
    rollout: LocalRolloutEngine,
    args: argparse.Namespace,
    validation: list[AdditionProblem],
    log: TextIO,
) -> int:
    """SFT until ``--sft-target`` validation accuracy (or ``--sft-steps``); returns the steps taken."""
    start = time.perf_counter()
    bar = tqdm(range(1, args.sft_steps + 1), desc="sft", unit="step", mininterval=2.0)
    step = 0
    for step in bar:
        tokens, labels, mask = sft_batch(
            make_problems(args.batch_size, seed=args.seed * 1_000_003 + step), TOKENIZER
        )
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        result, metrics = engine.train_step(
            [MicroBatch(tokens, positions, {"labels": labels, "mask": mask})], _sft_loss
        )
        record: dict[str, Any] = {"stage": "sft", "step": step, "loss": float(metrics[0]["loss"])}
        record["grad_norm"] = result.grad_norm
        if step % args.eval_every == 0:
            record["val_accuracy"] = greedy_accuracy(hybrid, rollout, validation, TOKENIZER)
        record["elapsed_s"] = round(time.perf_counter() - start, 2)
        log.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{record['loss']:.3f}", acc=record.get("val_accuracy", ""), refresh=False)
        if record.get("val_accuracy", 0.0) >= args.sft_target:
            break
    bar.close()
    return step


def _grpo(
    hybrid: HybridEngine,
    rollout: LocalRolloutEngine,
    args: argparse.Namespace,
    validation: list[AdditionProblem],
    log: TextIO,
) -> int:
    """GRPO for ``--grpo-seconds`` on fresh prompts; returns the steps taken."""
    config = GRPOConfig()
    start = time.perf_counter()
    step = 0
    with tqdm(desc="grpo", unit="step", mininterval=2.0) as bar:
        while time.perf_counter() - start < args.grpo_seconds:
            step += 1
            problems = make_problems(config.prompts_per_step, seed=args.seed * 7_000_003 + step)
            record: dict[str, Any] = {"stage": "grpo", "step": step}
            record.update(
                grpo_step(hybrid, rollout, problems, TOKENIZER, config, seed=args.seed * 1000 + step)
            )
            if step % 50 == 0:
                record["val_accuracy"] = greedy_accuracy(hybrid, rollout, validation, TOKENIZER)
            record["elapsed_s"] = round(time.perf_counter() - start, 2)
            log.write(json.dumps(record) + "\n")
            bar.update()
            bar.set_postfix(
                reward=f"{record['reward']:.2f}", acc=record.get("val_accuracy", ""), refresh=False
            )
    return step
