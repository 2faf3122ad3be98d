"""Fused vocab-parallel log-prob + entropy against the naive torch path: fwd+bwd time and peak memory.

Naive path (the baseline, in the same run): ``log_softmax`` + ``gather`` for log p(target) and verl's
``logsumexp(z) - sum softmax(z) * z`` for the entropy, differentiated by autograd. At tp=2 the baseline is the
same maths written vocab-parallel (megatron's max / sum all-reduces, with differentiable collectives), each
rank holding an N x V/2 shard; the ranks are 2 processes with 1 thread each.

Loss: ``sum(g1 * logprob + g2 * entropy)`` with random g1, g2, so both outputs' gradients are exercised.
Times are medians of interleaved repetitions; on a shared machine absolute times are noisy, but the ratios are
taken in the same run under the same load. Peak memory: see _measure.py (fresh process per variant, kernel
high-water mark of resident memory above the inputs). "fwd" is one forward with grad enabled (what autograd
saves included); "fwd+bwd" also holds the [N, V] gradient, an output both paths must produce, listed apart.

    python bench/bench_logprob.py [--tokens 4096] [--vocab 32000] [--reps 5] [--skip-tp] [--skip-linear]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
from _measure import MEASURE_ENV, child_peak, median_seconds, mib, peak_extra_bytes

from mcore_rl.ops import linear_logprob_entropy, native_available, reference, vocab_parallel_logprob_entropy

TEMPERATURE = 0.9
# torch.distributed.nn.functional is deprecated in favour of functional collectives that have no autograd;
# the baseline needs differentiable all-reduces, so keep it and silence the notice.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.nn\.functional", category=FutureWarning)


def _naive_tp(shard: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int, group=None):
    """The unfused vocab-parallel path: [N, V/tp] intermediates, collectives in forward and backward."""
    z = shard[:, : max(0, min(vocab_size - start, shard.shape[1]))].float() / TEMPERATURE
    row_max = z.detach().amax(dim=1)  # a constant shift: it cancels out of every gradient
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - row_max[:, None])
    lse = row_max + torch.log(dist_nn.all_reduce(e.sum(dim=1), group=group))
    local = targets - start
    held = (local >= 0) & (local < z.shape[1])
    z_target = torch.where(held, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
    logprob = dist_nn.all_reduce(z_target, group=group) - lse
    p = e / torch.exp(lse - row_max)[:, None]
    entropy = lse - dist_nn.all_reduce((p * z).sum(dim=1), group=group)
    return logprob, entropy


def _step(variant: str, x: torch.Tensor, d: dict, backward: bool, start: int = 0, group=None) -> None:
    x.grad = None
    if variant == "naive":
        lp, ent = reference.naive_logprob_entropy(
            x, d["targets"], vocab_size=d["vocab"], temperature=TEMPERATURE
        )
    elif variant == "naive_tp":
        lp, ent = _naive_tp(x, d["targets"], start, d["vocab"], group)
    else:
        lp, ent = vocab_parallel_logprob_entropy(
            x, d["targets"], vocab_start=start, vocab_size=d["vocab"], temperature=TEMPERATURE, tp_group=group
        )
    if backward:
        (lp * d["g1"] + ent * d["g2"]).sum().backward()


def _inputs(n: int, vocab: int, width: int, start: int = 0) -> dict:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(n, vocab, generator=gen) * 3
    return {
        "x": full[:, start : start + width].clone().requires_grad_(),
        "targets": torch.randint(0, vocab, (n,), generator=gen),
        "g1": torch.randn(n, generator=gen),
        "g2": torch.randn(n, generator=gen),
        "vocab": vocab,
    }


def _memory(d: dict, variant: str, start: int = 0, group=None) -> dict:
    x = d["x"]
    _step(variant, x, d, backward=True, start=start, group=group)  # warm-up, then free
    x.grad = None
    fwd = peak_extra_bytes(lambda: _step(variant, x, d, backward=False, start=start, group=group))
    x.grad = None
    both = peak_extra_bytes(lambda: _step(variant, x, d, backward=True, start=start, group=group))
    return {"fwd": fwd, "fwd_bwd": both}


def _single(args: argparse.Namespace) -> None:
    d = _inputs(args.tokens, args.vocab, args.vocab)
    steps: dict[str, Callable[[], object]] = {
        v: (lambda v=v: _step(v, d["x"], d, True)) for v in ("naive", "fused")
    }
    times = median_seconds(steps, args.reps)
    # Thread scaling of the kernels alone: the forward (stats pass) allocates nothing large, whereas fwd+bwd
    # is dominated on CPU by the kernel zero-filling the fresh [N, V] gradient's pages.
    forward = {"fused": lambda: _step("fused", d["x"], d, False)}
    threads = {}
    for n in (1, args.threads):
        torch.set_num_threads(n)
        threads[n] = median_seconds(forward, args.reps)["fused"]
    torch.set_num_threads(args.threads)
    grad_bytes = d["x"].numel() * d["x"].element_size()
    print(f"\n== single shard: N={args.tokens}, V={args.vocab}, fp32, {args.threads} threads ==")
    print(f"{'variant':18} {'fwd+bwd':>10} {'speed-up':>9} {'fwd peak extra':>15} {'fwd+bwd peak extra':>19}")
    for v in ("naive", "fused"):
        mem = child_peak(__file__, ["single", v, str(args.tokens), str(args.vocab)])
        print(
            f"{v:18} {times[v] * 1e3:8.0f}ms {times['naive'] / times[v]:8.2f}x {mib(mem['fwd']):>15} "
            f"{mib(mem['fwd_bwd'] - grad_bytes):>19}"
        )
    print(f"(fwd+bwd peak extra excludes the {mib(grad_bytes).strip()} [N, V] gradient both paths return)")
    print(
        f"fused forward: {threads[1] * 1e3:.0f} ms on 1 thread, {threads[args.threads] * 1e3:.0f} ms on "
        f"{args.threads} -> at::parallel_for speed-up {threads[1] / threads[args.threads]:.2f}x"
    )


def _tp_worker(rank: int, init_file: str, args: argparse.Namespace, mode: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    width = args.vocab // 2
    d = _inputs(args.tokens, args.vocab, width, start=rank * width)
    group = dist.group.WORLD
    if mode == "time":
        steps = {
            v: (lambda v=v: _step(v, d["x"], d, True, rank * width, group)) for v in ("naive_tp", "fused")
        }
        result = median_seconds(steps, args.reps)
    else:
        result = _memory(d, mode, rank * width, group)
    out[rank] = result
    dist.destroy_process_group()


def _run_tp(args: argparse.Namespace, mode: str) -> dict:
    """Spawns a fresh 2-rank world (fresh processes, so memory is measured from a clean heap)."""
    saved = dict(os.environ)
    if mode != "time":
        os.environ.update(MEASURE_ENV)  # inherited by the spawned ranks
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = mp.Manager().dict()
            mp.spawn(_tp_worker, args=(os.path.join(tmp, "init"), args, mode, out), nprocs=2, join=True)
            return dict(out)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _tp(args: argparse.Namespace) -> None:
    times = _run_tp(args, "time")
    slowest = {v: max(times[r][v] for r in (0, 1)) for v in ("naive_tp", "fused")}
    grad_bytes = args.tokens * (args.vocab // 2) * 4
    print(f"\n== tp=2: 2 ranks x 1 thread, each N={args.tokens} x V/2={args.vocab // 2}, fp32 (per rank) ==")
    print(f"{'variant':18} {'fwd+bwd':>10} {'speed-up':>9} {'fwd peak extra':>15} {'fwd+bwd peak extra':>19}")
    for v in ("naive_tp", "fused"):
        mem = _run_tp(args, v)
        peak = {k: max(mem[r][k] for r in (0, 1)) for k in ("fwd", "fwd_bwd")}
        print(
            f"{v:18} {slowest[v] * 1e3:8.0f}ms {slowest['naive_tp'] / slowest[v]:8.2f}x {mib(peak['fwd']):>15} "
            f"{mib(peak['fwd_bwd'] - grad_bytes):>19}"
        )


def _linear_step(variant: str, d: dict) -> None:
    d["h"].grad = d["w"].grad = None
    if variant == "naive":
        lp, ent = reference.naive_logprob_entropy(
            d["h"] @ d["w"].T, d["targets"], vocab_size=d["vocab"], temperature=TEMPERATURE
        )
    else:
        lp, ent = linear_logprob_entropy(
            d["h"], d["w"], d["targets"], vocab_start=0, vocab_size=d["vocab"], temperature=TEMPERATURE
        )
    (lp * d["g1"] + ent * d["g2"]).sum().backward()


def _linear_inputs(n: int, hidden: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "h": torch.randn(n, hidden, generator=gen).requires_grad_(),
        "w": (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_(),
        "targets": torch.randint(0, vocab, (n,), generator=gen),
        "g1": torch.randn(n, generator=gen),
        "g2": torch.randn(n, generator=gen),
        "vocab": vocab,
    }


def _linear(args: argparse.Namespace) -> None:
    d = _linear_inputs(args.linear_tokens, args.linear_hidden, args.vocab)
    times = median_seconds(
        {v: (lambda v=v: _linear_step(v, d)) for v in ("naive", "fused")}, max(2, args.reps // 2)
    )
    print(
        f"\n== fused with the output projection: N={args.linear_tokens}, H={args.linear_hidden}, V={args.vocab} =="
    )
    print(f"{'variant':18} {'fwd+bwd':>10} {'speed-up':>9} {'fwd+bwd peak extra':>19}")
    for v in ("naive", "fused"):
        mem = child_peak(
            __file__, ["linear", v, str(args.linear_tokens), str(args.vocab), str(args.linear_hidden)]
        )
        print(f"{v:18} {times[v] * 1e3:8.0f}ms {times['naive'] / times[v]:8.2f}x {mib(mem['fwd_bwd']):>19}")
    print("(peak extra includes the hidden and weight gradients, which both paths return)")


def _child(argv: list[str]) -> None:
    kind, variant, n, vocab = argv[0], argv[1], int(argv[2]), int(argv[3])
    if kind == "single":
        result = _memory(_inputs(n, vocab, vocab), variant)
    else:
        d = _linear_inputs(n, int(argv[4]), vocab)
        _linear_step(variant, d)
        result = {"fwd_bwd": peak_extra_bytes(lambda: _linear_step(variant, d))}
    print(json.dumps(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--linear-tokens", type=int, default=1024)
    parser.add_argument("--linear-hidden", type=int, default=256)
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument("--skip-linear", action="store_true")
    args = parser.parse_args()
    if not native_available():
        print("warning: mcore_rl._C is not built; 'fused' runs the pure-PyTorch reference")
    torch.set_num_threads(args.threads)
    _single(args)
    if not args.skip_tp:
        _tp(args)
    if not args.skip_linear:
        _linear(args)


if __name__ == "__main__":
    main()
