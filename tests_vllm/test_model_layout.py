"""vLLM's Llama and Qwen2 model classes, built on the meta device under vLLM's own parallel state (gloo, 4 ranks)
at TP 1, 2 and 4: every rank's parameter names and shapes are exactly our vLLM reshard target's, and vLLM's TP
rank of global rank r is ``r % tp`` (the consecutive order ``build_vllm_plan`` assumes), tied and untied.

One spawn of 4 processes serves every case (importing vLLM costs seconds per process).
"""

from __future__ import annotations

import os
import queue
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from mcore_rl.engine.rollout.vllm_layout import build_vllm_plan, vllm_param_shapes
from mcore_rl.parallel.launch_env import free_local_port
from mcore_rl.parallel.layout import ParallelLayout
from tests_vllm.common import CASES, arch_of

pytest.importorskip("vllm")

WORLD = 4
TP_SIZES = (1, 2, 4)
_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}


def _model_shapes(family: str, tp: int, directory: str) -> tuple[int, dict[str, tuple[int, ...]]]:
    """(vLLM's TP rank, name -> shape) of ``family``'s vLLM model class at TP ``tp`` on this rank."""
    import importlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.distributed.parallel_state import destroy_model_parallel, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    from tests_vllm.common import our_engine_args, write_config

    # One folder per rank: four ranks writing one config.json at once let a rank read it torn (seen here:
    # vLLM retried, or that rank failed and the others hung in the next collective).
    rank = torch.distributed.get_rank()
    model_path = write_config(arch_of(family), Path(directory) / f"{family}-{tp}-rank{rank}")
    args = EngineArgs(**our_engine_args(model_path, tp))
    config = args.create_engine_config()
    module, name = _CLASSES[family]
    cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    with set_current_vllm_config(config):
        initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
        try:
            with torch.device("meta"):
                model = cls(vllm_config=config)
            return get_tensor_model_parallel_rank(), {n: tuple(p.shape) for n, p in model.named_parameters()}
        finally:
            destroy_model_parallel()


def _worker(rank: int, port: int, directory: str, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        # vLLM's CPU TP groups name their shared memory after it; vLLM's CPU worker would set it (here there
        # is none). The port makes it unique on the host, as vLLM's own launcher does.
        VLLM_DIST_IDENT=f"mcore_rl-test-{port}",
    )
    try:
        from vllm.distributed.parallel_state import init_distributed_environment

        init_distributed_environment(
            world_size=WORLD,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        out = {(f, tp): _model_shapes(f, tp, directory) for f in CASES for tp in TP_SIZES}
        results.put((rank, out))
    except BaseException as err:  # the parent reports it; a silent child would only time out
        import traceback

        results.put((rank, f"{err!r}\n{traceback.format_exc()}"))


@pytest.fixture(scope="module")
def vllm_shapes() -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as directory:
        port = free_local_port()
        procs = [ctx.Process(target=_worker, args=(r, port, directory, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        try:
            while len(got) < WORLD:
                rank, value = results.get(timeout=600)
                got[rank] = value
        except queue.Empty:
            pytest.fail(f"vLLM workers did not report in time (got ranks {sorted(got)})")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    errors = [v for v in got.values() if isinstance(v, str)]
    assert not errors, errors[0]
    return got


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("tp", TP_SIZES)
def test_vllm_parameters_are_our_target(vllm_shapes: dict[int, Any], family: str, tp: int) -> None:
    arch = arch_of(family)
    plan = build_vllm_plan(arch, ParallelLayout(WORLD, tp=1), tp)
    ours = vllm_param_shapes(arch, tp)
    for rank in range(WORLD):
        tp_rank, theirs = vllm_shapes[rank][(family, tp)]
        assert tp_rank == rank % tp == plan.rollout_coords[rank][0]
        assert theirs == ours, sorted(set(theirs.items()) ^ set(ours.items()))
    assert ("lm_head.weight" in ours) == (not arch.tie_word_embeddings)
