// decode_attention's two products (query-key scores, probability-weighted values) with AVX-512 FMAs, chosen
// at run time on CPUs that have them (decode_cpu.cpp keeps the AVX2 ones and the softmax between).
//
// Why: a decode step's attention reads every cached key and value of a row once, and on one core the AVX2
// products ran at 13-14 GB/s where the core streams 41 GB/s from memory: they were bound by the core, not by
// memory (two threads ran exactly twice as fast). The values' product was the worse half (10-12 GB/s): a
// 256-bit kernel holds two heads x 32 dims per pass. Here a 512-bit register holds 16 cache columns or 16
// head dims, so a block covers 4 heads x 64 columns (scores) or 2 heads x 128 dims (values) in 16
// accumulators, and each key line is prefetched one block ahead (a block reads one line from each of
// head_dim rows, ld apart: more streams than the hardware prefetcher follows). Measured on an AMD EPYC
// (Zen 5), one core, realistic shapes (4 query heads per KV head, head_dim 64, 528 cache columns): scores
// 0.68 -> 0.52-0.56 ms per layer, values 1.4-1.5 -> 0.54-0.60 ms.
//
// Each score is the FMA chain over head_dim, and each context element the FMA chain over the cache columns,
// in the same order as the AVX2 kernels' (masked lanes for the tails), so both give bit-identical results.
// The functions carry their own target attribute, so this file builds with the extension's flags and its code
// runs only after the CPU check.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_linear.h"

