// CUDA kernel of the reshard pack / unpack: many 2-D block copies with a cast, one launch. The host side
// (ops_bindings.cpp) resolves the copy table into addresses; see mcore_rl/ops/pack.py for the layouts.
#include "device_convert.h"
#include "kernels.h"

namespace mcore_rl_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridX = 4096;
constexpr int64_t kMaxGridY = 65535;

// blockIdx.y walks the copies, blockIdx.x and the threads stride over one copy's elements.
template <typename S, typename D>
__global__ void __launch_bounds__(kThreads) block_copy_kernel(const int64_t* blocks, int64_t num_blocks) {
  for (int64_t b = blockIdx.y; b < num_blocks; b += gridDim.y) {
    const int64_t* blk = blocks + 6 * b;
    const S* src = reinterpret_cast<const S*>(blk[0]);
    D* dst = reinterpret_cast<D*>(blk[1]);
    const int64_t cols = blk[3], src_stride = blk[4], dst_stride = blk[5], total = blk[2] * cols;
    const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += step) {
      const int64_t r = i / cols, c = i - r * cols;
      dst[r * dst_stride + c] = from_float<D>(to_float(src[r * src_stride + c]));
    }
  }
}

template <typename S, typename D>
cudaError_t launch(const int64_t* blocks, int64_t num_blocks, int64_t max_block_numel, cudaStream_t stream) {
  if (num_blocks == 0 || max_block_numel == 0) return cudaSuccess;
  int64_t grid_x = (max_block_numel + kThreads - 1) / kThreads;
  grid_x = grid_x < kMaxGridX ? grid_x : kMaxGridX;
  const int64_t grid_y = num_blocks < kMaxGridY ? num_blocks : kMaxGridY;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  block_copy_kernel<S, D><<<grid, kThreads, 0, stream>>>(blocks, num_blocks);
  return cudaGetLastError();
}

template <typename S>
cudaError_t launch_to(int dst_dtype, const int64_t* blocks, int64_t num_blocks, int64_t max_numel,
                      cudaStream_t stream) {
  switch (dst_dtype) {
    case MCORE_RL_FLOAT32:
      return launch<S, float>(blocks, num_blocks, max_numel, stream);
    case MCORE_RL_BFLOAT16:
      return launch<S, __nv_bfloat16>(blocks, num_blocks, max_numel, stream);
    case MCORE_RL_FLOAT16:
      return launch<S, __half>(blocks, num_blocks, max_numel, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace mcore_rl_cuda

extern "C" cudaError_t mcore_rl_block_copy_cuda(const int64_t* blocks, int64_t num_blocks, int64_t max_block_numel,
                                                int src_dtype, int dst_dtype, cudaStream_t stream) {
  using namespace mcore_rl_cuda;
  switch (src_dtype) {
    case MCORE_RL_FLOAT32:
      return launch_to<float>(dst_dtype, blocks, num_blocks, max_block_numel, stream);
    case MCORE_RL_BFLOAT16:
      return launch_to<__nv_bfloat16>(dst_dtype, blocks, num_blocks, max_block_numel, stream);
    case MCORE_RL_FLOAT16:
      return launch_to<__half>(dst_dtype, blocks, num_blocks, max_block_numel, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
