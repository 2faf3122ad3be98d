// CUDA kernels of the fused vocab-parallel log-prob + entropy (maths in mcore_rl/ops/logprob.py).
// One thread block per row: each thread keeps an online (max, sum, wsum) over a strided slice of the row,
// then the block merges them. Reads each logit once in the stats pass and once in the backward.
#include <math.h>

#include "device_convert.h"
#include "kernels.h"

namespace mcore_rl_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// exp() is exactly 0 in fp32 below about -104; clamping there keeps 0 * (-inf) out of p * log p.
constexpr float kLogFloor = -200.0f;

// Softmax statistics relative to `max`: sum = sum e^(z - max), wsum = sum e^(z - max) (z - max) <= 0.
struct Stats {
  float max;
  float sum;
  float wsum;
};

__device__ __forceinline__ float clamp_log(float d) { return d < kLogFloor ? kLogFloor : d; }  // keeps NaN

// Statistics of the union of two disjoint column sets, rebased onto the larger max (every term <= 0).
__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  if (b.sum == 0.f) return a;
  if (a.sum == 0.f) return b;
  const float m = fmaxf(a.max, b.max);
  const float da = clamp_log(a.max - m), db = clamp_log(b.max - m);
  const float fa = expf(da), fb = expf(db);
  return {m, fa * a.sum + fb * b.sum, fa * (a.wsum + da * a.sum) + fb * (b.wsum + db * b.sum)};
}

__device__ __forceinline__ void add(Stats& acc, float z) {
  if (z == -INFINITY) return;  // a masked logit contributes nothing
  if (z > acc.max) {           // new running max: rebase what was summed so far
    if (acc.sum > 0.f) {
      const float d = clamp_log(acc.max - z), f = expf(d);
      acc.wsum = f * (acc.wsum + d * acc.sum);
      acc.sum *= f;
    }
    acc.max = z;
    acc.sum += 1.f;
  } else {
    const float d = clamp_log(z - acc.max), e = expf(d);
    acc.sum += e;
    acc.wsum += e * d;
  }
}

__device__ __forceinline__ Stats warp_reduce(Stats s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Stats other{__shfl_down_sync(0xffffffffu, s.max, offset), __shfl_down_sync(0xffffffffu, s.sum, offset),
                      __shfl_down_sync(0xffffffffu, s.wsum, offset)};
    s = merge(s, other);
  }
  return s;
}

