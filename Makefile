# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create .venv when missing and install into it; a second run reuses it.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mcore_rl-installed
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h)

export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-sweep lint install test-vllm trl-venv

install: $(STAMP)

$(STAMP): setup.py pyproject.toml $(NATIVE_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# On a machine without an NVIDIA driver take the local CPU wheel; any other torch spec pulls CUDA builds.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q ninja
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	# tests/launch lints the launch scripts with shellcheck (Debian packages it; best effort without root).
	command -v shellcheck >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq shellcheck) || true
	touch $(STAMP)

# The main job through the single-controller Ray driver.
demo: $(STAMP)
	$(PY) -m mcore_rl.cli train recipes/demo_cpu.yaml

# Lint and type checks gate the suite: CI runs exactly this target.
test: lint
	$(PY) -m pytest tests -m "not sweep"

# The widest generated matrices (e.g. every hybrid-engine feature x layout x rollout TP): minutes on 2 cores.
test-sweep: $(STAMP)
	$(PY) -m pytest tests -m sweep

# lint-imports holds the package's layers (pyproject.toml [tool.importlinter]): one way down, no cycles at any
# depth, Ray only in mcore_rl/controller/ (README "Layers").
lint: $(STAMP)
	$(VENV)/bin/ruff check mcore_rl tests bench
	$(VENV)/bin/ruff format --check mcore_rl tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo --no-cache

# Opt-in (not in `make test`, not in CI): our vLLM engine's contract against the real vLLM 0.33.0 on CPU.
# vLLM brings a CUDA build of torch 2.14.0 (~9.4 GB), so it lives in its own venv, built once; mcore_rl is
# imported from the source tree there (no native build: MCORE_RL_NO_NATIVE).
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.mcore_rl-vllm-installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm==0.33.0 megatron-core==0.16.1 pytest pytest-timeout
	MCORE_RL_NO_NATIVE=1 $(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest tests_vllm -p no:cacheprovider

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
