"""The compute limits of the GRPO step (``bench_grpo_step.py``): the matmul FLOPs of each phase and the GEMM
shapes they run at, and the seconds each phase needs at the machine's rates measured in the same run.

Pure arithmetic over the model's shape (``ModelArch``) and the workload, except :class:`GemmRate`, which times
``torch.mm`` at those shapes. ``tests/test_bench_grpo_step_model.py`` checks the figures against each other
and against hand-computed ones.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench._measure import mm_seconds
from bench._rollout_models import model_config
from mcore_rl.engine.arch import ModelArch

WORKLOADS: dict[str, dict[str, Any]] = {
    # issue 17's model is the rollout bench's tiny one with full multi-head attention
    "tiny": {"hf_config": model_config("tiny", kv_heads=8), "n": 4, "new_tokens": 32},
    "realistic": {"hf_config": model_config("realistic"), "n": 8, "new_tokens": 128},
}
"""``--model`` -> the HF config both sides build, and the defaults of ``--n`` and ``--new-tokens``."""
ADAM_BYTES_PER_PARAM = 7 * 4
"""fp32 Adam reads the parameter, its gradient and both moments and writes the parameter and both moments."""
Gemm = tuple[int, int, int, int]
"""(rows, inner, cols, count): ``count`` products of a ``[rows, inner]`` by an ``[inner, cols]`` matrix."""


def linear_shapes(arch: ModelArch) -> list[tuple[int, int]]:
    """(in, out) of one layer's linear layers: fused QKV (K and V over the KV heads only), the attention
    output, fused gate + up, down."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    h, f = arch.hidden_size, arch.ffn_hidden_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)]


def param_count(arch: ModelArch) -> int:
    """Parameters of the (Llama-style, bias-free) model: linear layers, two RMSNorms per layer and the final
    one, the embedding and, untied, the LM head."""
    per_layer = sum(k * c for k, c in linear_shapes(arch)) + 2 * arch.hidden_size
    embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return arch.num_layers * per_layer + embeddings + arch.hidden_size


