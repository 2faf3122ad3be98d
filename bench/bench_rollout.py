"""Rollout throughput: our embedded engine vs ``transformers`` ``generate`` on the same tiny Llama, same batch.

Both sample at temperature 1 with no top-k/top-p and no EOS, so both produce exactly
``batch * n * new_tokens`` tokens; the same weights are loaded into both. Runs alternate (HF, ours, HF, ...)
so that load from other processes hits both alike; the report gives medians and the min-max spread of tok/s
(wall clock) and the ratio of the medians.

    python bench/bench_rollout.py [--batch 16] [--n 1] [--prompt-len 32] [--new-tokens 128] [--threads 1]
    python bench/bench_rollout.py --grid [--kv-heads 8]   # the issue-17 table, under ~5 minutes

``--n`` samples per prompt (RL's group sampling): HF repeats each prompt ``n`` times (``num_return_sequences``);
ours prefills each prompt once and copies its KV cache rows. ``--grid`` varies one setting at a time around
batch 32 (8 prompts x 4 samples), 64 new tokens: batch 8/32/128 sequences, 16/64/256 new tokens, 1 and 2
threads; ``--kv-heads 8`` is issue 17's MHA model (the default keeps GQA with 4 KV heads). To compare two
versions of the engine, run the same command with ``PYTHONPATH`` pointing at each source tree (from a
directory outside both), back to back.

Measured 2026-11-30 on the 2-core CI machine (AVX-512), ``--grid --grid-threads 1 --kv-heads 8``, ours / HF:
2.74x at 8 sequences, 2.49x at 32, 2.13x at 128 (64 new tokens); 2.40x at 16 new tokens, 2.85x at 256
(32 sequences); the engine before the decode-step rework (packed AVX2 panels, per-call cache) gave 1.43-2.00x
in the same cells. ``--grid --grid-threads 2 --kv-heads 8`` (quiet, session 5, after the one-rank gather fix):
3.37x at 8 sequences, 2.52x at 32, 2.46x at 128 (64 new tokens); 2.46x at 16 new tokens, 2.74x at 256
(32 sequences). Session 6 (decode layers in one native call, one-kernel sampling, the rollout outside
megatron's CPU mode, independent FMA chains in decode attention), quiet: 2 threads 3.90x at 8 sequences,
2.96x at 32, 2.80x at 128; 2.72x at 16 new tokens, 3.34x at 256; 1 thread 3.11x, 2.84x, 2.39x; 2.69x, 3.18x.
Session 8 (decode steps on MKL-packed weights with 2+ threads, each engine built under its cell's thread
count): 2 threads 3.94x at 8 sequences, 3.38x at 32, 2.90x at 128; 2.73x at 16 new tokens, 3.43x at 256;
1 thread 3.08x, 2.83x, 2.33x; 2.66x, 3.09x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import LocalRolloutEngine, SamplingParams, rollout_param_shapes

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
}


def hf_to_rollout(model: torch.nn.Module, arch: ModelArch) -> dict[str, torch.Tensor]:
    """HF Llama weights -> our rollout layout at TP1 (fused qkv / gate_up, vocab rows padded)."""
    sd = {k.removeprefix("model."): v.detach() for k, v in model.state_dict().items()}
    shapes = rollout_param_shapes(arch, 1)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            out[name] = torch.cat([sd[base + f"{p}_proj.weight"] for p in "qkv"])
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            out[name] = torch.cat([sd[base + "gate_proj.weight"], sd[base + "up_proj.weight"]])
        else:
            out[name] = sd[name]
        if out[name].shape != shape:  # vocab padding rows
            out[name] = torch.cat([out[name], out[name].new_zeros(shape[0] - out[name].shape[0], shape[1])])
    return out


@dataclass(frozen=True)
class Cell:
    """One measured setting."""

    prompts: int
    n: int
    new_tokens: int
    threads: int

    @property
    def tokens(self) -> int:
        return self.prompts * self.n * self.new_tokens


# --grid: one setting varied at a time around 8 prompts x 4 samples, 64 new tokens, so the whole table stays
# under ~5 minutes on two cores (the full 3 x 3 x 2 product would take ~4x longer).
def grid(threads: list[int]) -> list[Cell]:
    return [
        Cell(prompts, 4, new, t)
        for t in threads
        for prompts, new in ((2, 64), (8, 64), (32, 64), (8, 16), (8, 256))
    ]


class Bench:
    """The two engines on one model, and a timed, interleaved comparison of one cell."""

    def __init__(self, hidden: int, kv_heads: int, prompt_len: int) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = {
            **HF_CONFIG,
            "hidden_size": hidden,
            "intermediate_size": hidden * 688 // 256,
            "num_key_value_heads": kv_heads,
        }
        hf_config = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
        self.arch = ModelArch.from_hf_config(config)
        self.engine, self.engine_threads = self._engine(), torch.get_num_threads()
        self.prompt_len = prompt_len

    def _engine(self) -> LocalRolloutEngine:
        """Ours with the HF model's weights, built under the current thread count as a worker builds it (the
        decoder lays its weights out for how decode steps multiply with that many threads)."""
        engine = LocalRolloutEngine(self.arch)
        engine.load_weights(hf_to_rollout(self.model, self.arch).items())
        return engine

    def greedy_agrees(self) -> bool:
        """Same weights, same function: greedy continuations must agree (a sanity check, not timed)."""
        prompts = torch.randint(0, self.arch.vocab_size, (2, self.prompt_len))
        ours = self.engine.generate(prompts.tolist(), SamplingParams(temperature=0.0, max_new_tokens=8))
        hf = self.hf_generate(prompts, new_tokens=8, n=1, sample=False)
        return bool((hf[:, self.prompt_len :] == ours.token_ids).all())

    def hf_generate(self, prompts: torch.Tensor, new_tokens: int, n: int, sample: bool) -> torch.Tensor:
        """HF ``generate`` of exactly ``new_tokens`` per sequence (no EOS): greedy, or plain sampling at
        temperature 1 (no top-k/top-p), ``n`` sequences per prompt."""
        sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}
        with torch.inference_mode():
            return self.model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=sample,
                **sampling,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                num_return_sequences=n,
                eos_token_id=None,
                pad_token_id=0,
            )

    def measure(self, cell: Cell, repeats: int) -> dict[str, list[float]]:
        """tok/s of each side over ``repeats`` interleaved runs (after one warm-up each)."""
        torch.set_num_threads(cell.threads)
        if self.engine_threads != cell.threads:
            self.engine, self.engine_threads = self._engine(), cell.threads
        prompts = torch.randint(0, self.arch.vocab_size, (cell.prompts, self.prompt_len))
        params = SamplingParams(temperature=1.0, n=cell.n, max_new_tokens=cell.new_tokens, seed=0)

        def run_hf() -> None:
            out = self.hf_generate(prompts, cell.new_tokens, cell.n, sample=True)
            assert out.shape == (cell.prompts * cell.n, self.prompt_len + cell.new_tokens)

        def run_ours() -> None:
            out = self.engine.generate(prompts.tolist(), params)
            assert int(out.lengths.sum()) == cell.tokens

        sides = {"hf": run_hf, "ours": run_ours}
        for fn in sides.values():
            fn()
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeats):
            for name, fn in sides.items():
                start = time.perf_counter()
                fn()
                rates[name].append(cell.tokens / (time.perf_counter() - start))
        return rates


def _row(cell: Cell, rates: dict[str, list[float]]) -> str:
    hf, ours = statistics.median(rates["hf"]), statistics.median(rates["ours"])
    spread = "  ".join(f"{min(rates[k]):6.0f}-{max(rates[k]):<6.0f}" for k in ("hf", "ours"))
    return (
        f"{cell.prompts * cell.n:5d} {cell.new_tokens:5d} {cell.threads:3d} | {hf:8.0f} {ours:8.0f} "
        f"{ours / hf:6.2f}x | {spread}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="prompts")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (MLP width scales with it)")
    parser.add_argument("--kv-heads", type=int, default=HF_CONFIG["num_key_value_heads"])
    parser.add_argument("--grid", action="store_true", help="the issue-17 table (prompt length 16)")
    parser.add_argument(
        "--grid-threads",
        default="1,2",
        help="thread counts of --grid; drop 2 on a machine where another job holds a core (each op then "
        "waits for the descheduled OpenMP thread, and both sides' runs take minutes)",
    )
    args = parser.parse_args()
    if args.grid:
        args.prompt_len, args.repeats = 16, min(args.repeats, 3)
    if args.grid:
        cells = grid([int(t) for t in args.grid_threads.split(",")])
    else:
        cells = [Cell(args.batch, args.n, args.new_tokens, args.threads)]
    bench = Bench(args.hidden, args.kv_heads, args.prompt_len)
    arch = bench.arch
    print(
        f"model: hidden {arch.hidden_size}, {arch.num_layers} layers, {arch.num_attention_heads} heads / "
        f"{arch.num_query_groups} kv, vocab {arch.vocab_size}, fp32; prompt {args.prompt_len} tokens, "
        f"temperature 1, {args.repeats} interleaved runs per cell; greedy outputs agree with HF: "
        f"{bench.greedy_agrees()}"
    )
    print("  seq   new thr |  HF tok/s  ours tok/s ratio | spread HF        spread ours")
    for cell in cells:
        print(_row(cell, bench.measure(cell, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
