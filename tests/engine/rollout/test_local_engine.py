"""The embedded rollout engine at TP1 in this process: KV-cached generation against full recomputes, stop ids,
n samples, seeds, waves, lifecycle and errors."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.engine.rollout import (
    FINISH_LENGTH,
    FINISH_STOP,
    KVCache,
    LocalRolloutConfig,
    LocalRolloutEngine,
    RolloutEngine,
    SamplingParams,
    rollout_shards_from_full,
)
from mcore_rl.engine.rollout.projection import panels_pay
from mcore_rl.ops import decode as fused_decode
from tests.engine.rollout.common import make_engine, random_full_state, recomputed_log_probs
from tests.models import tiny_arch

# Ragged prompts: lengths 1..11, the longest past Mistral's window of 8.
PROMPTS = [[3, 17, 42, 8, 99, 5, 61, 7, 23, 11, 2], [5], [200, 13, 77, 40], [9, 9, 9, 9, 9, 9, 9]]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def family_engine(request) -> tuple[str, LocalRolloutEngine]:
    arch = tiny_arch(request.param)
    return request.param, make_engine(arch, random_full_state(arch, seed=1))


@pytest.fixture(scope="module")
def engine() -> LocalRolloutEngine:
    arch = tiny_arch("llama")
    return make_engine(arch, random_full_state(arch, seed=2))


def _max_recompute_diff(engine, out, prompts, temperature) -> float:
    worst = 0.0
    for i, response in enumerate(out.responses()):
        prompt = prompts[int(out.prompt_index[i])]
        expected = recomputed_log_probs(engine, prompt, response, temperature)
        worst = max(worst, float((out.log_probs[i, : len(response)] - expected).abs().max()))
    return worst


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, n=2, max_new_tokens=14, seed=0),
        SamplingParams(
            temperature=1.3,
            top_k=20,
            top_p=0.9,
            n=2,
            max_new_tokens=14,
            seed=1,
            stop_token_ids=range(0, 250, 10),
        ),
    ],
    ids=["plain", "top-k-top-p-stops"],
)
def test_kv_cached_log_probs_equal_full_recompute(family_engine, params):
    """Incremental decoding (left-padded ragged prompts, n samples, finished rows compacted away) computes the
    same log-probs as one no-cache forward over each whole sequence; Mistral's sequences outgrow its window."""
    _, engine = family_engine
    out = engine.generate(PROMPTS, params)
    assert out.num_sequences == len(PROMPTS) * params.n
    if params.stop_token_ids:  # some rows stopped (and left the batch) while others kept going
        assert 0 < out.finish_reasons.count("stop") < out.num_sequences
    assert _max_recompute_diff(engine, out, PROMPTS, params.temperature) < 1e-5


def test_greedy_is_argmax_of_recomputed_logits(engine):
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    for i, response in enumerate(out.responses()):
        sequence = torch.tensor([PROMPTS[i] + response])
        logits = engine.decoder.full_logits(sequence)[0, len(PROMPTS[i]) - 1 : -1]
        assert logits.argmax(-1).tolist() == response
    assert _max_recompute_diff(engine, out, PROMPTS, 0.0) < 1e-5


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=0.7, top_k=1, max_new_tokens=8, seed=5))
    assert torch.equal(greedy.token_ids, top1.token_ids)


def test_stop_ids_lengths_padding_and_finish_reasons(engine):
    stops = tuple(range(0, engine.arch.vocab_size, 4))  # a quarter of the vocab: most rows stop early
    params = SamplingParams(max_new_tokens=12, n=3, stop_token_ids=stops, seed=7, pad_token_id=249)
    out = engine.generate(PROMPTS, params)
    assert FINISH_STOP in out.finish_reasons and FINISH_LENGTH in out.finish_reasons
    for row, reason in zip(out.token_ids.tolist(), out.finish_reasons, strict=True):
        stop_at = [t for t, token in enumerate(row) if token in stops]
        if reason == FINISH_STOP:
            length = stop_at[0] + 1
        else:
            assert not stop_at and reason == FINISH_LENGTH
            length = params.max_new_tokens
        assert row[length:] == [249] * (params.max_new_tokens - length)
    mask = out.response_mask()
    assert torch.equal(mask.sum(1), out.lengths)
    assert (out.log_probs[~mask] == 0).all() and (out.log_probs[mask] < 0).all()


def test_max_new_tokens_bounds_every_sequence(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=0))
    assert out.token_ids.shape == (len(PROMPTS), 3)
    assert out.lengths.tolist() == [3] * len(PROMPTS) and set(out.finish_reasons) == {FINISH_LENGTH}


