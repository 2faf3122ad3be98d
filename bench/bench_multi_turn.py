"""Multi-turn rollouts on the embedded engine: each conversation's KV cache kept between turns
(``continue_conversations``) against recomputing every context each turn (the same calls under fresh
conversation ids, which the engine cannot match to a cache), same weights, same turns.

A turn: every conversation samples ``--new-tokens`` (no stop ids), then ``--tool-tokens`` random "tool answer"
tokens are appended, for ``--turns`` turns. Both variants produce the same tokens (greedy); the report gives
the median wall time of a whole rollout and the ratio recompute / reuse.

    python bench/bench_multi_turn.py [--model tiny] [--conversations 32] [--prompt-len 64] [--turns 4]
        [--new-tokens 32] [--tool-tokens 32] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import LocalRolloutConfig, LocalRolloutEngine, SamplingParams

if __package__:  # python -m bench.bench_multi_turn
    from bench._measure import median_seconds
    from bench._rollout_models import MODELS, build_hf, hf_to_rollout, model_config
else:  # python bench/bench_multi_turn.py
    from _measure import median_seconds
    from _rollout_models import MODELS, build_hf, hf_to_rollout, model_config


def rollout(
    engine: LocalRolloutEngine, prompts: list[list[int]], args: argparse.Namespace, fresh: bool
) -> list:
    """One multi-turn rollout; ``fresh``: new ids every turn (nothing reused). Returns the sampled tokens."""
    ids = itertools.count()
    contexts = [list(p) for p in prompts]
    tool = torch.Generator().manual_seed(1)
    conversations = list(range(len(prompts)))
    sampled = []
    for _ in range(args.turns):
        if fresh:
            conversations = [1_000 + next(ids) for _ in prompts]
        out = engine.continue_conversations(
            conversations, contexts, SamplingParams(temperature=0.0), [args.new_tokens] * len(prompts)
        )
        sampled.append(out.token_ids)
        answers = torch.randint(3, engine.arch.vocab_size, (len(prompts), args.tool_tokens), generator=tool)
        contexts = [c + r + a for c, r, a in zip(contexts, out.responses(), answers.tolist(), strict=True)]
    engine.end_conversations()
    return sampled


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tool-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = model_config(args.model)
    arch = ModelArch.from_hf_config(config)
    engine = LocalRolloutEngine(arch, LocalRolloutConfig())
    engine.load_weights(hf_to_rollout(build_hf(config), arch).items())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, arch.vocab_size, (args.conversations, args.prompt_len), generator=g).tolist()
    reuse, recompute = rollout(engine, prompts, args, False), rollout(engine, prompts, args, True)
    same = all(torch.equal(a, b) for a, b in zip(reuse, recompute, strict=True))
    seconds = median_seconds(
        {
            "reuse": lambda: rollout(engine, prompts, args, False),
            "recompute": lambda: rollout(engine, prompts, args, True),
        },
        args.repeats,
    )
    total = args.prompt_len + args.turns * (args.new_tokens + args.tool_tokens)
    print(
        f"{args.model}: {args.conversations} conversations x {args.turns} turns ({args.new_tokens} new + "
        f"{args.tool_tokens} tool tokens each, up to {total} tokens), {args.threads} threads; same tokens: {same}"
    )
    print(f"  KV cache kept between turns: {seconds['reuse']:.3f} s per rollout (median of {args.repeats})")
    print(f"  every context recomputed:    {seconds['recompute']:.3f} s")
    print(f"  recompute / reuse: {seconds['recompute'] / seconds['reuse']:.2f}x")


if __name__ == "__main__":
    main()
