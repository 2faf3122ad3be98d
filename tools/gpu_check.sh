#!/usr/bin/env bash
# The device checks, run on a lent GPU machine with the `device` tool (never in CI; CPU machines run
# `make test`). One short script so that a 15-minute lease covers it with time to rerun:
#
#   1. build mcore_rl._C against that machine's CUDA torch (CUDA kernels of the log-prob and pack ops);
#   2. run the `gpu` tests (CUDA kernels vs references; the vLLM parity test skips where vLLM is absent).
#
# The device image has python3 3.12 with a CUDA torch but not megatron-core; prepare its wheel here first:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl megatron-core==0.16.1
# then: device run, carry [".whl"], command "bash tools/gpu_check.sh", timeout_s 540.
# UNVERIFIED: no session has had a device yet; expect to fix paths on the first run.
set -uo pipefail
out=${OUT:-/tmp}
exec > >(tee "$out/gpu_check.log") 2>&1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
echo "== build"
time python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import mcore_rl._C as c; assert c.WITH_CUDA, 'built without CUDA kernels'; print('CUDA kernels built')"
echo "== gpu tests"
python3 -m pytest tests/ops tests/rollout/test_vllm_engine.py -m gpu -q -p no:cacheprovider
