"""Checkpoint conversion on a random ~1B Llama: peak resident memory and wall time, both directions.

The HF input is written by a child of this script (random bf16 weights, sharded safetensors with an
index, no transformers needed). Every measured command runs in a fresh subprocess; its peak resident
memory is the kernel's ``ru_maxrss`` of that one child (``os.wait4``, i.e. RUSAGE_CHILDREN for a single
child), its time the parent's wall clock. The parent imports neither torch nor mcore_rl: Linux carries a
forked child's high-water mark across ``exec``, so a large parent would inflate every child's figure.
Baselines from the same run:

- floors: ``import torch`` (mcore-to-hf needs no more) and ``import torch, megatron.core`` (hf-to-mcore
  joins a process group through megatron): what the converters hold before touching a weight;
- ``load every HF tensor``: every HF tensor read into one dict (copied out of safetensors' memory map, as converting
  does): the least a non-streaming converter holds.

The converted model is checked bit-exact against the input, tensor by tensor.

    python bench/bench_convert.py [--hidden 2048 --layers 16 --ffn 5632 --vocab 32000] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

TORCH, MEGATRON = "floor: import torch", "floor: import torch, megatron.core"
LOAD_ALL = "baseline: load every HF tensor"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_BYTES = 500 * 10**6


def hf_config(args: argparse.Namespace) -> dict:
    heads = args.hidden // 128
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 128,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def write_random_hf(directory: str, config: dict) -> None:
    """(child) A random bf16 HF folder, streamed: one tensor in memory at a time."""
    import torch

    from mcore_rl.engine.arch import ModelArch
    from mcore_rl.engine.hf.mapping import hf_shapes, tensor_maps
    from mcore_rl.engine.hf.safetensors_io import OutputTensor, StreamingShardWriter

    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    arch = ModelArch.from_hf_config(config)
    plan = [
        OutputTensor(name, shape, torch.bfloat16)
        for m in tensor_maps(arch)
        for name, shape in zip(m.hf_names, hf_shapes(arch, m), strict=True)
    ]
    writer = StreamingShardWriter(directory, plan, SHARD_BYTES)
    generator = torch.Generator().manual_seed(0)
    for t in plan:
        writer.add(t.name, (torch.randn(t.shape, generator=generator) * 0.02).to(torch.bfloat16))
    writer.finish()


def measure(command: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process; fails loudly if it fails."""
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = child.stdout.read() if child.stdout else b""
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output.decode()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports KiB


def load_all_command(hf_dir: str) -> list[str]:
    code = (
        "import os, sys; from safetensors.torch import load_file; d = sys.argv[1]; "
        "state = {}; [state.update({k: v.clone() for k, v in load_file(os.path.join(d, f)).items()}) "
        "for f in sorted(os.listdir(d)) if f.endswith('.safetensors')]; print(len(state))"
    )
    return [sys.executable, "-c", code, hf_dir]


def bit_exact(a_dir: str, b_dir: str) -> None:
    """(child) Prints whether two HF folders hold identical tensors, comparing one tensor at a time."""
    import torch

    from mcore_rl.engine.hf.safetensors_io import SafetensorsReader

    a, b = SafetensorsReader(a_dir), SafetensorsReader(b_dir)
    same = sorted(a.infos) == sorted(b.infos) and all(torch.equal(a.get(n), b.get(n)) for n in a.infos)
    weight_bytes = sum(os.path.getsize(os.path.join(a_dir, f)) for f in {i.file for i in a.infos.values()})
    print(json.dumps({"bit_exact": same, "weight_bytes": weight_bytes}))


def run_child(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def run_all(args: argparse.Namespace, workdir: str) -> tuple[dict[str, tuple[float, int]], dict]:
    """Write the model, measure baselines and both directions, check the round trip."""
    hf, ckpt, back = (os.path.join(workdir, n) for n in ("hf", "ckpt", "back"))
    sizes = [f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "ffn", "vocab")]
    run_child([*sizes, "--child", "write", hf])
    convert = [sys.executable, "-m", "mcore_rl.convert"]
    runs = {
        TORCH: measure([sys.executable, "-c", "import torch"]),
        MEGATRON: measure([sys.executable, "-c", "import torch, megatron.core"]),
        LOAD_ALL: measure(load_all_command(hf)),
        "hf-to-mcore": measure([*convert, "hf-to-mcore", "--hf-dir", hf, "--out", ckpt]),
        "mcore-to-hf": measure(
            [*convert, "mcore-to-hf", "--ckpt", ckpt, "--out", back, "--max-shard-size=500MB"]
        ),
    }
    return runs, json.loads(run_child(["--child", "compare", hf, back]))


def report(args: argparse.Namespace, runs: dict[str, tuple[float, int]], check: dict) -> None:
    # The floor of each converter: hf-to-mcore joins a (gloo) world through megatron; mcore-to-hf needs torch.
    floors = {"hf-to-mcore": runs[MEGATRON][1], "mcore-to-hf": runs[TORCH][1]}
    load_all = runs[LOAD_ALL][1]
    largest = 2 * args.vocab * args.hidden
    print(
        f"model: {check['weight_bytes'] / 1e9:.2f} GB of bf16 safetensors (~{check['weight_bytes'] / 2e9:.2f} B "
        f"params), {args.layers} layers; largest tensor {largest / 2**20:.0f} MiB (embedding)"
    )
    print(
        f"{'run':38s} {'wall s':>7s} {'peak RSS':>10s} {'above floor':>12s} {'/ largest':>10s} {'vs load-all':>12s}"
    )
    for name, (seconds, peak) in runs.items():
        above = peak - floors[name] if name in floors else None
        extra = f"{above / 2**20:8.0f} MiB {above / largest:9.2f}x" if above is not None else " " * 23
        print(f"{name:38s} {seconds:7.1f} {peak / 2**20:6.0f} MiB {extra} {peak / load_all:11.2f}x")
    print(f"round trip HF -> mcore -> HF bit-exact: {check['bit_exact']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workdir", default=None, help="where to write the three model copies")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # the helpers that must not run in this (small) parent process
        if args.child[0] == "write":
            write_random_hf(args.child[1], hf_config(args))
        else:
            bit_exact(args.child[1], args.child[2])
        return
    workdir = tempfile.mkdtemp(prefix="bench_convert_", dir=args.workdir)
    try:
        runs, check = run_all(args, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report(args, runs, check)


if __name__ == "__main__":
    main()
