"""One test per behaviour the megatron-core CPU layer patches (megatron-core 0.16.1).

Bodies run in the gloo worker pool, where ``ParallelContext.initialize`` has applied the layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_rl.compat import megatron_cpu
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.context import ParallelContext

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive with CUDA")


def test_targets_the_pinned_megatron_version():
    import megatron.core

    assert megatron.core.__version__ == megatron_cpu.TARGET_MEGATRON_VERSION


def _current_device_and_sp_gather() -> tuple[str, list[int]]:
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2)):
        local = torch.full((2, 1, 3), float(dist.get_rank()))
        gathered = gather_from_sequence_parallel_region(local)  # allocates on torch.cuda.current_device()
        torch.cuda.synchronize()  # p2p_communication calls it; must be a no-op here
        return str(torch.cuda.current_device()), gathered[:, 0, 0].tolist()


def test_current_device_is_cpu_and_sequence_parallel_gather_works(run_distributed):
    for device, values in run_distributed(_current_device_and_sp_gather):
        assert device == "cpu"
        assert values == [0.0, 0.0, 1.0, 1.0]


def _rng_streams() -> dict:
    from megatron.core import tensor_parallel

    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2), seed=11):
        before = torch.get_rng_state()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tp_draw = torch.rand(4)
        restored = torch.equal(before, torch.get_rng_state())
        with tensor_parallel.get_cuda_rng_tracker().fork():
            second_draw = torch.rand(4)
        return {"tp": tp_draw, "second": second_draw, "restored": restored, "default": torch.rand(4)}


def test_rng_tracker_forks_on_the_cpu_generator(run_distributed):
    rank0, rank1 = run_distributed(_rng_streams)
    assert rank0["restored"] and rank1["restored"]  # fork leaves the default stream untouched
    assert not torch.equal(rank0["tp"], rank1["tp"])  # TP ranks get different streams (dropout in TP regions)
    assert not torch.equal(rank0["tp"], rank0["second"])  # the tracked stream advances across forks
    assert torch.equal(rank0["default"], rank1["default"])  # the data-parallel stream is shared
    again = run_distributed(_rng_streams)
    assert torch.equal(again[0]["tp"], rank0["tp"])  # and everything is reproducible


def _torch_norm_under_sp() -> tuple[str, bool, float]:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            normalization="RMSNorm",
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            use_cpu_initialization=True,
        )
        norm = WrappedTorchNorm(config, 8, eps=1e-5)
        x = torch.randn(3, 8)
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return type(norm).__name__, norm.weight.sequence_parallel, float((norm(x) - expected).abs().max())


def test_torch_norm_accepts_sequence_parallel_and_tags_params(run_distributed):
    for name, tagged, err in run_distributed(_torch_norm_under_sp):
        assert name == "FusedRMSNorm" and tagged and err < 1e-6


def _megatron_cuda_sites() -> dict:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    megatron_cpu.apply()
    mask = get_sliding_window_causal_mask(4, 4, (1, 0))  # hard-codes device="cuda"
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)  # asserts grad.type() is cuda
    ours_type = param.grad.type()
    try:
        torch.zeros(1, device="cuda")  # the same request from outside megatron is not rewritten
        ours_raise = False
    except (AssertionError, RuntimeError):
        ours_raise = True
    with megatron_cpu.suspended():
        try:
            clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
            unpatched_fails = False
        except (AssertionError, RuntimeError):
            unpatched_fails = True
    return {
        "mask": mask.tolist(),
        "mask_device": str(mask.device),
        "grad": param.grad.tolist(),
        "ours_type": ours_type,
        "ours_raise": ours_raise,
        "unpatched_fails": unpatched_fails,
    }


def test_mode_rewrites_cuda_only_for_megatron_callers(run_distributed):
    out = run_distributed(_megatron_cuda_sites)[0]
    assert out["mask_device"] == "cpu"
    assert out["mask"] == [  # True = masked: window of 2 (self and one back)
        [False, True, True, True],
        [False, False, True, True],
        [True, False, False, True],
        [True, True, False, False],
    ]
    assert out["grad"] == pytest.approx([2.0 / (4.0 + 1e-6)] * 3)
    assert out["ours_type"] == "torch.FloatTensor"
    assert out["ours_raise"] and out["unpatched_fails"]


def _distopt_state_load_keeps_step() -> dict:
    from mcore_rl.engine.optim import OptimConfig
    from mcore_rl.engine.train_engine import MicroBatch, TrainEngine
    from tests.models import tiny_arch

    with ParallelContext.initialize(ParallelConfig()) as ctx:
        engine = TrainEngine.build(tiny_arch(), ctx, optim=OptimConfig(weight_decay=0.0, lr=1e-2))
        tokens = torch.randint(0, 200, (1, 8))
        batch = MicroBatch(tokens, torch.arange(8)[None])
        engine.train_step([batch], lambda out, mb: (out.float().pow(2).mean(), {}))
        distopt = engine.optimizer.chained_optimizers[0]
        model_param = next(iter(distopt.model_param_group_index_map))
        group, order = distopt.model_param_group_index_map[model_param]
        main = distopt.optimizer.param_groups[group]["params"][order]
        state = distopt.optimizer.state[main]
        step = state["step"].clone()
        new = {
            k: torch.full_like(v, 0.5)
            for k, v in (("param", main), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"]))
        }
        with torch.no_grad():  # fp32 main params are views of the model params (leaf tensors)
            distopt._set_main_param_and_optimizer_states(model_param, new)  # KeyError: 'step' unpatched
        return {
            "copied": all(bool((t == 0.5).all()) for t in (main, state["exp_avg"], state["exp_avg_sq"])),
            "step_kept": torch.equal(state["step"], step),
        }


def test_distributed_optimizer_state_load_keeps_adam_step(run_distributed):
    for out in run_distributed(_distopt_state_load_keeps_step):
        assert out == {"copied": True, "step_kept": True}


def test_megatrons_typed_storage_use_stays_off_the_console(monkeypatch) -> None:
    """megatron's DDP buffer offload resizes ``Tensor.storage()``; torch's deprecation of it printed on the
    console of ``mcore-rl dpo`` and in-process ``eval``."""
    import warnings

    import torch.storage

    from mcore_rl.compat import megatron_cpu

    monkeypatch.setattr(torch.storage, "_always_warn_typed_storage_removal", True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        megatron_cpu._silence_known_warnings()
        torch.zeros(4).storage().size()
    assert not [w for w in caught if "TypedStorage" in str(w.message)]
