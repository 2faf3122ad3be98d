"""Training-state bytes per rank with and without LoRA on the CPU demo recipe, next to the planner.

Builds the demo's actor (``recipes/demo_cpu.yaml``: fp32, one rank) twice, as a full fine-tune and with the
LoRA demo's adapters (``recipes/demo_lora_cpu.yaml``: rank 8, all-linear), runs one optimizer step (Adam makes
its moments on the first), and reports the tensor bytes the engine holds (``planner/selfcheck.py``'s
``measure_engine``: weights, DDP gradient buffers, optimizer state) beside ``mcore-rl plan``'s figures for the
same config; then the reference policy (``TrainEngine.frozen_copy``): the bytes of the weights it holds that the
actor does not share (a full copy without LoRA, none with it). ``--recipe``/overrides plan another config
(world size 1).

    python bench/bench_lora_memory.py [--recipe recipes/demo_cpu.yaml] [--rank 8] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reference_bytes(engine: Any) -> int:
    """Bytes of the reference policy's weights that are not the actor's own storage."""
    reference = engine.frozen_copy()
    mine = {p.untyped_storage().data_ptr() for m in engine.models for p in m.parameters()}
    theirs = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for m in reference.models
        for p in m.parameters()
    }
    return sum(size for ptr, size in theirs.items() if ptr not in mine)


def measure(cfg: Any) -> dict[str, int]:
    """Collective (world 1 here): build the actor as ``cfg`` says, step once, measure."""
    from mcore_rl.engine.model import ModelOptions
    from mcore_rl.engine.optim import OptimConfig
    from mcore_rl.engine.train_engine import TrainEngine
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.context import ParallelContext
    from mcore_rl.planner.selfcheck import measure_engine

    options = ModelOptions(dtype=getattr(torch, cfg.model.dtype), lora=cfg.model.lora_spec())
    optim = OptimConfig(weight_decay=0.0, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(cfg.model.arch(), ctx, options, optim)
        engine.zero_grad()
        engine.step()
        got = measure_engine(engine)
        trainable = sum(p.numel() for m in engine.models for p in m.parameters() if p.requires_grad)
        return {
            "params": got.params,
            "trainable": trainable,
            "weights": got.weights_bytes,
            "gradients": got.grads_bytes,
            "optimizer": got.optimizer_bytes,
            "reference": _reference_bytes(engine),
        }


def planned(cfg: Any) -> dict[str, int]:
    from mcore_rl.planner import plan_memory
    from mcore_rl.planner.from_config import plan_input_from_config

    plan = plan_input_from_config(cfg, gpu="A100-80").with_layout(reference=True)
    result = plan_memory(plan)
    terms = result.train.terms
    return {
        "params": result.actor.params,
        "weights": terms["weights"],
        "gradients": terms["gradients"],
        "optimizer": terms["optimizer"],
        "reference": terms.get("reference weights", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/demo_cpu.yaml")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    from mcore_rl.config import load_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)  # ParallelContext joins it
    lora = [f"model.lora_rank={args.rank}", f"model.lora_alpha={2 * args.rank}"]
    rows = {}
    for name, extra in (("full fine-tune", []), (f"LoRA r={args.rank}", lora)):
        cfg = load_config(args.recipe, [*args.overrides, *extra])
        rows[name] = (measure(cfg), planned(cfg))
    print(f"{args.recipe} ({cfg.model.dtype}, 1 rank), tensor bytes after one optimizer step:")
    print(
        f"{'':16}{'trainable':>11}" + "".join(f"{k + ' (plan)':>24}" for k in ("weights", "gradients")),
        end="",
    )
    print("".join(f"{k + ' (plan)':>24}" for k in ("optimizer", "reference")))
    for name, (got, plan) in rows.items():
        cells = "".join(f"{got[k]:>12,} ({plan[k]:>9,})" for k in ("weights", "gradients", "optimizer"))
        print(f"{name:16}{got['trainable']:>11,}{cells}{got['reference']:>12,} ({plan['reference']:>9,})")
    (full, _), (lora_got, _) = rows.values()
    for key in ("gradients", "optimizer", "reference"):
        print(f"LoRA / full {key}: {lora_got[key] / full[key]:.3f}")


if __name__ == "__main__":
    main()