def test_n_samples_are_prompt_major_and_differ(engine):
    out = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=10, seed=11))
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for p in range(len(PROMPTS)):
        samples = {tuple(r) for r in out.token_ids[3 * p : 3 * p + 3].tolist()}
        assert len(samples) > 1  # one prefill, expanded: the samples still diverge
    greedy = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=6))
    assert torch.equal(greedy.token_ids[0::2], greedy.token_ids[1::2])


def test_same_seed_same_output_different_seed_different_output(engine):
    params = SamplingParams(max_new_tokens=10, n=2, seed=123)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, n=2, seed=124))
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.token_ids, c.token_ids)
    unseeded = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    assert unseeded.num_sequences == len(PROMPTS)


def test_waves_and_prefill_chunks_give_the_same_greedy_result():
    arch = tiny_arch("mistral")
    full = random_full_state(arch, seed=3)
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=9)
    reference = make_engine(arch, full).generate(PROMPTS, params)
    # 2 sequences of (11 + 9) slots per wave, 11-token prefill chunks: 2 waves, 1 prompt per prefill.
    small = make_engine(arch, full, max_cache_tokens=40, max_prefill_tokens=11).generate(PROMPTS, params)
    assert torch.equal(reference.token_ids, small.token_ids)
    assert torch.allclose(reference.log_probs, small.log_probs, atol=1e-5)


def test_sleep_and_wake_up_track_state_and_weights():
    arch = tiny_arch("qwen2")
    full = random_full_state(arch, seed=4)
    engine = make_engine(arch, full)
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(max_new_tokens=5, seed=1)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    assert engine.asleep == {"weights", "kv_cache"}
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    engine.wake_up(["weights"])
    assert engine.asleep == {"kv_cache"}
    engine.wake_up()
    assert torch.equal(engine.generate(PROMPTS, params).token_ids, before.token_ids)  # level 1 kept weights
    engine.sleep(level=2)
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.load_weights([])
    engine.wake_up()
    with pytest.raises(RuntimeError, match="never loaded"):
        engine.generate(PROMPTS, params)
    engine.load_weights(rollout_shards_from_full(full, arch, 1, 0).items())  # streamed again
    assert torch.equal(engine.generate(PROMPTS, params).token_ids, before.token_ids)
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(["optimizer"])
    with pytest.raises(ValueError, match="level"):
        engine.sleep(level=3)


def test_moe_weights_loaded_after_a_move_between_devices_are_the_ones_sampled_with(monkeypatch):
    """What sleep(1) and wake_up() do on an accelerator, two moves that copy every tensor (emulated on CPU by
    a copying ``Tensor.to``): each expert's name must stay a view of its layer's stacked weights, which the
    forward reads, or the next weight sync writes copies the rollout never samples with."""
    arch = tiny_arch("qwen3_moe")
    old, new = random_full_state(arch, seed=1), random_full_state(arch, seed=2)
    engine = make_engine(arch, old)
    to = torch.Tensor.to
    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "to", lambda self, *a, **k: to(self, *a, **k).clone())
        engine.decoder.to("cpu")  # asleep: to host memory
        engine.decoder.to("cpu")  # awake: back to the device
    engine.load_weights(rollout_shards_from_full(new, arch, 1, 0).items())  # the next step's weights
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    expected = make_engine(arch, new).generate(PROMPTS, greedy)
    assert torch.equal(engine.generate(PROMPTS, greedy).token_ids, expected.token_ids)


