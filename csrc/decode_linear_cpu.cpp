// CPU kernels of decode_linear: add + x @ W for the few rows of a decode step (one token per sequence), W packed
// once, when the rollout loads its weights, as column panels (mcore_rl/ops/decode.py). The AVX2 kernel below
// runs everywhere; on CPUs with AVX-512F the op runs csrc/decode_linear_avx512.cpp instead, which reads the
// same panels twice as wide per instruction and gives bit-identical results (each output is the same FMA
// chain over k). MCORE_RL_DECODE_ISA=avx2 keeps the AVX2 kernel, to compare the two on one machine.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "decode_linear.h"

namespace mcore_rl {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

// MKL's sgemm re-packs the weight for every call, and with a handful of rows that packing costs about as much as
// the multiply. Here the weight is packed once, when it is loaded: panel p holds output columns
// [16p, 16p + 16) as a contiguous [K, 16] block (zero-padded past N), so a decode step streams each weight
// exactly once, sequentially. The panel stays in L1 while every 6-row block of x multiplies it with 12
// independent FMA accumulators.
constexpr int64_t kRowsPerBlock = 6;
constexpr int64_t kPanelCols = 16;

template <int MR>
void linear_block(const float* x, int64_t k_dim, const float* panel, const float* init, int64_t init_ld,
                  float* out, int64_t out_ld) {
  Vec acc[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2; ++v) acc[r][v] = init != nullptr ? Vec::loadu(init + r * init_ld + v * kVec) : Vec(0.0f);
  for (int64_t k = 0; k < k_dim; ++k) {
    // Spelled as loops over small arrays: GCC then keeps all 12 accumulators in registers (two named
    // Vec locals made it spill them on every k, at half the speed).
    Vec wk[2];
    for (int v = 0; v < 2; ++v) wk[v] = Vec::loadu(panel + k * kPanelCols + v * kVec);
    for (int r = 0; r < MR; ++r) {
      const Vec xk(x[r * k_dim + k]);
      for (int v = 0; v < 2; ++v) acc[r][v] = at::vec::fmadd(xk, wk[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2; ++v) acc[r][v].store(out + r * out_ld + v * kVec);
}

// All rows of x times one panel; init (the added rows, or null) and out point at the panel's first column.
void linear_panel(const float* x, int64_t rows, int64_t k_dim, const float* panel, const float* init,
                  int64_t init_ld, float* out, int64_t out_ld) {
  int64_t r = 0;
  for (; r + kRowsPerBlock <= rows; r += kRowsPerBlock) {
    linear_block<kRowsPerBlock>(x + r * k_dim, k_dim, panel, init ? init + r * init_ld : nullptr, init_ld,
                                out + r * out_ld, out_ld);
  }
  const float* x_rest = x + r * k_dim;
  const float* init_rest = init ? init + r * init_ld : nullptr;
  float* out_rest = out + r * out_ld;
  switch (rows - r) {
    case 5: linear_block<5>(x_rest, k_dim, panel, init_rest, init_ld, out_rest, out_ld); break;
    case 4: linear_block<4>(x_rest, k_dim, panel, init_rest, init_ld, out_rest, out_ld); break;
    case 3: linear_block<3>(x_rest, k_dim, panel, init_rest, init_ld, out_rest, out_ld); break;
    case 2: linear_block<2>(x_rest, k_dim, panel, init_rest, init_ld, out_rest, out_ld); break;
    case 1: linear_block<1>(x_rest, k_dim, panel, init_rest, init_ld, out_rest, out_ld); break;
    default: break;
  }
}

// The last panel when N is not a multiple of 16: staged through [rows, 16] buffers so that no load or store
// reaches past column N of `add` or `out`.
void linear_tail_panel(const float* x, int64_t rows, int64_t k_dim, const float* panel, const float* init,
                       int64_t init_ld, float* out, int64_t n_dim, int64_t first_col) {
  const int64_t width = n_dim - first_col;
  std::vector<float> staged_init(init ? rows * kPanelCols : 0, 0.0f), staged_out(rows * kPanelCols);
  for (int64_t r = 0; init != nullptr && r < rows; ++r) {
    std::memcpy(staged_init.data() + r * kPanelCols, init + r * init_ld + first_col, width * sizeof(float));
  }
  linear_panel(x, rows, k_dim, panel, init ? staged_init.data() : nullptr, init_ld ? kPanelCols : 0,
               staged_out.data(), kPanelCols);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out + r * n_dim + first_col, staged_out.data() + r * kPanelCols, width * sizeof(float));
  }
}

}  // namespace

bool use_avx512() {
  const char* isa = std::getenv("MCORE_RL_DECODE_ISA");
  return avx512_supported() && (isa == nullptr || std::strcmp(isa, "avx2") != 0);
}

at::Tensor decode_linear_cpu(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim,
                             const std::optional<at::Tensor>& add) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "x must be a contiguous fp32 [rows, columns] tensor");
  const int64_t rows = x.size(0), k_dim = x.size(1), num_panels = (n_dim + kPanelCols - 1) / kPanelCols;
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.is_contiguous() && panels.dim() == 3 &&
                  panels.size(0) == num_panels && panels.size(1) == k_dim && panels.size(2) == kPanelCols,
              "panels must be a contiguous fp32 [ceil(N / 16), K, 16] = [", num_panels, ", ", k_dim, ", 16]");
  int64_t init_ld = 0;  // 0: one row broadcast to every row (a bias)
  if (add.has_value()) {
    TORCH_CHECK(add->scalar_type() == at::kFloat && add->is_contiguous(), "add must be contiguous fp32");
    TORCH_CHECK((add->dim() == 1 && add->size(0) == n_dim) ||
                    (add->dim() == 2 && add->size(0) == rows && add->size(1) == n_dim),
                "add must be [N] or [rows, N]");
    init_ld = add->dim() == 2 ? n_dim : 0;
  }
  at::Tensor out = at::empty({rows, n_dim}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = panels.data_ptr<float>();
  const float* init = add.has_value() ? add->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t full_panels = n_dim / kPanelCols;
  const bool wide = use_avx512();
  const int64_t group = wide ? 2 : 1;  // panels per task: the AVX-512 kernel multiplies a pair at once
  at::parallel_for(0, (full_panels + group - 1) / group, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task * group, c = p * kPanelCols;
      const float* panel = wp + p * k_dim * kPanelCols;
      const float* first_init = init ? init + c : nullptr;
      if (wide) {
        linear_panels_avx512(xp, rows, k_dim, panel, std::min(group, full_panels - p), first_init, init_ld,
                             op + c, n_dim);
      } else {
        linear_panel(xp, rows, k_dim, panel, first_init, init_ld, op + c, n_dim);
      }
    }
  });
  if (full_panels < num_panels) {
    linear_tail_panel(xp, rows, k_dim, wp + full_panels * k_dim * kPanelCols, init, init_ld, op, n_dim,
                      full_panels * kPanelCols);
  }
  return out;
}

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) { m.impl("decode_linear", &decode_linear_cpu); }

}  // namespace mcore_rl