namespace mcore_rl {
namespace {

constexpr int64_t kLanes = 16;  // floats per zmm register

__attribute__((target("avx512f"))) inline __mmask16 tail_mask(int64_t count) {
  return static_cast<__mmask16>((1u << count) - 1u);
}

// scores[h][l0 + j] for H heads and C registers of columns (the last one `last` lanes wide), the keys of
// row d at keys + d * ld.
template <int H, int C>
__attribute__((target("avx512f"))) void score_block(const float* q, int64_t head_dim, const float* keys, int64_t ld,
                                                    int64_t l0, __mmask16 last, int64_t n, float* scores) {
  __m512 acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const float* row = keys + d * ld + l0;
    // the next block's lines of this key row (past the row's end it lands in the next row or the cache's
    // tail: a prefetch never faults)
    for (int c = 0; c < C; ++c) __builtin_prefetch(row + (C + c) * kLanes);
    __m512 k[C];
    for (int c = 0; c + 1 < C; ++c) k[c] = _mm512_loadu_ps(row + c * kLanes);
    k[C - 1] = _mm512_maskz_loadu_ps(last, row + (C - 1) * kLanes);
    for (int h = 0; h < H; ++h) {
      const __m512 qd = _mm512_set1_ps(q[h * head_dim + d]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(qd, k[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    float* out = scores + h * n + l0;
    for (int c = 0; c + 1 < C; ++c) _mm512_storeu_ps(out + c * kLanes, acc[h][c]);
    _mm512_mask_storeu_ps(out + (C - 1) * kLanes, last, acc[h][C - 1]);
  }
}

// scores[h][l] for H heads, l in [0, n): blocks of C registers of columns, narrowing to one, then a masked
// register for the last n % 16 columns.
template <int H, int C>
__attribute__((target("avx512f"))) void score_heads(const float* q, int64_t head_dim, const float* keys, int64_t ld,
                                                    int64_t n, float* scores) {
  const __mmask16 full = 0xFFFF;
  int64_t l = 0;
  for (; l + C * kLanes <= n; l += C * kLanes) score_block<H, C>(q, head_dim, keys, ld, l, full, n, scores);
  if constexpr (C > 2) {
    for (; l + 2 * kLanes <= n; l += 2 * kLanes) score_block<H, 2>(q, head_dim, keys, ld, l, full, n, scores);
  }
  for (; l + kLanes <= n; l += kLanes) score_block<H, 1>(q, head_dim, keys, ld, l, full, n, scores);
  if (l < n) score_block<H, 1>(q, head_dim, keys, ld, l, tail_mask(n - l), n, scores);
}

// context[h][d0 : d0 + C registers] = inv_sum[h] * sum_l probs[h][l] * values[l][d0 : ...] for H heads (the
// last register `last` lanes wide).
template <int H, int C>
__attribute__((target("avx512f"))) void value_block(const float* probs, const float* inv_sum, int64_t n,
                                                    const float* values, int64_t head_dim, int64_t d0,
                                                    __mmask16 last, float* context) {
  __m512 acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    const float* row = values + l * head_dim + d0;
    __m512 v[C];
    for (int c = 0; c + 1 < C; ++c) v[c] = _mm512_loadu_ps(row + c * kLanes);
    v[C - 1] = _mm512_maskz_loadu_ps(last, row + (C - 1) * kLanes);
    for (int h = 0; h < H; ++h) {
      const __m512 p = _mm512_set1_ps(probs[h * n + l]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m512 scale = _mm512_set1_ps(inv_sum[h]);
    float* out = context + h * head_dim + d0;
    for (int c = 0; c + 1 < C; ++c) _mm512_storeu_ps(out + c * kLanes, _mm512_mul_ps(acc[h][c], scale));
    _mm512_mask_storeu_ps(out + (C - 1) * kLanes, last, _mm512_mul_ps(acc[h][C - 1], scale));
  }
}

template <int H>
__attribute__((target("avx512f"))) void value_heads(const float* probs, const float* inv_sum, int64_t n,
                                                    const float* values, int64_t head_dim, float* context) {
  const __mmask16 full = 0xFFFF;
  int64_t d = 0;
  for (; d + 8 * kLanes <= head_dim; d += 8 * kLanes) {
    value_block<H, 8>(probs, inv_sum, n, values, head_dim, d, full, context);
  }
  for (; d + 4 * kLanes <= head_dim; d += 4 * kLanes) {
    value_block<H, 4>(probs, inv_sum, n, values, head_dim, d, full, context);
  }
  for (; d + 2 * kLanes <= head_dim; d += 2 * kLanes) {
    value_block<H, 2>(probs, inv_sum, n, values, head_dim, d, full, context);
  }
  for (; d + kLanes <= head_dim; d += kLanes) value_block<H, 1>(probs, inv_sum, n, values, head_dim, d, full, context);
  if (d < head_dim) value_block<H, 1>(probs, inv_sum, n, values, head_dim, d, tail_mask(head_dim - d), context);
}

}  // namespace

void query_key_scores_avx512(const float* q, int64_t group, int64_t head_dim, const float* keys, int64_t ld,
                             int64_t n, float* scores) {
  int64_t h = 0;
  for (; h + 4 <= group; h += 4) score_heads<4, 4>(q + h * head_dim, head_dim, keys, ld, n, scores + h * n);
  for (; h + 2 <= group; h += 2) score_heads<2, 8>(q + h * head_dim, head_dim, keys, ld, n, scores + h * n);
  for (; h < group; ++h) score_heads<1, 8>(q + h * head_dim, head_dim, keys, ld, n, scores + h * n);
}

void weighted_values_avx512(const float* probs, const float* inv_sum, int64_t group, int64_t n,
                            const float* values, int64_t head_dim, float* context) {
  // Two heads per pass (up to 8 registers of dims for each, 16 accumulators): measured a little faster than
  // four heads at once; the second pass reads the row's values from L2.
  int64_t h = 0;
  for (; h + 2 <= group; h += 2) {
    value_heads<2>(probs + h * n, inv_sum + h, n, values, head_dim, context + h * head_dim);
  }
  for (; h < group; ++h) value_heads<1>(probs + h * n, inv_sum + h, n, values, head_dim, context + h * head_dim);
}

}  // namespace mcore_rl
