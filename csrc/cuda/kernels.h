// C ABI of the CUDA kernels. The .cu files include only CUDA headers (no ATen / c10), so they compile with a
// bare nvcc against any torch build; csrc/cuda/ops_bindings.cpp (CUDA builds of torch only) turns tensors
// into these raw pointers and passes the current stream. Every launcher returns the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element types the kernels read and write.
enum McoreRlDtype { MCORE_RL_FLOAT32 = 0, MCORE_RL_BFLOAT16 = 1, MCORE_RL_FLOAT16 = 2 };

// stats [n_rows, 4] fp32 = (max z, sum e^(z-max), sum e^(z-max)(z-max), target z or 0) over the columns with
// global id < vocab_size, z = logits * inv_temperature. A target outside [0, vocab_size) yields NaN.
cudaError_t mcore_rl_logprob_stats_cuda(const void* logits, int dtype, int64_t n_rows, int64_t n_cols,
                                        int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                        int64_t vocab_size, float inv_temperature, float* stats,
                                        cudaStream_t stream);

// grad_logits = (g1 (1[v = y] - p_v) - g2 p_v (log p_v + H)) / T from softmax_stats [n_rows, 2] = (lse, H);
// padding columns get 0. grad_logits has the logits' dtype and its own row stride.
cudaError_t mcore_rl_logprob_entropy_backward_cuda(const float* grad_logprob, const float* grad_entropy,
                                                   const void* logits, int dtype, int64_t n_rows,
                                                   int64_t n_cols, int64_t row_stride, const int64_t* targets,
                                                   const float* softmax_stats, int64_t vocab_start,
                                                   int64_t vocab_size, float inv_temperature, void* grad_logits,
                                                   int64_t grad_row_stride, cudaStream_t stream);

// Runs num_blocks 2-D block copies with a cast. `blocks` is a device array [num_blocks, 6] of int64:
// (source address, destination address, rows, cols, source row stride, destination row stride), strides in
// elements of each side's dtype. max_block_numel sizes the grid.
cudaError_t mcore_rl_block_copy_cuda(const int64_t* blocks, int64_t num_blocks, int64_t max_block_numel,
                                     int src_dtype, int dst_dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
