"""megatron-core's first import on CPU (``compat.megatron_import``), in a fresh interpreter: its fusions are
plain functions, neither inductor nor wandb is loaded by it, and both are there as before once it is done
(torch.compile compiles, wandb imports, the environment is as it was)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive with CUDA")

CHECK = textwrap.dedent(
    """
    import importlib.util, json, os, sys, types
    import torch
    from mcore_rl.compat import megatron_cpu

    megatron_cpu.apply()
    import megatron.core.models.gpt  # the model's modules, imported after the first import
    from megatron.core.fusions import fused_bias_geglu, fused_bias_swiglu
    from megatron.core.transformer.moe import router

    def plain(fn):
        return isinstance(fn, types.FunctionType) and not hasattr(fn, "_torchdynamo_orig_callable")

    found = {
        "fusions_plain": [plain(fused_bias_geglu.geglu), plain(fused_bias_swiglu.swiglu)],
        "later_module_plain": plain(router.TopKRouter._apply_expert_bias),
        "inductor_loaded": "torch._inductor.compile_fx" in sys.modules,
        "wandb_loaded": "wandb" in sys.modules,
        "environment_restored": "TORCHDYNAMO_DISABLE" not in os.environ,
        "compile_still_compiles": torch.compile(lambda x: x + 1) is not None
        and "torch._inductor.compile_fx" in sys.modules,
    }
    if importlib.util.find_spec("wandb") is not None:  # installed: importable as before
        import wandb

        found["wandb_imports_after"] = isinstance(wandb.__version__, str)
    print(json.dumps(found))
    """
)


def test_the_first_import_leaves_out_inductor_and_wandb_and_keeps_both_usable_after() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found.pop("fusions_plain") == [True, True]
    assert found.pop("later_module_plain") is True
    assert found.pop("inductor_loaded") is False and found.pop("wandb_loaded") is False
    assert all(found.values()), found  # environment restored, torch.compile compiles, wandb imports
