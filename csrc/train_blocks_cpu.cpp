// CPU kernels of the training blocks (mcore_rl/ops/train_blocks.py, where the pure-PyTorch references and the
// autograd wiring live): the SwiGLU and RMSNorm backwards and the rotary embedding (both directions), one pass
// over the activations each where the torch spelling takes four to six (each elementwise op reads and writes
// every activation again, and the halves of a [gate | up] tensor are strided views). fp32.
//
// The schemas are declared here, as a fragment of the mcore_rl library, next to their only kernels: these
// ops have no CUDA version (GPU runs use Transformer Engine's layers).
//
// No FMA contraction in this file: the rotary forward must equal megatron's bitwise, and megatron rounds the
// two products before adding them (GCC would otherwise fuse a * b - c * d into an FMA under -mfma).
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace mcore_rl {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, name,
              " must be a contiguous fp32 [rows, columns] tensor");
}

// d/d[gate | up] of silu(gate) * up, with s = sigmoid(gate): [grad * up * s * (1 + gate * (1 - s)) |
// grad * gate * s], the formula of torch's silu_backward.
void swiglu_grad(const float* grad, const float* gate, const float* up, float* grad_gate, float* grad_up,
                 int64_t n) {
  const Vec one(1.0f);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) {
    const Vec g = Vec::loadu(gate + j), u = Vec::loadu(up + j), d = Vec::loadu(grad + j);
    const Vec s = one / (one + g.neg().exp());
    (d * g * s).store(grad_up + j);
    (d * u * s * (one + g * (one - s))).store(grad_gate + j);
  }
  for (; j < n; ++j) {
    const float g = gate[j], s = 1.0f / (1.0f + std::exp(-g));
    grad_up[j] = grad[j] * g * s;
    grad_gate[j] = grad[j] * up[j] * s * (1.0f + g * (1.0f - s));
  }
}

// grad [rows, f], gate_up [rows, 2f] -> grad_gate_up [rows, 2f].
at::Tensor swiglu_backward_cpu(const at::Tensor& grad, const at::Tensor& gate_up) {
  check_rows(grad, "grad");
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * width && grad.size(0) == rows && grad.size(1) == width,
              "grad must be [rows, f] for gate_up [rows, 2f]");
  at::Tensor out = at::empty_like(gate_up);
  const float *g = grad.data_ptr<float>(), *in = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * width;
      float* grad_gate = dst + r * 2 * width;
      swiglu_grad(g + r * width, gate, gate + width, grad_gate, grad_gate + width, width);
    }
  });
  return out;
}

// y = x * r * w per row, r = rsqrt(mean(x^2) + eps). With gw = grad * w:
//   dx = r * gw - x * (r^3 * sum(gw * x) / h),   dw = sum over rows of grad * x * r.
// Each task sums its rows' dw into its own buffer row; the buffers are added at the end.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad, const at::Tensor& x,
                                                         const at::Tensor& weight, double eps) {
  check_rows(grad, "grad");
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(grad.size(0) == rows && grad.size(1) == cols, "grad must have the shape of x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == cols,
              "weight must be a contiguous fp32 [", cols, "]");
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor partial = at::zeros({at::get_num_threads(), cols}, x.options());
  const float *g = grad.data_ptr<float>(), *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *dx = grad_x.data_ptr<float>(), *dw_all = partial.data_ptr<float>();
  const float inv_cols = 1.0f / static_cast<float>(cols);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float* dw = dw_all + at::get_thread_num() * cols;
    for (int64_t r = begin; r < end; ++r) {
      const float *row = in + r * cols, *grow = g + r * cols;
      const float sum_sq = at::vec::map_reduce_all<float>([](Vec v) { return v * v; },
                                                          [](Vec a, Vec b) { return a + b; }, row, cols);
      const float inv_rms = 1.0f / std::sqrt(sum_sq * inv_cols + static_cast<float>(eps));
      const float dot = at::vec::map3_reduce_all<float>([](Vec a, Vec b, Vec c) { return a * b * c; },
                                                        [](Vec a, Vec b) { return a + b; }, grow, w, row, cols);
      const float coef = inv_rms * inv_rms * inv_rms * dot * inv_cols;
      const Vec rv(inv_rms), cv(coef);
      float* dx_row = dx + r * cols;
      int64_t j = 0;
      for (; j + kVec <= cols; j += kVec) {
        const Vec xv = Vec::loadu(row + j), gv = Vec::loadu(grow + j);
        (rv * gv * Vec::loadu(w + j) - xv * cv).store(dx_row + j);
        (Vec::loadu(dw + j) + gv * xv * rv).store(dw + j);
      }
      for (; j < cols; ++j) {
        dx_row[j] = inv_rms * grow[j] * w[j] - row[j] * coef;
        dw[j] += grow[j] * row[j] * inv_rms;
      }
    }
  });
  return {grad_x, partial.sum(0)};
}

