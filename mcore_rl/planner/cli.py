"""``mcore-rl plan``: per-GPU memory of a run, phase by phase, and whether it fits, before anything launches.

    mcore-rl plan RECIPE [key=value ...] [--gpu A100-80] [--recompute none|selective|full]
                  [--model-config config.json] [--margin 0.1]
    mcore-rl plan --model-config config.json --gpu A100-80 --nodes 1 --gpus-per-node 8 --tp 2 [--pp 1]
                  [--vpp V] [--sp] [--cp C] [--ep E] [--etp T] [--seq-length 4096] [--micro-batch-size 1]
                  [--global-batch-size 256]
                  [--rollout-tp 2] [--rollout-memory-fraction 0.5] [--critic] [--reference] [--lora-rank R] [--fp32]

With a recipe the layout, batch and rollout settings come from the run config (``key=value`` overrides as
everywhere); ``--model-config`` stands in for ``model.path``'s ``config.json`` when the model folder is not
on this machine. Exit status: 0 fits, 1 does not fit (a smaller fitting layout is proposed), 2 bad input.
When the asked layout does not fit, or fits without ``--margin`` of its usable memory free, the report also
recommends a layout on all the run's GPUs (:func:`~mcore_rl.planner.search.recommended_layout`).

``--self-check`` (under ``launch/torchrun.sh``) builds the real training engine at the layout, with the
launcher's world size, and compares every rank's weight, gradient and optimizer bytes with the planner
(:mod:`mcore_rl.planner.selfcheck`); exit status 0 when all match.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mcore_rl.engine.arch import ModelArch
from mcore_rl.io.errors import ConfigError
from mcore_rl.planner.memory import plan_memory
from mcore_rl.planner.report import format_plan
from mcore_rl.planner.search import MARGIN_FRACTION, has_margin, recommended_layout, smallest_fitting_layout
from mcore_rl.planner.spec import GPU_MEMORY_BYTES, RECOMPUTE_MODES, PlanError, PlanInput

_LAYOUT_FLAGS = {
    "nodes": 1,
    "gpus_per_node": 8,
    "tp": 1,
    "pp": 1,
    "vpp": None,
    "sp": False,
    "cp": 1,
    "ep": 1,
    "etp": None,
    "seq_length": 4096,
    "micro_batch_size": 1,
    "global_batch_size": 256,
    "rollout_tp": 1,
    "rollout_memory_fraction": 0.5,
    "critic": False,
    "reference": False,
    "lora_rank": 0,
    "fp32": False,
}

_FLAG_HELP = {
    "cp": "context-parallel size: every sequence split over this many GPUs (default 1)",
    "ep": "expert-parallel size, mixture-of-experts models (default 1)",
    "etp": "expert tensor-parallel size, mixture-of-experts models (default: --tp)",
    "lora_rank": "LoRA adapters of this rank on every linear (all-linear); default 0: full fine-tune",
}

EXIT_STATUS = "exit status: 0 fits, 1 DOES NOT FIT (a smaller layout that fits is proposed), 2 bad input"
"""Also the ``--help`` epilog. Bad input is 2 here, not 1 as elsewhere in ``mcore-rl``: 1 means "does not
fit", and a script must tell the two apart."""


