"""The rollout decoder computes megatron's function: logits, ragged left-padded prefill and sampled log-probs
match a megatron-core GPTModel (local spec, TP1) holding the same weights, at rollout TP1 and TP2; and a TP2
engine samples what a TP1 engine samples.

Runs on the 2-rank gloo pool; the rollout TP2 group is the whole world.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from mcore_rl.engine.model import build_model_chunks
from mcore_rl.engine.rollout import KVCache, SamplingParams
from mcore_rl.engine.weights import gather_full_state, load_full_state
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext
from tests.engine.rollout.common import make_engine, random_full_state
from tests.models import tiny_arch

SEQ = 20  # longer than Mistral's window of 8
PROMPT_LENGTHS = [20, 7, 13]
PARAMS = SamplingParams(temperature=0.7, top_k=50, n=2, max_new_tokens=10, seed=3)


def _megatron_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 logits [b, s, vocab] over the real vocab (padding columns dropped)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)[..., :vocab_size].float()


def _left_padded_prefill(engine, prompts: list[list[int]]) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt)
    pad = torch.tensor([width - len(p) for p in prompts])
    decoder = engine.decoder
    cache = KVCache.allocate(
        engine.arch.num_layers,
        len(prompts),
        decoder.num_kv_heads,
        width,
        engine.arch.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    with torch.inference_mode():
        return decoder.prefill(tokens, pad, cache, slice(0, len(prompts)))


def _megatron_log_probs_diff(model, out, prompts, vocab_size: int) -> float:
    """Max |engine log-prob - megatron recompute| over the sampled tokens (right-padded batch, causal)."""
    responses = out.responses()
    sequences = [prompts[int(p)] + r for p, r in zip(out.prompt_index, responses, strict=True)]
    batch = torch.zeros(len(sequences), max(len(s) for s in sequences), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = torch.tensor(sequence)
    log_probs = torch.log_softmax(_megatron_logits(model, batch, vocab_size) / PARAMS.temperature, dim=-1)
    worst = 0.0
    for row, response in enumerate(responses):
        start = len(prompts[int(out.prompt_index[row])]) - 1
        expected = log_probs[row, start : start + len(response)].gather(-1, torch.tensor(response)[:, None])
        worst = max(worst, float((out.log_probs[row, : len(response)] - expected.squeeze(-1)).abs().max()))
    return worst


def _with_a_stop(engine, prompts) -> SamplingParams:
    """PARAMS plus, as stop id, the third token of the first sample: that row finishes at step 3 at the latest
    (the draws up to there are the same) and leaves the batch while others go on."""
    probe = engine.generate(prompts, PARAMS)
    return replace(PARAMS, stop_token_ids=(int(probe.token_ids[0, 2]),))


def _parity_body(family: str) -> dict:
    arch = tiny_arch(family)
    tokens = torch.randint(
        0, arch.vocab_size, (len(PROMPT_LENGTHS), SEQ), generator=torch.Generator().manual_seed(0)
    )
    prompts = [tokens[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]
    result: dict = {"diffs": {}, "outputs": {}}
    with ParallelContext.initialize(ParallelConfig()) as ctx:
        chunks = build_model_chunks(arch, ctx)
        load_full_state(chunks, random_full_state(arch, seed=5), arch, ctx)  # random norms and biases too
        full = gather_full_state(chunks, arch, ctx)
        reference = _megatron_logits(chunks[0], tokens, arch.vocab_size)
        params = _with_a_stop(make_engine(arch, full), prompts)
        for tp, group in ((1, None), (2, dist.group.WORLD)):
            engine = make_engine(arch, full, tp_group=group)
            with torch.inference_mode():
                logits = engine.decoder.full_logits(tokens)
            last = torch.stack([reference[i, n - 1] for i, n in enumerate(PROMPT_LENGTHS)])
            out = engine.generate(prompts, params)
            result["diffs"][tp] = {
                "logits": float((logits - reference).abs().max()),
                "ragged_prefill": float((_left_padded_prefill(engine, prompts) - last).abs().max()),
                "sampled_log_probs": _megatron_log_probs_diff(chunks[0], out, prompts, arch.vocab_size),
            }
            result["outputs"][tp] = out
    return result


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_rollout_matches_megatron_at_tp1_and_tp2(run_distributed, family):
    results = run_distributed(_parity_body, family)
    # At TP1 the decoder's full forward is the trainer's, operation by operation (causal attention included:
    # both call torch's fused kernel on the same operands). Mixture-of-experts layers agree within rounding
    # (the 1e-5 below): the same experts, but megatron's fused weighted SwiGLU rounds in its own order.
    if tiny_arch(family).moe is None:
        assert results[0]["diffs"][1]["logits"] == 0.0
    for rank_result in results:
        for tp, diffs in rank_result["diffs"].items():
            for name, diff in diffs.items():
                assert diff < 1e-5, (
                    f"tp{tp} {name} differs from megatron by {diff:.3g}: {rank_result['diffs']}"
                )
    tp1, tp2 = results[0]["outputs"][1], results[0]["outputs"][2]
    assert torch.equal(tp1.token_ids, tp2.token_ids) and tp1.finish_reasons == tp2.finish_reasons
    assert tp1.finish_reasons[0] == "stop"
    # each within 1e-5 of megatron's (above), so within twice that of each other
    assert float((tp1.log_probs - tp2.log_probs).abs().max()) < 2e-5
    # Both TP ranks return the very same samples (one generator seed, gathered logits).
    other = results[1]["outputs"][2]
    assert torch.equal(tp2.token_ids, other.token_ids) and torch.equal(tp2.log_probs, other.log_probs)