def step_flops(arch: ModelArch, n: int, prompt: int, new: int, samples: int = 1) -> dict[str, float]:
    """Matmul FLOPs of each phase of one step over ``n`` sequences (``samples`` per prompt): linear layers,
    causal attention (QK^T + AV over the query heads), the LM head where it runs. Generation as the engine
    runs it: each prompt prefilled once (the head at its last position only: the first new token), its KV
    rows copied to its samples, then ``new - 1`` decode steps of every sample over a growing KV length
    (``generate_prefill`` + ``generate_decode``). ``*_shared``: what the training passes compute with each
    prompt once per group (``model.share_prompt_prefix``)."""
    per_token = 2 * arch.num_layers * sum(k * c for k, c in linear_shapes(arch))
    q, seq = arch.num_attention_heads * arch.head_dim, prompt + new

    def attention(length: int) -> float:  # causal: sum over positions of 2 x 2 x t x q per layer
        return 4.0 * arch.num_layers * q * length * (length + 1) / 2

    head = 2 * arch.hidden_size * arch.vocab_size
    steps = new - 1  # the decode step at KV length prompt + i reads i - 1 tokens sampled before it
    prefill = (n // samples) * (prompt * per_token + attention(prompt) + head)
    decode = n * (steps * (per_token + head) + 4.0 * arch.num_layers * q * (steps * prompt + steps * new / 2))
    forward = n * (seq * per_token + attention(seq) + new * head)  # head only at response positions
    shared = forward - (n - n // samples) * prompt * per_token  # the linears skip the prompt copies
    return {
        "generate": prefill + decode,
        "generate_prefill": prefill,
        "generate_decode": decode,
        "log_probs": forward,
        "update": 3 * forward,  # forward + input gradients + weight gradients
        "log_probs_shared": shared,
        "update_shared": 3 * shared,
    }


def gemm_shapes(arch: ModelArch, n: int, prompt: int, new: int) -> dict[str, list[Gemm]]:
    """The step's GEMMs per pass: ``decode``, one decode step of ``n`` rows (each layer's linears and the
    head); ``train``, the forward (x @ W), input-gradient (g @ W^T) and weight-gradient (x^T @ g) GEMMs over
    the ``n * (prompt + new)`` training tokens, the head's over the ``n * new`` response tokens."""
    layers, h, vocab = arch.num_layers, arch.hidden_size, arch.vocab_size
    tokens, responses = n * (prompt + new), n * new
    linears = linear_shapes(arch)
    decode = [(n, k, c, layers) for k, c in linears] + [(n, h, vocab, 1)]
    forward = [(tokens, k, c, layers) for k, c in linears] + [(responses, h, vocab, 1)]
    input_grad = [(m, c, k, count) for m, k, c, count in forward]
    weight_grad = [(k, m, c, count) for m, k, c, count in forward]
    return {"decode": decode, "train": forward + input_grad + weight_grad}


def rollout_gemm_shapes(arch: ModelArch, prompts: int, prompt: int, sequences: int) -> dict[str, list[Gemm]]:
    """A rollout's GEMMs as the engine runs them: ``prefill``, the ``prompts`` prompts' linears over all their
    tokens and the head at each one's last token; ``decode``, one decode step of ``sequences`` rows."""
    layers, h, vocab = arch.num_layers, arch.hidden_size, arch.vocab_size
    prefill = [(prompts * prompt, k, c, layers) for k, c in linear_shapes(arch)] + [(prompts, h, vocab, 1)]
    return {"prefill": prefill, "decode": gemm_shapes(arch, sequences, prompt, 0)["decode"]}


def rollout_limit(flops: dict[str, float], gflops: dict[str, float]) -> float:
    """Seconds a rollout (:func:`step_flops`' ``generate_*``) needs at the rates of
    :func:`rollout_gemm_shapes`' GEMMs."""
    return flops["generate_prefill"] / (gflops["prefill"] * 1e9) + flops["generate_decode"] / (
        gflops["decode"] * 1e9
    )


def gemm_flops(gemms: list[Gemm]) -> float:
    return float(sum(2 * m * k * c * count for m, k, c, count in gemms))


def phase_limits(
    flops: dict[str, float], gflops: dict[str, float], copy_bytes_per_s: float, params: int, sync_bytes: int
) -> dict[str, float]:
    """Seconds each phase needs at the machine's rates: compute-bound ones at ``torch.mm``'s GFLOP/s at their
    shapes, memory-bound ones at the copy bandwidth (a copy reads and writes each byte: 2 bytes of traffic
    per byte copied, which Adam's reads and writes are counted in)."""
    prefill = flops.get("generate_prefill", 0.0)  # the prompts' GEMMs are training-sized
    return {
        "sync": sync_bytes / copy_bytes_per_s,
        "generate": prefill / (gflops["train"] * 1e9)
        + (flops["generate"] - prefill) / (gflops["decode"] * 1e9),
        "log_probs": flops["log_probs"] / (gflops["train"] * 1e9),
        "update": flops["update"] / (gflops["train"] * 1e9),
        "optimizer": params * ADAM_BYTES_PER_PARAM / (2 * copy_bytes_per_s),
    }


class GemmRate:
    """The machine's GEMM rate at the step's shapes, timed once per round beside the steps (each distinct
    shape by itself, weighted by how often a pass runs it): the limit uses the best round (the fastest this
    machine ran those GEMMs in this run), so a noisy moment cannot make the limit look easy to reach."""

    def __init__(self, shapes: dict[str, list[Gemm]]) -> None:
        self.shapes = shapes
        self.best = {kind: 0.0 for kind in shapes}

    def step(self, prompts: torch.Tensor | None = None, seed: int = 0) -> dict[str, float]:
        """One probe of every shape (the signature of a bench side's step, which it runs beside)."""
        start = time.perf_counter()
        for kind, gemms in self.shapes.items():
            # small GEMMs take more repeats: a few tenths of a millisecond are noisy
            seconds = sum(
                count * mm_seconds(m, k, c, reps=3 if m * k * c > 5e8 else 15) for m, k, c, count in gemms
            )
            self.best[kind] = max(self.best[kind], gemm_flops(gemms) / seconds / 1e9)
        return {"step": time.perf_counter() - start}
