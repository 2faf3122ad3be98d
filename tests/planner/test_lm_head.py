"""The planner's ``LM head`` term (``planner/activations.py``) against a hand count, and against what the real
head allocates: ``engine/lm_head.py`` running the fused ``ops.logprob.linear_logprob_entropy`` forward and
backward on CPU, every tensor its ops return tracked until it is freed."""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mcore_rl.engine.lm_head import LMHeadInput
from mcore_rl.ops.logprob import DEFAULT_VOCAB_CHUNK
from mcore_rl.parallel.layout import padded_vocab_size
from mcore_rl.planner import PlanError, PlanInput
from mcore_rl.planner.activations import lm_head_bytes
from tests.models import tiny_arch

PER_TOKEN_BYTES = 48
"""What the term leaves out, per token: the head's labels, log-probs, entropy, saved (lse, H) and incoming
gradients (measured: 40 B in bf16, 44 in fp32), under the smallest buffer it counts (``e n h``, >= 128 B)."""


def _plan(tokens: int, hidden: int, vocab: int, bf16: bool, lora_rank: int = 0, keep: int = 0) -> PlanInput:
    arch = tiny_arch("llama", vocab_size=vocab, hidden_size=hidden, max_position_embeddings=tokens)
    return PlanInput(
        arch=arch,
        gpu="A100-80",
        world_size=1,
        seq_length=tokens,
        global_batch_size=1,
        bf16=bf16,
        lora_rank=lora_rank,
        keep_logits_bytes=keep,
    )


def test_the_term_counts_the_fused_ops_backward_buffers_by_hand():
    # n = 512 tokens, h = 128, vocab 10,000 padded to 10,112 rows, vocab chunks of c = 4096 columns.
    n, h, c = 512, 128, 4096
    assert c == DEFAULT_VOCAB_CHUNK
    saved, grad_fp32, blocks = 2 * n * h, 4 * n * h, 2 * 2 * n * c  # bf16 hidden rows, fp32 grad, two blocks
    # bf16, trainable head: + its weight gradient and the [c, h] weight-gradient block (c > n)
    trainable = lm_head_bytes(_plan(n, h, 10_000, bf16=True))
    assert trainable == saved + grad_fp32 + blocks + 2 * 10_112 * h + 2 * c * h
    # LoRA freezes the head: no weight gradient, the largest temporary is the [n, h] product or cast
    frozen = lm_head_bytes(_plan(n, h, 10_000, bf16=True, lora_rank=8))
    assert frozen == saved + grad_fp32 + blocks + 2 * n * h == 8_912_896
    # fp32: 4-byte hidden rows and blocks, gradients accumulated in place, no temporary
    assert lm_head_bytes(_plan(n, h, 10_000, bf16=False)) == 4 * n * h * 2 + 2 * 4 * n * c + 4 * 10_112 * h
    # a vocab shard narrower than a chunk is one chunk: c = 250 real columns of the 256
    assert lm_head_bytes(_plan(n, h, 250, bf16=False)) == 4 * n * h * 2 + 2 * 4 * n * 250 + 4 * 256 * h
    # kept logits (model.keep_logits_gib): whole chunks within the budget, held from forward to backward
    fp32 = lm_head_bytes(_plan(n, h, 10_000, bf16=False))
    one_chunk = 4 * n * c
    assert lm_head_bytes(_plan(n, h, 10_000, bf16=False, keep=one_chunk + 4 * n * 100)) == fp32 + one_chunk
    assert lm_head_bytes(_plan(n, h, 10_000, bf16=False, keep=one_chunk - 1)) == fp32
    # all 10,000 real columns kept: no logits block left to recompute into
    assert lm_head_bytes(_plan(n, h, 10_000, bf16=False, keep=1 << 30)) == fp32 + 4 * n * 10_000 - 4 * n * c