// The merged statistics of the whole block, valid in thread 0.
__device__ __forceinline__ Stats block_reduce(Stats s) {
  __shared__ Stats per_warp[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  s = warp_reduce(s);
  if (lane == 0) per_warp[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? per_warp[lane] : Stats{-INFINITY, 0.f, 0.f};
    s = warp_reduce(s);
  }
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    stats_kernel(const T* logits, int64_t row_stride, int64_t n_valid, const int64_t* targets, int64_t vocab_start,
                 int64_t vocab_size, float inv_t, float* stats) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  Stats acc{-INFINITY, 0.f, 0.f};
  for (int64_t c = threadIdx.x; c < n_valid; c += kThreads) add(acc, to_float(x[c]) * inv_t);
  acc = block_reduce(acc);
  if (threadIdx.x != 0) return;
  const int64_t target = targets[row], local = target - vocab_start;
  float target_z = 0.f;
  if (target < 0 || target >= vocab_size) {
    target_z = NAN;  // kernels cannot raise: an invalid target poisons its row instead
  } else if (local >= 0 && local < n_valid) {
    target_z = to_float(x[local]) * inv_t;
  }
  float* out = stats + row * 4;
  out[0] = acc.max;
  out[1] = acc.sum;
  out[2] = acc.wsum;
  out[3] = target_z;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const float* grad_logprob, const float* grad_entropy, const T* logits, int64_t n_cols,
                    int64_t row_stride, int64_t n_valid, const int64_t* targets, const float* softmax_stats,
                    int64_t vocab_start, float inv_t, T* grad, int64_t grad_stride) {
  const int64_t row = blockIdx.x;
  const float lse = softmax_stats[2 * row], entropy = softmax_stats[2 * row + 1];
  const float g1 = grad_logprob[row], g2 = grad_entropy[row];
  const int64_t local = targets[row] - vocab_start;
  const T* x = logits + row * row_stride;
  T* g = grad + row * grad_stride;
  for (int64_t c = threadIdx.x; c < n_cols; c += kThreads) {
    float dz = 0.f;  // padding columns never entered the softmax
    if (c < n_valid) {
      const float log_p = clamp_log(to_float(x[c]) * inv_t - lse), p = expf(log_p);
      dz = -p * (g1 + g2 * (log_p + entropy));
      if (c == local) dz += g1;
      dz *= inv_t;
    }
    g[c] = from_float<T>(dz);
  }
}

int64_t valid_columns(int64_t vocab_start, int64_t vocab_size, int64_t n_cols) {
  const int64_t n = vocab_size - vocab_start;
  return n < 0 ? 0 : (n > n_cols ? n_cols : n);
}

template <typename T>
cudaError_t launch_stats(const void* logits, int64_t n_rows, int64_t n_cols, int64_t row_stride,
                         const int64_t* targets, int64_t vocab_start, int64_t vocab_size, float inv_t, float* stats,
                         cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  stats_kernel<T><<<static_cast<unsigned>(n_rows), kThreads, 0, stream>>>(
      static_cast<const T*>(logits), row_stride, valid_columns(vocab_start, vocab_size, n_cols), targets,
      vocab_start, vocab_size, inv_t, stats);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(const float* g1, const float* g2, const void* logits, int64_t n_rows, int64_t n_cols,
                            int64_t row_stride, const int64_t* targets, const float* softmax_stats,
                            int64_t vocab_start, int64_t vocab_size, float inv_t, void* grad, int64_t grad_stride,
                            cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  backward_kernel<T><<<static_cast<unsigned>(n_rows), kThreads, 0, stream>>>(
      g1, g2, static_cast<const T*>(logits), n_cols, row_stride, valid_columns(vocab_start, vocab_size, n_cols),
      targets, softmax_stats, vocab_start, inv_t, static_cast<T*>(grad), grad_stride);
  return cudaGetLastError();
}

}  // namespace
}  // namespace mcore_rl_cuda

extern "C" cudaError_t mcore_rl_logprob_stats_cuda(const void* logits, int dtype, int64_t n_rows, int64_t n_cols,
                                                   int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                                   int64_t vocab_size, float inv_temperature, float* stats,
                                                   cudaStream_t stream) {
  using namespace mcore_rl_cuda;
  switch (dtype) {
    case MCORE_RL_FLOAT32:
      return launch_stats<float>(logits, n_rows, n_cols, row_stride, targets, vocab_start, vocab_size,
                                 inv_temperature, stats, stream);
    case MCORE_RL_BFLOAT16:
      return launch_stats<__nv_bfloat16>(logits, n_rows, n_cols, row_stride, targets, vocab_start, vocab_size,
                                         inv_temperature, stats, stream);
    case MCORE_RL_FLOAT16:
      return launch_stats<__half>(logits, n_rows, n_cols, row_stride, targets, vocab_start, vocab_size,
                                  inv_temperature, stats, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t mcore_rl_logprob_entropy_backward_cuda(
    const float* grad_logprob, const float* grad_entropy, const void* logits, int dtype, int64_t n_rows,
    int64_t n_cols, int64_t row_stride, const int64_t* targets, const float* softmax_stats, int64_t vocab_start,
    int64_t vocab_size, float inv_temperature, void* grad_logits, int64_t grad_row_stride, cudaStream_t stream) {
  using namespace mcore_rl_cuda;
  switch (dtype) {
    case MCORE_RL_FLOAT32:
      return launch_backward<float>(grad_logprob, grad_entropy, logits, n_rows, n_cols, row_stride, targets,
                                    softmax_stats, vocab_start, vocab_size, inv_temperature, grad_logits,
                                    grad_row_stride, stream);
    case MCORE_RL_BFLOAT16:
      return launch_backward<__nv_bfloat16>(grad_logprob, grad_entropy, logits, n_rows, n_cols, row_stride,
                                            targets, softmax_stats, vocab_start, vocab_size, inv_temperature,
                                            grad_logits, grad_row_stride, stream);
    case MCORE_RL_FLOAT16:
      return launch_backward<__half>(grad_logprob, grad_entropy, logits, n_rows, n_cols, row_stride, targets,
                                     softmax_stats, vocab_start, vocab_size, inv_temperature, grad_logits,
                                     grad_row_stride, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
