"""What our record of a mixture-of-experts model's routing relies on in vLLM (``engine/rollout/vllm_outputs.py``,
``vllm_compat.bind_routing``), asked of vLLM's own code: the router hook and where it fires, the V1 model runner's
batch layout, how request ids name a prompt's samples, the prefix-cache switch a recording request sets; and
why vLLM's own routed-experts output is not the route on CPU. The recording itself runs against a megatron actor
in ``tests/engine/rollout/test_vllm_engine.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcore_rl.engine.rollout import SamplingParams, vllm_compat
from mcore_rl.engine.rollout.vllm_engine import sampling_kwargs
from mcore_rl.engine.rollout.vllm_outputs import sample_of
from tests_vllm.common import arch_of, our_engine_args, write_config

vllm = pytest.importorskip("vllm")
PLATFORM = vllm_compat.platform_name()


def test_vllms_own_routed_experts_fields_exist() -> None:
    """The engine argument, the per-sample output and the prompt offset of vLLM's own routed-experts output (what
    vllm_outputs' docstring describes and a later engine could switch to)."""
    from vllm.config.aux_output import AuxOutputConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.outputs import CompletionOutput

    assert "enable_return_routed_experts" in {f.name for f in dataclasses.fields(AuxOutputConfig)}
    assert "enable_return_routed_experts" in {f.name for f in dataclasses.fields(EngineArgs)}
    assert "routed_experts" in {f.name for f in dataclasses.fields(CompletionOutput)}
    assert vllm.SamplingParams(routed_experts_prompt_start=3).routed_experts_prompt_start == 3


@pytest.mark.skipif(PLATFORM != "cpu", reason="vLLM's CPU build")
def test_vllms_own_routed_experts_output_needs_the_v2_runner_which_the_cpu_build_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the CPU engine records the routing itself: the option needs Model Runner V2, and V2 needs Triton with
    a CPU backend (triton-cpu), which is not installed (nor on PyPI)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.triton_utils import HAS_TRITON

    assert not HAS_TRITON
    model = write_config(arch_of("qwen3_moe"), tmp_path)
    args = EngineArgs(**our_engine_args(model, 1), enable_return_routed_experts=True)
    with pytest.raises(ValueError, match="requires Model Runner V2"):
        args.create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
        EngineArgs(**our_engine_args(model, 1), enable_return_routed_experts=True).create_engine_config()


def test_the_router_hook_fires_with_logical_ids_before_any_expert_remapping() -> None:
    """``BaseRouter._select_experts`` calls ``capture_fn(topk_ids)`` after routing, before the EPLB mapping to
    physical experts; every fused-MoE layer's runner holds its router and names its decoder layer (the index in
    its module name)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    source = inspect.getsource(BaseRouter._select_experts)
    assert source.index("self.capture_fn(topk_ids)") < source.index("self._apply_eplb_mapping(topk_ids)")
    assert "capture_fn" in inspect.signature(BaseRouter.set_capture_fn).parameters
    assert "self.router = router" in inspect.getsource(MoERunner.__init__)
    assert "extract_layer_index(self.layer_name)" in inspect.getsource(MoERunner.layer_id.fget)  # type: ignore[attr-defined]


def test_the_v1_runner_lays_out_each_step_where_we_read_it() -> None:
    """``execute_model`` calls ``_prepare_inputs``, which writes ``query_start_loc`` from the batch's request order
    and each request's computed tokens (the positions of its rows)."""
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "self._prepare_inputs(" in inspect.getsource(GPUModelRunner.execute_model)
    prepare = inspect.getsource(GPUModelRunner._prepare_inputs)
    assert "self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens" in prepare
    assert "self.input_batch.num_computed_tokens_cpu[req_indices]" in prepare
    assert isinstance(InputBatch.req_ids, property) and "self.num_computed_tokens_cpu =" in inspect.getsource(
        InputBatch.__init__
    )
    if PLATFORM == "cpu":  # the runner the CPU worker builds without Triton
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        assert issubclass(CPUModelRunner, GPUModelRunner)


def test_request_ids_name_each_sample_as_sample_of_reads_them() -> None:
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.parallel_sampling import ParentRequest

    params = vllm.SamplingParams(n=3, seed=1)
    request = EngineCoreRequest("12", [1, 2], None, params, None, time.time(), None, None, None)
    InputProcessor.assign_request_id(request)
    assert sample_of(request.request_id, 1) == ("12", 0)
    parent = ParentRequest(request)
    assert [sample_of(parent.get_child_info(i)[0], 3) for i in range(3)] == [("12", i) for i in range(3)]


def test_a_recording_request_computes_its_whole_prompt() -> None:
    """The switch a recording ``generate`` sets (a prefix-cache hit would compute, so route, nothing): vLLM's
    request reads it, and the KV-cache manager then finds no cached prefix."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    theirs = vllm.SamplingParams(**sampling_kwargs(SamplingParams(seed=1), 1, whole_prompts=True))
    assert theirs.skip_reading_prefix_cache is True
    assert "skip_reading_prefix_cache" not in sampling_kwargs(SamplingParams(seed=1), 1)
    assert Request.get_skip_reading_prefix_cache(SimpleNamespace(sampling_params=theirs, pooling_params=None))
    assert "not request.skip_reading_prefix_cache" in inspect.getsource(KVCacheManager)


def test_a_runner_whose_layout_we_do_not_read_is_named() -> None:
    """What the engine says (and, with ``record_routing=True``, refuses with) where it cannot record."""
    from mcore_rl.engine.rollout.vllm_outputs import RoutingRecorder

    problem = vllm_compat.bind_routing(SimpleNamespace(model_runner=object()), RoutingRecorder([0], 2))
    expected = (
        vllm_compat.ROUTING_ON_CUDA if PLATFORM == "cuda" else "builtins.object, not the V1 model runner"
    )
    assert problem is not None and expected in problem
