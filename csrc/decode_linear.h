// decode_linear (add + x @ W for a decode step's few rows, W packed as column panels): the op's entry point,
// shared with the fused decode step in decode_cpu.cpp, and the AVX-512 kernel it dispatches to.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace mcore_rl {

// The op (csrc/decode_linear_cpu.cpp): x [M, K] fp32, panels [ceil(n / 16), K, 16], add None, [n] or [M, n].
at::Tensor decode_linear_cpu(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim,
                             const std::optional<at::Tensor>& add);

// Whether this CPU runs AVX-512F (checked once).
bool avx512_supported();

// Whether the decode kernels run their AVX-512 code: on CPUs that have it, unless MCORE_RL_DECODE_ISA=avx2
// (read per call, a few ns against a product of at least microseconds, so a benchmark or test can switch
// within a run).
bool use_avx512();

// out[r, c] = init[r, c] (0 where init is null) + sum_k x[r, k] * W[k, c] over `count` (1 or 2) adjacent full
// column panels starting at `panels` ([K, 16] each, back to back) for every row of x [rows, k_dim]; `init`
// (row stride init_ld, 0: one row for all) and `out` point at the first panel's first column.
// AVX-512F code (csrc/decode_linear_avx512.cpp): call only where avx512_supported().
void linear_panels_avx512(const float* x, int64_t rows, int64_t k_dim, const float* panels, int64_t count,
                          const float* init, int64_t init_ld, float* out, int64_t out_ld);

// decode_attention's products (csrc/decode_attention_avx512.cpp; call only where avx512_supported()), the
// same results bit for bit as decode_cpu.cpp's AVX2 ones: scores[h][l] = sum_d q[h][d] * keys[d * ld + l]
// for the group's heads and l < n; context[h][:] = inv_sum[h] * sum_l probs[h][l] * values[l][:].
void query_key_scores_avx512(const float* q, int64_t group, int64_t head_dim, const float* keys, int64_t ld,
                             int64_t n, float* scores);
void weighted_values_avx512(const float* probs, const float* inv_sum, int64_t group, int64_t n,
                            const float* values, int64_t head_dim, float* context);

}  // namespace mcore_rl
