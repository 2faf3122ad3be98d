"""Custom ops: fused vocab-parallel log-prob + entropy, and the reshard pack kernel.

Each op has a compiled kernel (``csrc/``, loaded from ``mcore_rl._C``) and one pure-PyTorch reference
(:mod:`mcore_rl.ops.reference`) used as the fallback when the extension is not built and as the test oracle.
``native_available()`` says which one runs; ``MCORE_RL_FORCE_REFERENCE=1`` forces the references (tests).
"""

from mcore_rl.ops._native import native_available
from mcore_rl.ops.logprob import linear_logprob_entropy, vocab_parallel_logprob_entropy
from mcore_rl.ops.pack import PackedTensor, PackPlan, pack_copy, unpack_copy

__all__ = [
    "PackPlan",
    "PackedTensor",
    "linear_logprob_entropy",
    "native_available",
    "pack_copy",
    "unpack_copy",
    "vocab_parallel_logprob_entropy",
]
