"""Activation memory per rank under context parallelism: one policy forward-backward of a 2k-token sequence
at CP1 and CP2 on two gloo ranks (fp32, the local layer spec with our all-gather attention), measured two
ways, next to the planner's prediction (``planner/activations.py``).

- ``saved``: the bytes autograd keeps for backward during the pass (``torch.autograd.graph.saved_tensors_hooks``,
  each storage once, parameters left out): the stored activations, what the planner's ``activations`` term
  counts.
- ``peak``: the most resident memory the pass adds on top of the built engine (``_measure.peak_extra_bytes``,
  the kernel's high-water mark): stored activations plus the largest backward temporaries.

CP1 is DP2 (each rank runs its own 2k-token row); CP2 is one pair splitting each row (each rank runs 1k tokens
of it, chunks r and 3 - r). Both ranks of a variant report; the figures are per rank.

    python bench/bench_context_parallel.py [--seq-length 2048] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import MEASURE_ENV, mib, peak_extra_bytes


def _arch(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from mcore_rl.engine.arch import ModelArch

    return ModelArch.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 2048,
            "hidden_size": args.hidden,
            "intermediate_size": args.hidden * 11 // 4,
            "num_hidden_layers": args.layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": args.seq_length,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
        }
    )


def _saved_bytes(run, parameters: list[torch.Tensor]) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the distinct storages autograd saves for backward during the forward passes of ``run()`` (no
    parameters; what a recompute in backward saves is freed right after it)."""
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        in_backward = torch._C._current_graph_task_id() != -1  # a recompute's inputs live only briefly
        if storage.data_ptr() not in skip and not in_backward:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _worker(rank: int, port: int, cp: int, args: argparse.Namespace, results) -> None:  # type: ignore[no-untyped-def]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)  # ParallelContext joins it
    torch.set_num_threads(1)
    from mcore_rl.engine.model import ModelOptions
    from mcore_rl.engine.optim import OptimConfig
    from mcore_rl.engine.packing.micro_batches import positions
    from mcore_rl.engine.train_engine import TrainEngine
    from mcore_rl.engine.workers.losses import PolicyLossSettings, PolicyMicroBatch, policy_loss
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext
    from mcore_rl.types import TrainBatch

    arch = _arch(args)
    with ParallelContext.initialize(ParallelConfig(context_parallel_size=cp)) as ctx:
        engine = TrainEngine.build(arch, ctx, ModelOptions(), OptimConfig(use_distributed_optimizer=False))
        g = torch.Generator().manual_seed(ctx.dp_rank)
        tokens = torch.randint(1, arch.vocab_size, (1, args.seq_length), generator=g)
        mask = torch.zeros(1, args.seq_length)
        mask[0, 64:] = 1.0  # a 64-token prompt, the rest response
        advantages = torch.randn(1, args.seq_length, generator=g) * mask
        train = TrainBatch(tokens, mask, -3.0 * mask, advantages, -3.0 * mask)
        micro = [PolicyMicroBatch(tokens, positions(tokens), train=train)]
        settings = PolicyLossSettings(vocab_size=arch.vocab_size, temperature=1.0)
        loss = policy_loss(settings, mask.sum() * ctx.dp_size, torch.tensor(float(ctx.dp_size)))

        def step() -> None:
            engine.zero_grad()
            engine.forward_backward(micro, loss)

        step()  # warm-up: buffers, caches, first-call allocations
        saved = _saved_bytes(step, [p for c in engine.chunks for p in c.parameters()])
        peak = peak_extra_bytes(step)
        results.put((cp, rank, saved, peak))


def _planned(args: argparse.Namespace, cp: int, comm: str) -> int:
    """The planner's stored activations of one rank: ``comm`` 'all_gather' is this CPU run's attention
    (fused, every token's K and V kept), 'p2p' TE's ring on GPUs."""
    from mcore_rl.planner.activations import activation_terms
    from mcore_rl.planner.spec import PlanInput

    plan = PlanInput(
        arch=_arch(args),
        gpu="H100-80",
        world_size=2,
        cp=cp,
        seq_length=args.seq_length,
        global_batch_size=2,
        bf16=False,
        cp_comm=comm,
        gpus_per_node=2,
    )
    return activation_terms(plan)["activations"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    os.environ.update(MEASURE_ENV)  # glibc reads it at start: the ranks inherit it
    spawn = mp.get_context("spawn")
    measured: dict[int, list[tuple[int, int]]] = {}
    for cp in (1, 2):
        results = spawn.Queue()
        port = _free_port()
        procs = [spawn.Process(target=_worker, args=(r, port, cp, args, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a CP{cp} rank failed (exit codes {[p.exitcode for p in procs]})")
        rows = sorted(results.get() for _ in procs)
        measured[cp] = [(saved, peak) for _, _, saved, peak in rows]
    print(
        f"one {args.seq_length}-token sequence per DP replica, {args.layers} layers x {args.hidden} wide, "
        "fp32, 2 gloo ranks; per rank:"
    )
    print(f"{'':6}{'saved (r0, r1)':>28}{'peak RSS (r0, r1)':>32}{'planner CPU':>16}{'planner TE':>16}")
    for cp, ranks in measured.items():
        saved = ", ".join(mib(s).strip() for s, _ in ranks)
        peak = ", ".join(mib(p).strip() for _, p in ranks)
        local, te = mib(_planned(args, cp, "all_gather")), mib(_planned(args, cp, "p2p"))
        print(f"CP{cp:<4}{saved:>28}{peak:>32}{local:>16}{te:>16}")
    ratio = [measured[2][r][0] / measured[1][r][0] for r in range(2)]
    planned = _planned(args, 2, "all_gather") / _planned(args, 1, "all_gather")
    print(f"CP2 / CP1 saved: {ratio[0]:.3f}, {ratio[1]:.3f} (planner, all-gather attention: {planned:.3f})")


if __name__ == "__main__":
    main()
