"""``mcore-rl convert``: HF <-> megatron-core checkpoint conversion.

    mcore-rl convert hf-to-mcore --hf-dir DIR --out DIR [--tp N] [--pp M] [--ep E] [--etp T] [--dtype bf16|fp16|fp32]
                                 [--overwrite] [--allow-nonfinite]
    mcore-rl convert mcore-to-hf --ckpt DIR --out DIR [--hf-config-from DIR] [--dtype bf16|fp16|fp32]
                                 [--max-shard-size 5GB] [--overwrite] [--allow-nonfinite]
                                 [--merge-lora --base HF_DIR]     (LoRA: convert/peft.py)

Both also run as ``python -m mcore_rl.convert ...`` and under ``torchrun ... -m mcore_rl.convert``
(hf-to-mcore splits the writing over the ranks; mcore-to-hf runs on rank 0). Failures are reported by
``mcore_rl.cli.main`` in one line; flag values are checked here, before anything is read.
"""

from __future__ import annotations

import argparse
import os
import re

import torch

from mcore_rl.io.errors import UsageError
from mcore_rl.io.flags import positive_int

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors folder -> megatron distributed checkpoint")
    to_mcore.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, help="checkpoint folder to create")
    to_mcore.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel chunking (loads at any TP)"
    )
    to_mcore.add_argument(
        "--pp", type=positive_int, default=1, help="pipeline stages (splits writing under torchrun)"
    )
    to_mcore.add_argument(
        "--ep", type=positive_int, default=1, help="MoE: expert-parallel chunking (loads at any EP)"
    )
    to_mcore.add_argument(
        "--etp", type=positive_int, default=None, help="MoE: expert tensor-parallel chunking (default: --tp)"
    )
    to_hf = sub.add_parser("mcore-to-hf", help="megatron distributed checkpoint -> HF safetensors folder")
    to_hf.add_argument("--ckpt", required=True, help="megatron distributed checkpoint folder")
    to_hf.add_argument("--out", required=True, help="HF folder to create")
    to_hf.add_argument(
        "--hf-config-from", default=None, help="HF folder with the model's config.json and tokenizer files"
    )
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MiB")
    to_hf.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA: --ckpt (a LoRA run checkpoint or a PEFT folder) merged into --base; without it a LoRA "
        "run checkpoint is written as a PEFT adapter folder",
    )
    to_hf.add_argument("--base", default=None, help="LoRA: the base model's HF folder (with --merge-lora)")
    for command in (to_mcore, to_hf):
        command.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the input's dtype)")
        command.add_argument(
            "--overwrite", action="store_true", help="replace an existing non-empty --out (never an input)"
        )
        command.add_argument(
            "--allow-nonfinite",
            action="store_true",
            help="convert weights holding NaN/Inf with a warning (default: refuse them)",
        )


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name.lower() not in DTYPES:
        raise UsageError(f"--dtype {name!r} is not a known dtype; use bf16, fp16 or fp32")
    return DTYPES[name.lower()]


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if match is None or int(float(match.group(1)) * _UNITS[match.group(2) or ""]) < 1:
        raise UsageError(f"--max-shard-size {text!r} is not a size like 5GB or 500MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def run(args: argparse.Namespace) -> int:
    from mcore_rl.parallel.launch_env import current_rank

    out = _convert(args)
    if current_rank() == 0:  # one line per job, not per torchrun rank
        print(f"wrote {out}")
        if (
            args.direction == "hf-to-mcore"
        ):  # what it is for in RL (README: a megatron checkpoint as model.path)
            print(f"use it: mcore-rl train RECIPE model.path={out} (each rank reads only its own shards)")
        elif os.path.isfile(os.path.join(out, "adapter_config.json")):  # a LoRA run checkpoint's adapters
            print(f"use it: peft.PeftModel.from_pretrained(base, {out!r}), or model.lora_adapter_path={out}")
        else:
            print(f"use it: mcore-rl eval {out} DATA, or transformers' from_pretrained({out!r})")
    return 0


def _convert(args: argparse.Namespace) -> str:
    dtype = parse_dtype(args.dtype)
    if args.direction == "hf-to-mcore":
        from mcore_rl.convert.hf_to_mcore import HfToMcoreOptions, convert_hf_to_mcore

        return convert_hf_to_mcore(
            HfToMcoreOptions(
                args.hf_dir,
                args.out,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                etp=args.etp,
                dtype=dtype,
                overwrite=args.overwrite,
                allow_nonfinite=args.allow_nonfinite,
            )
        )
    lora = _lora(args, dtype)
    if lora is not None:
        return lora
    from mcore_rl.convert.mcore_to_hf import McoreToHfOptions, convert_mcore_to_hf

    options = McoreToHfOptions(
        args.ckpt,
        args.out,
        args.hf_config_from,
        dtype,
        parse_size(args.max_shard_size),
        args.overwrite,
        args.allow_nonfinite,
    )
    return convert_mcore_to_hf(options)


def _lora(args: argparse.Namespace, dtype: torch.dtype | None) -> str | None:
    """``mcore-to-hf`` of a LoRA checkpoint (``convert/peft.py``): the PEFT folder, or with ``--merge-lora`` the
    merged model; None for a plain model checkpoint."""
    from mcore_rl.convert.peft import export_peft, is_lora_checkpoint, is_peft_folder, merge_lora

    lora = is_lora_checkpoint(args.ckpt) if os.path.isdir(args.ckpt) else False
    if args.base is not None and not args.merge_lora:
        raise UsageError("--base names the model to merge into: it goes with --merge-lora")
    if not args.merge_lora and lora and is_peft_folder(args.ckpt):  # export_peft reads run checkpoints only
        raise UsageError(
            f"--ckpt {args.ckpt} is a PEFT adapter folder already; to merge it into its model, add "
            "--merge-lora --base HF_DIR"
        )
    if not args.merge_lora:
        return export_peft(args.ckpt, args.out, args.overwrite, dtype, args.allow_nonfinite) if lora else None
    if not lora:
        raise UsageError(
            f"--merge-lora: --ckpt {args.ckpt} is neither a LoRA run checkpoint nor a PEFT folder"
        )
    if args.base is None:
        raise UsageError("--merge-lora needs --base, the HF folder of the model the adapters were trained on")
    return merge_lora(
        args.ckpt,
        args.base,
        args.out,
        dtype,
        parse_size(args.max_shard_size),
        args.overwrite,
        args.allow_nonfinite,
    )
