"""``mcore-rl demo``: the smallest end-to-end run that exists today, on CPU in a few minutes.

What it does, honestly: supervised training of a randomly initialised 0.5M-parameter Llama on the
synthetic addition task, through the real stack (ParallelContext, megatron-core GPTModel, DDP, distributed
optimizer, pipeline schedule, our loss functions), and greedy exact-match accuracy on 1000 held-out prompts
before and after. The GRPO stage joins once the RL driver lands; this command will then run SFT warm-up
followed by GRPO with the exact-match verifier.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from tqdm import tqdm

from mcore_rl.algo import aggregate_loss, log_probs_from_logits
from mcore_rl.data.arithmetic import AdditionProblem, CharTokenizer, exact_match, make_problems, sft_batch
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.train_engine import MicroBatch, OptimizerConfig, TrainEngine
from mcore_rl.parallel.context import ParallelConfig, ParallelContext

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
    parser.add_argument("--max-steps", type=int, default=1500, help="SFT steps at most")
    parser.add_argument(
        "--target-accuracy", type=float, default=0.6, help="stop SFT at this held-out accuracy"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="runs/demo", help="folder for metrics.jsonl")


def _sft_loss(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_probs = log_probs_from_logits(output[..., : ARCH.vocab_size], mb.extras["labels"])
    loss = aggregate_loss(-log_probs, mb.extras["mask"], "token-mean")
    return loss, {"loss": loss.detach().clone()}


@torch.no_grad()
def greedy_accuracy(engine: TrainEngine, problems: list[AdditionProblem], max_new_tokens: int = 5) -> float:
    """Exact-match accuracy of greedy completions (prompts share one length, so no padding is needed)."""
    model = engine.models[0]
    model.eval()
    tokens = torch.tensor([TOKENIZER.encode(p.prompt) for p in problems])
    for _ in range(max_new_tokens):
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, None)[:, -1, : ARCH.vocab_size]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    prompt_len = len(problems[0].prompt)
    completions = [TOKENIZER.decode(row[prompt_len:].tolist()) for row in tokens]
    return sum(exact_match(c, p) for c, p in zip(completions, problems, strict=True)) / len(problems)


def run(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    held_out = make_problems(1000, seed=10_000 + args.seed)
    with ParallelContext.initialize(ParallelConfig(seed=args.seed)) as ctx:
        engine = TrainEngine.build(
            ARCH, ctx, optim=OptimizerConfig(lr=args.lr, adam_beta2=0.99, clip_grad=1.0)
        )
        before = greedy_accuracy(engine, held_out)
        print(f"held-out exact match before training: {before:.1%} (1000 prompts)")
        history = _train(engine, args, held_out)
        after = greedy_accuracy(engine, held_out)
    print(f"held-out exact match after {history[-1]['step']} SFT steps: {after:.1%} (was {before:.1%})")
    print(f"metrics: {os.path.join(args.out, 'metrics.jsonl')}")
    return 0 if after > before else 1


def _train(
    engine: TrainEngine, args: argparse.Namespace, held_out: list[AdditionProblem]
) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    start = time.perf_counter()
    bar = tqdm(range(1, args.max_steps + 1), desc="sft", unit="step", mininterval=2.0)
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as log:
        for step in bar:
            tokens, labels, mask = sft_batch(
                make_problems(args.batch_size, seed=args.seed * 1_000_003 + step), TOKENIZER
            )
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            result, metrics = engine.train_step(
                [MicroBatch(tokens, positions, {"labels": labels, "mask": mask})], _sft_loss
            )
            record: dict[str, Any] = {
                "step": step,
                "loss": float(metrics[0]["loss"]),
                "grad_norm": result.grad_norm,
            }
            if step % args.eval_every == 0:
                record["heldout_accuracy"] = greedy_accuracy(engine, held_out[:200])
                engine.chunks[0].train()
            record["elapsed_s"] = round(time.perf_counter() - start, 2)
            log.write(json.dumps(record) + "\n")
            history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=record.get("heldout_accuracy", ""))
            if record.get("heldout_accuracy", 0.0) >= args.target_accuracy:
                break
    return history
