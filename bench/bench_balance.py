"""``trainer.balance_batch``: the actor update at two data-parallel ranks with prompt groups dealt by tokens,
against the same update with the rows in batch order (the baseline), on responses of uneven length.

Two single-threaded gloo ranks (the CPU default layout) each build the actor worker the run builds (packing and
shared prompts on, the optimizer state whole on each rank) and run the on-policy update
(``update_on_policy``: one optimizer step) on their shard of a synthetic batch: ``--prompts`` prompts of 16
tokens x ``--samples`` samples, response lengths drawn per prompt from a log-normal (median ``--median``
tokens, clipped to 4..``--max-response``) with each sample within +-25% of its prompt's: answers of one
prompt are alike, prompts differ (a reasoning task's shape). The same batches run both ways, interleaved,
each way's update timed as the slower rank sees it (the ranks meet at the gradient sum, so the faster one
waits there). Printed: median update per way, their ratio per batch, and the heavier rank's tokens over the
mean (1.00: even).

    python -m bench.bench_balance [--model tiny] [--batches 6] [--repeats 3] [--median 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench._rollout_models import MODELS
from mcore_rl.controller.dispatch import split_record
from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.optim import OptimConfig
from mcore_rl.engine.packing.token_batching import balanced_order, row_lengths, select_rows
from mcore_rl.engine.workers.actor import HybridWorker, WorkerSpec
from mcore_rl.engine.workers.losses import PolicyLossSettings
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from mcore_rl.parallel.launch_env import free_local_port
from mcore_rl.types import TrainBatch

PROMPT_LEN = 16
RANKS = 2


def synthetic_batch(args: argparse.Namespace, seed: int, vocab: int) -> TrainBatch:
    """Prompt-major rows (``samples`` consecutive rows per prompt), right-padded to the longest response."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.exp(torch.randn(args.prompts, generator=gen) * 0.8) * args.median
    jitter = 1.0 + (torch.rand(args.prompts, args.samples, generator=gen) - 0.5) * 0.5
    lengths = (base[:, None] * jitter).round().clamp(4, args.max_response).long().flatten()
    width = PROMPT_LEN + int(lengths.max())
    rows = args.prompts * args.samples
    prompts = torch.randint(1, vocab, (args.prompts, PROMPT_LEN), generator=gen).repeat_interleave(
        args.samples, 0
    )
    tokens = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width)
    tokens[:, :PROMPT_LEN] = prompts
    for row, length in enumerate(lengths.tolist()):
        tokens[row, PROMPT_LEN : PROMPT_LEN + length] = torch.randint(1, vocab, (length,), generator=gen)
        mask[row, PROMPT_LEN - 1 : PROMPT_LEN - 1 + length] = 1.0  # positions that predict a response token
    advantages = (torch.randint(0, 2, (rows, 1), generator=gen).float() * 2 - 1) * mask
    zeros = torch.zeros(rows, width)
    return TrainBatch(tokens, mask, zeros, advantages, zeros.clone())


def rank_main(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(RANKS))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope|full scope).*")
    hf = dict(MODELS[args.model])
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        spec = WorkerSpec(
            arch=ModelArch.from_hf_config(hf),
            optim=OptimConfig(lr=1e-6, use_distributed_optimizer=None),
            total_optimizer_steps=10_000,
            remove_padding=True,
            share_prompt_prefix=True,
        )
        worker = HybridWorker(rank, RANKS, num_threads=1)
        worker._ctx = ctx
        worker.build(spec)
        settings = PolicyLossSettings(vocab_size=hf["vocab_size"], temperature=1.0)
        timings: dict[str, list[list[float]]] = {"batch order": [], "balanced": []}
        shares: dict[str, list[float]] = {"batch order": [], "balanced": []}
        for index in range(args.batches + 1):  # batch 0 warms up both ways
            batch = synthetic_batch(args, seed=index, vocab=hf["vocab_size"])
            lengths = row_lengths(batch.response_mask).tolist()
            orders = {
                "batch order": list(range(len(lengths))),
                "balanced": balanced_order(lengths, 1, RANKS, args.samples),
            }
            for way in orders if index % 2 else reversed(list(orders)):
                order = orders[way]
                tokens = [
                    sum(lengths[i] for i in part)
                    for part in (order[: len(order) // 2], order[len(order) // 2 :])
                ]
                shard = split_record(select_rows(batch, order), RANKS)[rank]
                seconds = []
                for _ in range(args.repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    worker.update_on_policy(shard, settings, shard.tokens.shape[0])
                    seconds.append(time.perf_counter() - start)
                if index:
                    timings[way].append(seconds)
                    shares[way].append(max(tokens) / (sum(tokens) / RANKS))
        gathered: list[Any] = [None] * RANKS
        dist.all_gather_object(gathered, timings)
        if rank == 0:
            results.put((gathered, shares))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--median", type=int, default=48, help="median response tokens of a prompt")
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="updates per batch and way (median kept)")
    args = parser.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(free_local_port(), args, results), nprocs=RANKS, start_method="spawn")
    gathered, shares = results.get()
    per_way = {
        way: [
            statistics.median(max(r[way][b][k] for r in gathered) for k in range(args.repeats))
            for b in range(args.batches)
        ]
        for way in gathered[0]
    }
    print(
        f"model {args.model}, {RANKS} single-threaded ranks; {args.prompts} prompts x {args.samples} samples, "
        f"responses median {args.median} tokens (4..{args.max_response}); {args.batches} batches x {args.repeats} updates per way"
    )
    for way, seconds in per_way.items():
        print(
            f"  {way:12s} update {statistics.median(seconds):.3f} s (batches {min(seconds):.3f}-{max(seconds):.3f}); "
            f"heavier rank's tokens / mean {statistics.median(shares[way]):.2f} "
            f"({min(shares[way]):.2f}-{max(shares[way]):.2f})"
        )
    ratios = [a / b for a, b in zip(per_way["batch order"], per_way["balanced"], strict=True)]
    print(
        f"  batch order / balanced: {statistics.median(ratios):.2f}x "
        f"(per batch {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