DEFAULT_GPU = "A100-80"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.add_argument("recipe", nargs="?", help="run recipe (YAML); omit to give the layout as flags")
    parser.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides of the recipe")
    parser.add_argument(
        "--gpu", default=None, choices=sorted(GPU_MEMORY_BYTES), help=f"GPU model (default {DEFAULT_GPU})"
    )
    parser.add_argument(
        "--recompute",
        default=None,
        choices=RECOMPUTE_MODES,
        help="activation recompute (default: model.recompute)",
    )
    parser.add_argument("--model-config", help="HF config.json (instead of the recipe's model.path)")
    parser.add_argument("--no-flash-attention", action="store_true", help="attention stores s x s scores")
    parser.add_argument("--no-propose", action="store_true", help="skip the search for a fitting layout")
    parser.add_argument(
        "--margin",
        type=float,
        default=MARGIN_FRACTION,
        help=f"share of usable GPU memory a recommended layout leaves free (default {MARGIN_FRACTION})",
    )
    parser.add_argument(
        "--self-check",
        action="store_true",
        help="under torchrun: build the training engine at this layout and compare every rank's tensor bytes",
    )
    flags = parser.add_argument_group("layout without a recipe")
    for name, default in _LAYOUT_FLAGS.items():
        option = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            flags.add_argument(option, action="store_true", default=None)
        else:
            kind = float if isinstance(default, float) else int
            help_text = _FLAG_HELP.get(name, f"default {default}")
            flags.add_argument(option, type=kind, default=None, help=help_text)


def run(args: argparse.Namespace) -> int:
    try:
        if not 0 <= args.margin < 1:
            raise PlanError(f"--margin must be a fraction in [0, 1), got {args.margin}")
        plan = _plan_from_recipe(args) if args.recipe else _plan_from_flags(args)
        if args.self_check:
            from mcore_rl.planner.selfcheck import run_self_check

            return run_self_check(plan)
        result = plan_memory(plan)
    except (PlanError, ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    proposal = recommended = None
    if not args.no_propose:
        proposal = None if result.fits else smallest_fitting_layout(plan)
        if not has_margin(result, args.margin):  # a tight fit gets a safer layout on the same GPUs too
            recommended = recommended_layout(plan, args.margin)
    if args.gpu is None:  # the GPU decides the verdict: say which one was assumed
        print(f"gpu: {DEFAULT_GPU} assumed (--gpu names yours: {', '.join(sorted(GPU_MEMORY_BYTES))})")
    print(format_plan(result, proposal, not args.no_propose, recommended, args.margin))
    return 0 if result.fits else 1


def _common(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "gpu": args.gpu or DEFAULT_GPU,
        **({} if args.recompute is None else {"recompute": args.recompute}),
        "flash_attention": not args.no_flash_attention,
    }


def _plan_from_flags(args: argparse.Namespace) -> PlanInput:
    if not args.model_config:
        raise PlanError("--model-config is required without a recipe")
    if args.overrides:
        raise PlanError(f"key=value overrides {args.overrides} need a recipe")
    given = {name: getattr(args, name) for name in _LAYOUT_FLAGS}
    values: dict[str, Any] = {
        name: default if given[name] is None else given[name] for name, default in _LAYOUT_FLAGS.items()
    }
    return PlanInput(
        arch=ModelArch.from_hf_config(args.model_config),
        world_size=values.pop("nodes") * values["gpus_per_node"],
        bf16=not values.pop("fp32"),
        **values,
        **_common(args),
    )


def _plan_from_recipe(args: argparse.Namespace) -> PlanInput:
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.planner.from_config import plan_input_from_config

    recipe, overrides = args.recipe, list(args.overrides)
    if "=" in recipe:
        raise PlanError(f"{recipe!r} looks like an override; give the recipe first")
    layout_flags = [name for name in _LAYOUT_FLAGS if getattr(args, name) is not None]
    if layout_flags:
        flags = ", ".join("--" + name.replace("_", "-") for name in layout_flags)
        raise PlanError(f"{flags} cannot be combined with a recipe; override its keys with key=value")
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as err:
        raise PlanError(str(err)) from None
    try:
        arch = ModelArch.from_hf_config(args.model_config) if args.model_config else cfg.model.arch()
    except ConfigError as err:  # e.g. the recipe's /models/... folder is on the cluster, not here
        raise PlanError(
            f"{err}; plan reads only the model's config.json: point model.path=FOLDER at it, or give "
            "--model-config CONFIG.json"
        ) from None
    return plan_input_from_config(cfg, arch=arch, **_common(args))
