#!/bin/bash
# One node with a local Ray: `mcore-rl train RECIPE [key=value ...]` in the node's environment.
#
#   launch/local.sh recipes/demo_cpu.yaml trainer.total_training_steps=20
#   DRY_RUN=1 launch/local.sh recipes/llama3_8b_grpo_a100.yaml          (prints the command)
#
# The driver starts Ray inside itself (trainer.ray_address stays unset) with the CPUs this process may
# use (mcore_rl.controller.resources). On a GPU machine trainer.n_gpus_per_node is set to the GPUs
# nvidia-smi lists unless GPUS_PER_NODE says otherwise; on CPU the recipe's value (worker processes) stays.
# Written against `mcore-rl train` (the Ray driver); PYTHON picks the interpreter (default python3).
set -euo pipefail
LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/lib.sh
source "$LAUNCH_DIR/lib.sh"
# shellcheck source=launch/env.sh
source "$LAUNCH_DIR/env.sh"
help_on_request "$0" "$@"

(($#)) || die "usage: launch/local.sh RECIPE [key=value ...]"
recipe=$1
shift
# ray.init() joins whatever cluster RAY_ADDRESS names; a stale value from another job must not capture us.
unset RAY_ADDRESS

gpus=${GPUS_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)}
cmd=("${PYTHON:-python3}" -m mcore_rl.cli train "$recipe" trainer.nnodes=1)
if ((gpus > 0)); then cmd+=(trainer.n_gpus_per_node="$gpus"); fi
cmd+=("$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
    quote_cmd "${cmd[@]}"
    exit 0
fi
log_phase "local run: $(quote_cmd "${cmd[@]}")"
exec "${cmd[@]}"
