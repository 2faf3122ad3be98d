#!/bin/bash
# torchrun for mcore_rl's SPMD tools on one node or many: every rank runs `mcore-rl SUBCOMMAND ARGS...`.
#
#   launch/torchrun.sh [--nnodes N] [--node-rank R] [--nproc-per-node G] [--master-addr A]
#                      [--master-port P] [--rdzv c10d] SUBCOMMAND [ARGS...]
#
#   launch/torchrun.sh convert hf-to-mcore --hf-dir /models/Llama-3.1-8B --out /ckpt/l8b --tp 8 --pp 1
#   launch/torchrun.sh plan --self-check recipes/llama3_8b_grpo_a100.yaml model.path=/models/Llama-3.1-8B
#                                 (builds the engine at the recipe's layout, checks the planner on every rank)
#   launch/torchrun.sh dpo recipes/dpo_demo_cpu.yaml      (DPO is SPMD; `train` and `sft` run under the Ray
#                                 driver instead: launch/local.sh, launch/ray_on_slurm.sbatch)
#
# Every option falls back to the environment, then to Slurm, then to one local node:
#   --nnodes          NNODES, SLURM_NNODES, 1
#   --node-rank       NODE_RANK, SLURM_NODEID, 0
#   --nproc-per-node  GPUS_PER_NODE, SLURM_GPUS_ON_NODE, the GPUs nvidia-smi lists, else 1 (CPU)
#   --master-addr     MASTER_ADDR, the first host of `scontrol show hostnames $SLURM_JOB_NODELIST`, 127.0.0.1
#   --master-port     MASTER_PORT, 29500
#   --rdzv c10d       elastic rendezvous at MASTER_ADDR:MASTER_PORT, id SLURM_JOB_ID (no node ranks needed)
# DRY_RUN=1 prints the command instead of running it. PYTHON picks the interpreter (default python3):
# `python -m torch.distributed.run`, not a bare `torchrun`, so the ranks use that interpreter's torch.
set -euo pipefail
LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/lib.sh
source "$LAUNCH_DIR/lib.sh"
# shellcheck source=launch/env.sh
source "$LAUNCH_DIR/env.sh"
help_on_request "$0" "$@"

nnodes=${NNODES:-${SLURM_NNODES:-1}}
node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}
nproc=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
master_addr=${MASTER_ADDR:-}
master_port=${MASTER_PORT:-29500}
rdzv=static
while (($#)); do
    case $1 in
        --nnodes) nnodes=$2 && shift 2 ;;
        --node-rank) node_rank=$2 && shift 2 ;;
        --nproc-per-node) nproc=$2 && shift 2 ;;
        --master-addr) master_addr=$2 && shift 2 ;;
        --master-port) master_port=$2 && shift 2 ;;
        --rdzv) rdzv=$2 && shift 2 ;;
        --) shift && break ;;
        -*) die "unknown option $1 ($0 --help lists them)" ;;
        *) break ;;
    esac
done
(($#)) || die "no mcore-rl subcommand given (e.g. convert hf-to-mcore ...)"

if [[ -z $nproc ]]; then
    nproc=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
    ((nproc > 0)) || nproc=1
fi
if [[ -z $master_addr ]]; then
    if ((nnodes > 1)); then
        master_addr=$(job_hostnames | head -n 1)
    else
        master_addr=127.0.0.1
    fi
fi
[[ $rdzv == static || $rdzv == c10d ]] || die "--rdzv must be static or c10d, got $rdzv"

cmd=("${PYTHON:-python3}" -m torch.distributed.run --nnodes="$nnodes" --nproc-per-node="$nproc")
if [[ $rdzv == c10d ]]; then
    cmd+=(--rdzv-backend=c10d --rdzv-endpoint="$master_addr:$master_port" --rdzv-id="${SLURM_JOB_ID:-mcore-rl}")
else
    cmd+=(--node-rank="$node_rank" --master-addr="$master_addr" --master-port="$master_port")
fi
cmd+=(-m mcore_rl.cli "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
    quote_cmd "${cmd[@]}"
    exit 0
fi
log_phase "node $node_rank/$nnodes: $(quote_cmd "${cmd[@]}")"
exec "${cmd[@]}"