class _LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages the ops return while it is active, as long as they live, and their peak. A
    storage that an op was given (a view, an in-place or ``out=`` result) is not new. Not seen: a kernel's
    internal scratch, and what a custom op allocates and frees inside its own forward (the fused forward's
    logits block, ``e n c``: below the backward's peak, which is plain Python over aten ops, all seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs))[0]
        given = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in given and key not in self.live:
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                weakref.finalize(storage, self._freed, key)
        self.peak = max(self.peak, self.now)
        return out


def _head_peak(
    rows: int, cols: int, hidden: int, vocab: int, dtype: torch.dtype, trainable: bool, keep_bytes: int = 0
) -> int:
    """Peak bytes of what the LM head allocates for one [rows, cols] micro-batch, every position kept, loss
    on both the log-probs and the entropy (as GRPO's with an entropy bonus)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(padded_vocab_size(vocab, 1), hidden, generator=gen) / 8).to(dtype)
    final_hidden = torch.randn(rows, cols, hidden, generator=gen).to(dtype).requires_grad_()
    tokens = torch.randint(0, vocab, (rows, cols), generator=gen)
    keep = torch.ones(rows, cols, dtype=torch.bool)
    ctx = SimpleNamespace(tp_rank=0, tp_size=1, tp_group=None)  # what the head reads of a ParallelContext
    head = LMHeadInput(final_hidden, weight.requires_grad_(trainable), ctx, keep_logits_bytes=keep_bytes)  # type: ignore[arg-type]
    with _LiveTensorBytes() as tracked:
        log_probs, entropy = head.token_log_probs(tokens, keep, vocab, temperature=1.0)
        (log_probs.sum() + entropy.sum()).backward()
    assert final_hidden.grad is not None and (weight.grad is not None) == trainable
    return tracked.peak


@pytest.mark.parametrize(
    ("rows", "cols", "hidden", "vocab", "dtype", "trainable", "keep"),
    [
        (2, 256, 128, 10_000, torch.float32, True, 0),
        (2, 256, 128, 10_000, torch.float32, False, 0),
        (2, 256, 128, 10_000, torch.bfloat16, True, 0),  # n < c: the temporary is the [c, h] block
        (2, 256, 128, 10_000, torch.bfloat16, False, 0),  # frozen: it is the [n, h] product or cast
        (1, 4608, 64, 4_500, torch.bfloat16, True, 0),  # n > c: it is the [n, h] one
        (2, 256, 128, 10_000, torch.float32, True, 512 * 4 * 5000),  # one chunk of 4096 columns kept
        (2, 256, 128, 10_000, torch.float32, True, 1 << 30),  # every chunk kept
    ],
)
def test_the_term_is_what_the_fused_head_allocates_at_its_peak(
    rows, cols, hidden, vocab, dtype, trainable, keep
):
    """Each buffer of the term is at least ``e n h`` = 128 B per token, above the per-token allowance: a
    buffer too many or too few in the formula fails here."""
    tokens = rows * cols
    plan = _plan(tokens, hidden, vocab, dtype == torch.bfloat16, lora_rank=0 if trainable else 8, keep=keep)
    planned = lm_head_bytes(plan)
    measured = _head_peak(rows, cols, hidden, vocab, dtype, trainable, keep)
    assert torch.finfo(dtype).bits // 8 * hidden > PER_TOKEN_BYTES
    assert 0 <= measured - planned <= PER_TOKEN_BYTES * tokens + 64, (measured, planned)


def test_model_keep_logits_gib_reaches_the_planner(tmp_path):
    """A GPU run keeps no logits unless ``model.keep_logits_gib`` says so; what it keeps is planned."""
    import json

    from mcore_rl.config import load_config
    from mcore_rl.planner.from_config import plan_input_from_config
    from tests.planner.hf_configs import QWEN3_8B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    recipe, path = "recipes/qwen3_8b_grpo_h100.yaml", f"model.path={tmp_path}"
    unset = plan_input_from_config(load_config(recipe, [path]), gpu="H100-80")
    kept = plan_input_from_config(load_config(recipe, [path, "model.keep_logits_gib=0.5"]), gpu="H100-80")
    assert unset.keep_logits_bytes == 0 and kept.keep_logits_bytes == 1 << 29
    assert lm_head_bytes(kept) > lm_head_bytes(unset)
    with pytest.raises(PlanError, match="keep_logits_bytes"):
        _plan(512, 128, 10_000, bf16=True, keep=-1)