// Non-interleaved rotary of one head, halves h = rot / 2: forward [x1 c1 - x2 s1 | x2 c2 + x1 s2]; inverse (its
// transpose, the backward) [x1 c1 + x2 s2 | x2 c2 - x1 s1]; dims past `rot` copied.
void rotate_head(const float* x, const float* cos, const float* sin, int64_t rot, int64_t head_dim, bool inverse,
                 float* out) {
  const int64_t half = rot / 2;
  const float *c1 = cos, *c2 = cos + half, *s1 = sin, *s2 = sin + half;
  const float *x1 = x, *x2 = x + half;
  int64_t j = 0;
  for (; j + kVec <= half; j += kVec) {
    const Vec a = Vec::loadu(x1 + j), b = Vec::loadu(x2 + j);
    const Vec ca = Vec::loadu(c1 + j), cb = Vec::loadu(c2 + j), sa = Vec::loadu(s1 + j), sb = Vec::loadu(s2 + j);
    (inverse ? a * ca + b * sb : a * ca - b * sa).store(out + j);
    (inverse ? b * cb - a * sa : b * cb + a * sb).store(out + half + j);
  }
  for (; j < half; ++j) {
    out[j] = inverse ? x1[j] * c1[j] + x2[j] * s2[j] : x1[j] * c1[j] - x2[j] * s1[j];
    out[half + j] = inverse ? x2[j] * c2[j] - x1[j] * s1[j] : x2[j] * c2[j] + x1[j] * s2[j];
  }
  for (j = rot; j < head_dim; ++j) out[j] = x[j];
}

// t [s, b, heads, d] (any strides, unit stride along d: megatron passes views of the QKV projection),
// cos / sin [s, rot] contiguous -> the rotated t, contiguous.
at::Tensor rope_cpu(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 4 && t.stride(3) == 1,
              "t must be an fp32 [s, b, heads, d] tensor with unit stride along d");
  const int64_t seq = t.size(0), batch = t.size(1), heads = t.size(2), head_dim = t.size(3);
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                    table->size(0) == seq && table->size(1) <= head_dim && table->size(1) % 2 == 0,
                "cos and sin must be contiguous fp32 [", seq, ", rot] with an even rot <= ", head_dim);
  }
  const int64_t rot = cos.size(1);
  TORCH_CHECK(sin.size(1) == rot, "cos and sin must have the same shape");
  at::Tensor out = at::empty({seq, batch, heads, head_dim}, t.options());
  const float *in = t.data_ptr<float>(), *c = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t s0 = t.stride(0), s1 = t.stride(1), s2 = t.stride(2);
  at::parallel_for(0, seq * batch * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pos = i / (batch * heads), b = (i / heads) % batch, h = i % heads;
      rotate_head(in + pos * s0 + b * s1 + h * s2, c + pos * rot, sn + pos * rot, rot, head_dim, inverse,
                  dst + i * head_dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_rl, m) {
  // d(silu(gate) * up)/d[gate | up] for gate_up [rows, 2f] and the output's gradient [rows, f].
  m.def("swiglu_backward(Tensor grad, Tensor gate_up) -> Tensor");
  // (d x, d weight) of x * rsqrt(mean(x^2, -1) + eps) * weight for x [rows, h].
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  // Non-interleaved rotary of t [s, b, heads, d] by per-position tables cos / sin [s, rot]; `inverse` applies
  // the transposed rotation (the backward).
  m.def("rope(Tensor t, Tensor cos, Tensor sin, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) {
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("rope", &rope_cpu);
}

}  // namespace mcore_rl
