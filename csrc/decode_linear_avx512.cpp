// decode_linear's column-panel product with AVX-512 FMAs, chosen at run time on CPUs that have them.
//
// The panels are the same [ceil(N / 16), K, 16] blocks the AVX2 kernel in decode_linear_cpu.cpp reads, so one packed
// weight serves both; a panel's row k is exactly one 512-bit register. Each block multiplies two adjacent
// panels (32 output columns) by up to 12 rows of x: 24 accumulators, 2 weight registers and a broadcast fill
// 27 of the 32 registers, and every weight load feeds up to 12 FMAs. On a CPU with full-width AVX-512 units
// (AMD Zen 5, Intel server cores) that doubles the FMA rate of the 256-bit kernel, which at 16+ rows is
// what bounds a decode step's projections. Each output is the same FMA chain over k, in the same order, as
// the AVX2 kernel's, so both give bit-identical results. The functions carry their own target attribute,
// so this file builds with the rest of the extension's flags and its code runs only after the CPU check.
#include <immintrin.h>

#include <cstdint>

#include "decode_linear.h"

namespace mcore_rl {
namespace {

constexpr int64_t kCols = 16;      // a panel's width: one zmm register
constexpr int64_t kMaxRows = 12;   // rows per block: 2 x 12 accumulators + 2 weights + 1 broadcast <= 32 zmm

template <int MR, int NP>
__attribute__((target("avx512f"))) void panel_block(const float* x, int64_t k_dim, const float* panel,
                                                    int64_t panel_stride, const float* init, int64_t init_ld,
                                                    float* out, int64_t out_ld) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p)
      acc[r][p] = init != nullptr ? _mm512_loadu_ps(init + r * init_ld + p * kCols) : _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m512 w[NP];
    for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_ps(panel + p * panel_stride + k * kCols);
    for (int r = 0; r < MR; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * k_dim + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xk, w[p], acc[r][p]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + r * out_ld + p * kCols, acc[r][p]);
}

template <int NP>
__attribute__((target("avx512f"))) void panel_rows(const float* x, int64_t rows, int64_t k_dim, const float* panel,
                                                   int64_t panel_stride, const float* init, int64_t init_ld,
                                                   float* out, int64_t out_ld) {
  // Rows split into blocks of near-equal size (16 rows: 8 + 8, not 12 + 4), so no block runs half empty.
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  int64_t r = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t mr = (rows - r + (blocks - b) - 1) / (blocks - b);
    const float* xb = x + r * k_dim;
    const float* ib = init ? init + r * init_ld : nullptr;
    float* ob = out + r * out_ld;
    switch (mr) {
#define MCORE_RL_BLOCK(M) \
  case M: panel_block<M, NP>(xb, k_dim, panel, panel_stride, ib, init_ld, ob, out_ld); break;
      MCORE_RL_BLOCK(1) MCORE_RL_BLOCK(2) MCORE_RL_BLOCK(3) MCORE_RL_BLOCK(4) MCORE_RL_BLOCK(5)
      MCORE_RL_BLOCK(6) MCORE_RL_BLOCK(7) MCORE_RL_BLOCK(8) MCORE_RL_BLOCK(9) MCORE_RL_BLOCK(10)
      MCORE_RL_BLOCK(11) MCORE_RL_BLOCK(12)
#undef MCORE_RL_BLOCK
      default: break;
    }
    r += mr;
  }
}

}  // namespace

bool avx512_supported() {
  static const bool supported = __builtin_cpu_supports("avx512f");
  return supported;
}

void linear_panels_avx512(const float* x, int64_t rows, int64_t k_dim, const float* panels, int64_t count,
                          const float* init, int64_t init_ld, float* out, int64_t out_ld) {
  const int64_t stride = k_dim * kCols;
  if (count == 2) {
    panel_rows<2>(x, rows, k_dim, panels, stride, init, init_ld, out, out_ld);
  } else {
    panel_rows<1>(x, rows, k_dim, panels, stride, init, init_ld, out, out_ld);
  }
}

}  // namespace mcore_rl
