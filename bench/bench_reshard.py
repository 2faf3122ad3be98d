"""Train -> rollout weight resharding: our zero-redundancy plan vs the naive gather-everything baseline.

Baseline (what verl's per-tensor path does): for every parameter, all-gather the TP shards of its owning
stage, broadcast the full tensor to every rank, and let each rank slice its rollout shard out of it. Every
rank materialises every full tensor once and receives (nearly) the whole model.

Ours: ``build_plan`` once, then ``execute_plan``: each rank receives exactly the part of its rollout shard it
does not already hold.

Both run in the same processes on the same shards (gloo, CPU). Printed per layout: wall time, bytes received
per rank (max over ranks), and peak extra bytes alive during the transfer (max over ranks; the rollout shards
themselves are the output of both and not counted), with baseline/ours ratios. Ours sends messages of at most
``--bucket-mib`` and holds at most ``--inflight-mib`` of them at once per rank (default twice the bucket); the
baseline holds one full tensor plus its TP shards. Ratios read "n/a" where ours moved or held nothing.

    python bench/bench_reshard.py [--world 4] [--hidden 512] [--layers 8] [--bucket-mib 4] [--inflight-mib 8]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcore_rl.parallel.launch_env import free_local_port
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.parallel.reshard import build_plan, model_param_specs, padded_rows
from mcore_rl.parallel.reshard.executor import execute_plan
from mcore_rl.parallel.reshard.planner import owner_stages
from mcore_rl.parallel.sharding import ShardKind, tp_shard


def _specs(args: argparse.Namespace) -> list:
    return model_param_specs(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        ffn_hidden_size=args.hidden * 8 // 3 // 64 * 64,
        num_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_query_groups=4,
        head_dim=64,
        qkv_bias=False,
        tie_word_embeddings=False,
    )


def _stage(spec, train: ParallelLayout, num_layers: int) -> int:
    return min(owner_stages(spec, train, num_layers, tied=False))


def _naive(
    specs, train: ParallelLayout, local: dict, tp_g: int, coord: int, num_layers: int
) -> tuple[float, int, int]:
    """Gather each full tensor on every rank, then slice. Returns (seconds, bytes received, peak extra bytes)."""
    rank = dist.get_rank()
    me = train.coords(rank)
    received = peak = 0
    start = time.perf_counter()
    for spec in specs:
        stage = _stage(spec, train, num_layers)
        shard_shape = tp_shard(
            torch.empty(spec.shape), spec.kind, 0, train.tp, padded_rows(spec, train.tp)
        ).shape
        shards = [torch.empty(shard_shape) for _ in range(train.tp)]
        if me.pp == stage and spec.kind is not ShardKind.REPLICATED:
            dist.all_gather(shards, local[spec.name], group=_tp_group(train, rank))
        full = torch.empty(spec.shape)
        if me.pp == stage and me.dp == 0 and me.tp == 0:
            from mcore_rl.parallel.sharding import tp_merge

            full = (
                local[spec.name]
                if spec.kind is ShardKind.REPLICATED
                else tp_merge(shards, spec.kind, spec.shape[0])
            )
        src = train.rank(type(me)(tp=0, dp=0, pp=stage))
        dist.broadcast(full, src=src)
        received += full.numel() * 4 * (rank != src)
        peak = max(peak, (full.numel() + sum(s.numel() for s in shards)) * 4)
        tp_shard(full, spec.kind, coord, tp_g, padded_rows(spec, tp_g)).clone()
        del full, shards
    return time.perf_counter() - start, received, peak


_GROUPS: dict = {}


def _tp_group(train: ParallelLayout, rank: int):
    key = tuple(train.group_of(train.tp_groups(), rank))
    return _GROUPS[key]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    specs = _specs(args)
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    for tp, pp in args.layouts:
        train = ParallelLayout(world, tp=tp, pp=pp)
        for group in train.tp_groups():  # every rank must create every group, in the same order
            _GROUPS[tuple(group)] = dist.new_group(group)
        me = train.coords(rank)
        local = {
            s.name: tp_shard(full[s.name], s.kind, me.tp, tp, padded_rows(s, tp)).clone()
            for s in specs
            if _stage(s, train, args.layers) == me.pp
        }
        for tp_g in args.rollout_tps:
            plan = build_plan(specs, train, tp_g, num_layers=args.layers, tied_embeddings=False)
            dist.barrier()
            _, ours = execute_plan(
                plan,
                local,
                bucket_bytes=int(args.bucket_mib * 2**20),
                max_inflight_bytes=int(args.inflight_mib * 2**20),
            )
            dist.barrier()
            naive_s, naive_bytes, naive_peak = _naive(
                specs, train, local, tp_g, plan.rollout_coords[rank][0], args.layers
            )
            row = (
                tp,
                pp,
                tp_g,
                ours.seconds,
                ours.bytes_received,
                ours.peak_buffer_bytes,
                naive_s,
                naive_bytes,
                naive_peak,
            )
            gathered = [None] * world
            dist.all_gather_object(gathered, row)
            if rank == 0:
                results.put(gathered)
    dist.destroy_process_group()


def _ratio(baseline: float, ours: float) -> str:
    """baseline / ours, or "n/a" when ours is zero (nothing to receive or hold: no meaningful ratio)."""
    return f"{baseline / ours:5.1f}x" if ours else "  n/a "


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=float, default=4.0, help="largest p2p message of ours (MiB)")
    parser.add_argument(
        "--inflight-mib",
        type=float,
        default=None,
        help="most message bytes a rank of ours holds at once (MiB; default twice --bucket-mib)",
    )
    args = parser.parse_args()
    if args.inflight_mib is None:
        args.inflight_mib = 2 * args.bucket_mib
    if args.hidden < 256 or args.hidden % 256:
        parser.error(
            "--hidden must be a multiple of 256 (4 query groups of 64-dim heads split over TP up to 4)"
        )
    args.layouts = [(2, 2), (1, 4), (4, 1)] if args.world == 4 else [(args.world, 1)]
    deepest = max(pp for _, pp in args.layouts)
    if args.layers % deepest:
        parser.error(f"--layers must be a multiple of {deepest} (the deepest pipeline benchmarked)")
    args.rollout_tps = [1, 2, 4] if args.world >= 4 else [1, args.world]
    port = free_local_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, results)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    mib = 2**20
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, world {args.world}; "
        f"ours: bucket {args.bucket_mib:g} MiB, in flight <= {args.inflight_mib:g} MiB"
    )
    print(
        f"{'train tp,pp':>11} {'tp_g':>4} | {'ours s':>7} {'naive s':>7} {'speedup':>7} | {'recv MiB ours':>13} "
        f"{'naive':>7} {'ratio':>6} | {'peak MiB ours':>13} {'naive':>7} {'ratio':>6}"
    )
    for _ in range(len(args.layouts) * len(args.rollout_tps)):
        rows = results.get(timeout=1800)
        tp, pp, tp_g = rows[0][:3]
        ours_s, naive_s = max(r[3] for r in rows), max(r[6] for r in rows)
        ours_b, naive_b = max(r[4] for r in rows), max(r[7] for r in rows)
        ours_p, naive_p = max(r[5] for r in rows), max(r[8] for r in rows)
        print(
            f"{tp:>5},{pp:<5} {tp_g:>4} | {ours_s:7.3f} {naive_s:7.3f} {_ratio(naive_s, ours_s):>7} | "
            f"{ours_b / mib:13.1f} {naive_b / mib:7.1f} {_ratio(naive_b, ours_b):>6} | "
            f"{ours_p / mib:13.1f} {naive_p / mib:7.1f} {_ratio(naive_p, ours_p):>6}"
        )
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
