# shellcheck shell=bash
# Environment for every mcore_rl process on a GPU node: sourced by torchrun.sh, local.sh and the Slurm
# templates (inside each node's command). Every variable keeps a value the user exported before, so a
# site can override any of them without editing this file. Sources: ../shared notes peer-integration §4.

# megatron's tensor/sequence-parallel layers issue their all-reduce / reduce-scatter before the GEMM
# that overlaps it; with one hardware queue the kernels run in issue order, so the communication really
# overlaps. On A100/H100 megatron asserts it when TP > 1 (leave it unset for torch FSDP2).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

# Without it c10d calls record_stream() on async-collective tensors and the caching allocator frees them
# only when a later allocation polls the NCCL stream: nondeterministic reuse and over-allocation (pytorch
# #147168). With it ProcessGroupNCCL holds the tensors until work.wait() instead.
export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"

# A collective that hangs (a dead peer, a rank that skipped it) becomes an error on every rank instead of
# a silent stall: the watchdog tears the process group down and the job fails where Slurm can see it.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# ... and dumps what each rank was waiting on when that happens, so the first failing rank is findable.
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"

# InfiniBand verbs timeout, 4.096 us * 2^N per retry: 19 is ~2.1 s, one notch above NCCL's old default,
# so a congested fabric retries instead of failing a long job.
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-19}"
# More queue pairs per connection spread one connection over more adaptive-routing paths.
export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-4}"
# 2 MiB network chunks for point-to-point traffic (pipeline-parallel send/recv of activations).
export NCCL_P2P_NET_CHUNKSIZE="${NCCL_P2P_NET_CHUNKSIZE:-2097152}"
# Site-specific, set only when the site says so (left unset here on purpose):
#   NCCL_IB_HCA=mlx5_0,...   which HCAs NCCL may use;  NCCL_IB_SL=<n>   the IB service level (QoS lane);
#   NCCL_SOCKET_IFNAME=<if>  the bootstrap interface;  NCCL_IB_GID_INDEX=3   RoCE instead of IB.

# Warnings only: INFO floods the per-node logs; set NCCL_DEBUG=INFO when debugging a hang.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# Tokenizers spawn their own thread pool in every rank and Ray worker; with dozens of processes per node
# that oversubscribes the cores (and forks after the pool exists deadlock).
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"

# Triton compiles into a per-node cache: a shared home directory on NFS races when nodes write at once.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache_${USER:-user}_${SLURM_NODEID:-0}}"