def test_load_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(KeyError, match="not a rollout-layout parameter"):
        engine.load_weights([("layers.0.self_attn.q_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"norm\.weight"):
        engine.load_weights([("norm.weight", torch.zeros(3))])


def test_prompt_validation(engine):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\].*vocab_size"):
        engine.generate([[engine.arch.vocab_size]], SamplingParams())
    empty = engine.generate([], SamplingParams(max_new_tokens=4))
    assert empty.num_sequences == 0 and empty.token_ids.shape == (0, 4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_engine_tracks_fp32(family):
    """bf16 weights, activations and cache, fp32 log-probs: logits within bf16 rounding of the fp32 ones."""
    arch = tiny_arch(family)
    full = random_full_state(arch, seed=1)
    fp32, bf16 = make_engine(arch, full), make_engine(arch, full, dtype=torch.bfloat16)
    tokens = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        reference, low = fp32.decoder.full_logits(tokens), bf16.decoder.full_logits(tokens)
    assert low.dtype == torch.float32
    assert float((low - reference).abs().max()) < 0.03 * float(reference.abs().max())
    out = bf16.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0))
    assert out.log_probs.dtype == torch.float32 and bool(torch.isfinite(out.log_probs).all())


@pytest.mark.parametrize("interval", [1, 3])
def test_stop_check_interval_keeps_outputs_exact(interval):
    """Checking for stopped rows only every few steps (what accelerators do, to avoid a host sync per step)
    leaves finished rows decoding in the batch for a while: their outputs must stay padded, and every
    recorded log-prob must still equal the full recompute."""
    arch = tiny_arch("llama")
    engine = make_engine(arch, random_full_state(arch, seed=5), stop_check_interval=interval)
    stops = tuple(range(0, arch.vocab_size, 12))
    params = SamplingParams(max_new_tokens=12, n=3, stop_token_ids=stops, seed=9, pad_token_id=249)
    out = engine.generate(PROMPTS, params)
    assert 0 < out.finish_reasons.count(FINISH_STOP) < out.num_sequences
    for row, length, reason in zip(
        out.token_ids.tolist(), out.lengths.tolist(), out.finish_reasons, strict=True
    ):
        first_stop = next((t for t, token in enumerate(row) if token in stops), None)
        assert length == (params.max_new_tokens if first_stop is None else first_stop + 1)
        assert reason == (FINISH_LENGTH if first_stop is None else FINISH_STOP)
        assert row[length:] == [249] * (params.max_new_tokens - length)
    mask = out.response_mask()
    assert (out.log_probs[~mask] == 0).all() and (out.log_probs[mask] < 0).all()
    assert _max_recompute_diff(engine, out, PROMPTS, params.temperature) < 1e-5
    again = engine.generate(PROMPTS, params)
    assert torch.equal(out.token_ids, again.token_ids) and torch.equal(out.log_probs, again.log_probs)


def test_kv_cache_kept_across_calls_never_leaks_stale_values():
    """The engine keeps its KV cache between calls and grows it when a call needs more: a call on a cache
    whose every slot holds NaN from before gives exactly what a fresh engine gives."""
    arch = tiny_arch("mistral")  # sliding window: decode steps skip early columns
    full = random_full_state(arch, seed=6)
    kept = make_engine(arch, full)
    calls = [
        (PROMPTS, SamplingParams(max_new_tokens=9, n=2, seed=1)),
        (PROMPTS[:3], SamplingParams(max_new_tokens=6, n=3, seed=2, stop_token_ids=range(0, 250, 9))),
        (PROMPTS * 3, SamplingParams(max_new_tokens=15, n=2, seed=3)),  # more rows and columns: grows
        (PROMPTS[1:3], SamplingParams(max_new_tokens=6, n=3, seed=4)),
    ]
    for prompts, params in calls:
        if kept._cache is not None:
            with torch.inference_mode():  # the cache was made under generate()'s inference mode
                for buf in kept._cache.keys + kept._cache.values:
                    buf.fill_(float("nan"))
        out, fresh = kept.generate(prompts, params), make_engine(arch, full).generate(prompts, params)
        if params.stop_token_ids:  # rows left the batch: their cache rows were compacted
            assert 0 < out.finish_reasons.count(FINISH_STOP) < out.num_sequences
        assert torch.equal(out.token_ids, fresh.token_ids)
        assert torch.equal(out.log_probs, fresh.log_probs)
    kept.sleep()
    assert kept._cache is None


def test_reference_decode_ops_match_recompute(monkeypatch):
    """With the compiled kernels overridden, decode steps run ``ops.decode``'s pure-PyTorch references (the
    path of bf16, GPUs and builds without the extension) and still match the full recompute."""
    monkeypatch.setenv("MCORE_RL_FORCE_REFERENCE", "1")
    arch = tiny_arch("qwen2")
    engine = make_engine(arch, random_full_state(arch, seed=7))
    params = SamplingParams(temperature=0.9, n=2, max_new_tokens=10, seed=8)
    out = engine.generate(PROMPTS, params)
    assert _max_recompute_diff(engine, out, PROMPTS, params.temperature) < 1e-5


def test_local_config_validation_names_the_field():
    with pytest.raises(ValueError, match="stop_check_interval"):
        LocalRolloutConfig(stop_check_interval=0)


@pytest.mark.skipif(not hasattr(torch.ops.mcore_rl, "decode_layers"), reason="native extension not built")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_one_call_decode_step_is_the_per_layer_loop_bitwise(family, monkeypatch) -> None:
    from mcore_rl.engine.rollout.decoder import RolloutDecoder

    arch = tiny_arch(family)  # qwen2: GQA and a QKV bias
    engine = make_engine(arch, random_full_state(arch, seed=2))
    decoder = engine.decoder
    prompts = torch.randint(0, arch.vocab_size, (3, 6), generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([0, 2, 1])
    results = {}
    for native in (True, False):
        monkeypatch.setattr(RolloutDecoder, "_native_step", lambda self, ops, native=native: native)
        decoder._invalidate()  # both runs start unpacked (decode steps pack their weights as they go)
        cache = KVCache.allocate(
            arch.num_layers, 3, decoder.num_kv_heads, 9, arch.head_dim, torch.float32, "cpu"
        )
        with torch.inference_mode():
            decoder.prefill(prompts, pad, cache, slice(0, 3))
            steps = [decoder.decode(prompts[:, i], 6 + i, pad, cache) for i in range(3)]
        results[native] = (steps, cache.keys, cache.values)
    for a, b in zip(results[True][0], results[False][0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(results[True][1] + results[True][2], results[False][1] + results[False][2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(
    not fused_decode.mkl_packing_available(torch.device("cpu"), torch.float32),
    reason="torch built without MKL",
)
def test_decode_steps_on_mkl_packed_weights_match_plain_gemms() -> None:
    """Decode steps run their projections and the LM head on weights MKL-packed at the first step; as finished
    rows leave, a batch of at least half the packed rows runs zero-padded on them, a smaller one runs plain
    GEMMs until its size repeats and is packed then (``projection.DecodePacking``). Logits and caches match
    the plain GEMMs' to fp32 rounding."""
    arch = tiny_arch("qwen2")
    engine = make_engine(arch, random_full_state(arch, seed=4))
    decoder = engine.decoder
    prompts = torch.randint(0, arch.vocab_size, (5, 6), generator=torch.Generator().manual_seed(2))
    pad = torch.tensor([0, 2, 1, 0, 3])
    results, packed_rows = {}, {}
    for mkl in (True, False):
        decoder._packs_for_decode = mkl  # allocate() decides (MKL, 2+ threads); either storage works
        decoder._invalidate()  # projections are rebuilt with (or without) MKL packing
        cache = KVCache.allocate(
            arch.num_layers, 5, decoder.num_kv_heads, 12, arch.head_dim, torch.float32, "cpu"
        )
        with torch.inference_mode():
            decoder.prefill(prompts, pad, cache, slice(0, 5))
            decoder.start_decoding(5)
            steps, packed_rows[mkl] = [], []
            for i, rows in enumerate((5, 5, 3, 2, 2, 2)):  # rows finish and leave the batch
                steps.append(decoder.decode(prompts[:rows, i], 6 + i, pad[:rows], cache))
                packed_rows[mkl].append(decoder.packing.rows)
        results[mkl] = (steps, cache.keys + cache.values)
    assert packed_rows == {True: [5, 5, 5, 5, 2, 2], False: [0] * 6}
    for a, b in zip(results[True][0] + results[True][1], results[False][0] + results[False][1], strict=True):
        assert (a - b).abs().max() <= 1e-5


@pytest.mark.skipif(
    not fused_decode.mkl_packing_available(torch.device("cpu"), torch.float32),
    reason="torch built without MKL",
)
@pytest.mark.parametrize("threads", [1, 2])
def test_weights_are_laid_out_for_how_decode_steps_will_multiply(threads) -> None:
    """Where decode steps run on a packed copy (MKL's packed GEMM with 2+ threads, or our panels on all but
    Intel CPUs with AVX-512: ``projection.panels_pay``) the projection weights stay row-major as megatron
    holds them (the sync's straight copy); where they multiply the weights themselves (one thread without
    panels: plain NN gemms) they are column-major."""
    arch = tiny_arch("llama")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = make_engine(arch, random_full_state(arch, seed=1))
    finally:
        torch.set_num_threads(previous)
    weight = engine.decoder.weights["layers.0.mlp.gate_up_proj.weight"]
    panels = panels_pay(torch.device("cpu"), torch.float32)
    mkl_packed = threads > 1 and not panels
    assert engine.decoder._packs_for_decode == mkl_packed
    row_major = mkl_packed or panels
    assert weight.is_contiguous() == row_major and weight.t().is_contiguous() == (not row_major)
