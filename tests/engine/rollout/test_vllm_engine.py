"""The vLLM rollout engine: the output conversion on CPU; the engine itself on a GPU with vLLM installed.

The ``gpu`` test below needs CUDA and vLLM 0.33 in the same environment (the lent device has neither vLLM
nor room to carry it), so it has not run yet; tests_vllm/ checks the engine's arguments and weight layout
against the real vLLM package on CPU (``make test-vllm``).
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.engine.rollout import SamplingParams, rollout_shards_from_full
from mcore_rl.engine.rollout.base import SamplingParamsError
from mcore_rl.engine.rollout.decoder import RolloutDecoder
from mcore_rl.engine.rollout.vllm_engine import _to_generation_output, vllm_param_name
from mcore_rl.engine.rollout.vllm_layout import VLLMWeightError
from tests.engine.rollout.common import random_full_state
from tests.models import tiny_arch


def _completion(tokens: list[int], logprobs: list[float], reason: str) -> SimpleNamespace:
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
    return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason)


def test_vllm_outputs_become_prompt_major_padded_generation_output() -> None:
    requests = [
        SimpleNamespace(
            outputs=[_completion([5, 6, 2], [-0.1, -0.2, -0.3], "stop"), _completion([7], [-1.0], "length")]
        ),
        SimpleNamespace(
            outputs=[_completion([8, 9], [-0.5, -0.6], "length"), _completion([4], [-2.0], "stop")]
        ),
    ]
    out = _to_generation_output(requests, SamplingParams(n=2, max_new_tokens=3, pad_token_id=99))
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.token_ids.tolist() == [[5, 6, 2], [7, 99, 99], [8, 9, 99], [4, 99, 99]]
    assert out.lengths.tolist() == [3, 1, 2, 1]
    assert out.finish_reasons == ["stop", "length", "length", "stop"]
    assert torch.allclose(out.log_probs[0], torch.tensor([-0.1, -0.2, -0.3]))
    assert out.log_probs[1, 1:].abs().sum() == 0  # padding carries no log-prob


def test_vllm_param_names() -> None:
    assert vllm_param_name("layers.3.self_attn.qkv_proj.weight") == "model.layers.3.self_attn.qkv_proj.weight"
    assert vllm_param_name("embed_tokens.weight") == "model.embed_tokens.weight"
    assert vllm_param_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the 'gpu' extra)"
)
def test_vllm_log_probs_match_recomputation() -> None:
    """One process, rollout TP1: weights copied in as shards, vLLM's log-probs equal our recomputation."""
    import torch.distributed as dist

    from mcore_rl.engine.rollout.vllm_engine import VLLMRolloutEngine

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        arch = tiny_arch("llama")  # max_position_embeddings=64: vLLM refuses a longer max_model_len
        full = random_full_state(arch)
        # fp32 with head_dim 16 runs FlexAttention; eager mode skips minutes of compile and graph capture
        engine = VLLMRolloutEngine(
            arch, tensor_parallel_size=1, dtype=torch.float32, max_model_len=64, enforce_eager=True
        )
        with pytest.raises(RuntimeError, match="asleep"):  # built asleep: training comes first
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        engine.wake_up(["weights"])
        engine.load_weights(rollout_shards_from_full(full, arch, 1, 0).items())
        engine.wake_up(["kv_cache"])
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        out = engine.generate(prompts, SamplingParams(temperature=0.7, n=2, max_new_tokens=8, seed=0))
        decoder = RolloutDecoder(arch)
        for name, tensor in rollout_shards_from_full(full, arch, 1, 0).items():
            decoder.load(name, tensor)
        for row, response in enumerate(out.responses()):
            prompt = prompts[int(out.prompt_index[row])]
            tokens = torch.tensor([prompt + response])
            logits = decoder.full_logits(tokens)[0, len(prompt) - 1 : -1] / 0.7
            expected = torch.log_softmax(logits, -1).gather(-1, tokens[0, len(prompt) :, None]).squeeze(-1)
            assert float((out.log_probs[row, : len(response)] - expected).abs().max()) < 2e-3
        with pytest.raises(SamplingParamsError, match="top_k"):
            engine.generate(prompts, SamplingParams(top_k=5, max_new_tokens=4))
        engine.sleep(level=2)
        engine.wake_up()
        with pytest.raises(VLLMWeightError, match="has not loaded"):  # level 2 discarded the weights
            engine.generate(prompts, SamplingParams(max_new_tokens=2))
        engine.close()
    finally:
        dist.destroy_process_group()
