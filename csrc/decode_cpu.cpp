// CPU kernel of the rollout engine's decode step (one new token per sequence), fused: rotary on the new
// query and key heads, the key and value written into the KV cache, and grouped-query attention over the
// row's visible cache columns, all in fp32. The semantics (and the pure-PyTorch oracle) are in
// mcore_rl/ops/decode.py and mcore_rl/ops/reference.py.
//
// Why a kernel: at decode time every (sequence, KV head) pair is a 1 x L by L x head_dim product for each of
// its query heads. As batched GEMMs these run far below peak (MKL pays a per-matrix setup for matrices of
// a few rows), and the rotary and cache writes around them are a dozen tiny ATen ops per layer. Here one
// task per (sequence, KV head) reads each cached key and value once for all the query heads of its group,
// with vectorised FMAs along the cache columns (keys are stored transposed, [head_dim, max_len]) and along
// head_dim (values, [max_len, head_dim]).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Version.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "decode_linear.h"

namespace mcore_rl {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

// Non-interleaved rotary, as the decoder (and megatron) computes it: out = x * cos + swap_halves(x) * sin
// on the first `rot` dims, with `sin` already signed ([-sin, +sin] halves); the rest passes through.
void rotate(const float* x, const float* cos, const float* sin, int64_t rot, int64_t head_dim, float* out) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < rot; ++i) {
    const int64_t partner = i < half ? i + half : i - half;
    out[i] = x[i] * cos[i] + x[partner] * sin[i];
  }
  std::memcpy(out + rot, x + rot, (head_dim - rot) * sizeof(float));
}

// Register-blocked micro-kernels: H query heads x C vectors of cache columns (scores), or H heads x C vectors
// of head_dim (values), accumulated in registers over the whole reduction, so each cached key or value is
// loaded once per block and every FMA has an independent accumulator chain (H * C <= 8 keeps them, the loads
// and the broadcasts within AVX2's 16 registers).
template <int H, int C>
void score_block(const float* q, int64_t head_dim, const float* keys, int64_t ld, int64_t l, int64_t n,
                 float* scores) {
  Vec acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = Vec(0.0f);
  for (int64_t d = 0; d < head_dim; ++d) {
    // A line of this key row 16 floats past the next block's start (two blocks ahead for a four-head group's
    // 16-column blocks): a block reads one line from each of head_dim rows, ld apart, more concurrent streams
    // than the hardware prefetcher follows; fetched now, it arrives before its block. (Past the row's end it
    // lands in the next row or the cache's tail: a prefetch never faults.)
    __builtin_prefetch(keys + d * ld + l + C * kVec + 16);
    Vec k[C];
    for (int c = 0; c < C; ++c) k[c] = Vec::loadu(keys + d * ld + l + c * kVec);
    for (int h = 0; h < H; ++h) {
      const Vec qd(q[h * head_dim + d]);
      for (int c = 0; c < C; ++c) acc[h][c] = at::vec::fmadd(qd, k[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c].store(scores + h * n + l + c * kVec);
}

// scores[h][l] = sum_d q[h][d] * keys[d][l] for H heads and l in [0, n); keys rows are `ld` floats apart.
// Blocks narrow from 8 / H vectors down to one, so that a short row (a few dozen cache columns) still runs
// several independent FMA chains: one 8-column chain per block is latency-bound (each FMA waits for the last).
template <int H>
void score_heads(const float* q, int64_t head_dim, const float* keys, int64_t ld, int64_t n, float* scores) {
  constexpr int C = 8 / H;
  int64_t l = 0;
  for (; l + C * kVec <= n; l += C * kVec) score_block<H, C>(q, head_dim, keys, ld, l, n, scores);
  if constexpr (C > 4) {
    for (; l + 4 * kVec <= n; l += 4 * kVec) score_block<H, 4>(q, head_dim, keys, ld, l, n, scores);
  }
  if constexpr (C > 2) {
    for (; l + 2 * kVec <= n; l += 2 * kVec) score_block<H, 2>(q, head_dim, keys, ld, l, n, scores);
  }
  for (; l + kVec <= n; l += kVec) score_block<H, 1>(q, head_dim, keys, ld, l, n, scores);
  for (; l < n; ++l) {  // fewer than one vector of columns left (explicit FMAs: the AVX-512 kernel's bits)
    for (int h = 0; h < H; ++h) {
      float sum = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) sum = std::fma(q[h * head_dim + d], keys[d * ld + l], sum);
      scores[h * n + l] = sum;
    }
  }
}

void query_key_scores(const float* q, int64_t group, int64_t head_dim, const float* keys, int64_t ld,
                      int64_t n, float* scores) {
  int64_t h = 0;
  for (; h + 4 <= group; h += 4) score_heads<4>(q + h * head_dim, head_dim, keys, ld, n, scores + h * n);
  for (; h + 2 <= group; h += 2) score_heads<2>(q + h * head_dim, head_dim, keys, ld, n, scores + h * n);
  for (; h < group; ++h) score_heads<1>(q + h * head_dim, head_dim, keys, ld, n, scores + h * n);
}

// In place: row <- exp(row * scale - max) and returns 1 / sum (the caller folds it into the output).
float scaled_softmax_numerator(float* row, int64_t n, float scale) {
  at::vec::map([scale](Vec x) { return x * Vec(scale); }, row, row, n);
  const float max = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n);
  at::vec::map([max](Vec x) { return (x - Vec(max)).exp(); }, row, row, n);
  const float sum = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, row, n);
  return 1.0f / sum;
}

// context[h][d0 : d0 + C vectors] = inv_sum[h] * sum_l probs[h][l] * values[l][d0 : ...] for H heads.
template <int H, int C>
void value_block(const float* probs, const float* inv_sum, int64_t n, const float* values, int64_t head_dim,
                 int64_t d0, float* context) {
  Vec acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = Vec(0.0f);
  for (int64_t l = 0; l < n; ++l) {
    Vec v[C];
    for (int c = 0; c < C; ++c) v[c] = Vec::loadu(values + l * head_dim + d0 + c * kVec);
    for (int h = 0; h < H; ++h) {
      const Vec p(probs[h * n + l]);
      for (int c = 0; c < C; ++c) acc[h][c] = at::vec::fmadd(p, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) (acc[h][c] * Vec(inv_sum[h])).store(context + h * head_dim + d0 + c * kVec);
}

template <int H>
void value_heads(const float* probs, const float* inv_sum, int64_t n, const float* values, int64_t head_dim,
                 float* context) {
  constexpr int C = 8 / H;
  int64_t d = 0;
  for (; d + C * kVec <= head_dim; d += C * kVec) value_block<H, C>(probs, inv_sum, n, values, head_dim, d, context);
  if constexpr (C > 4) {  // narrowing blocks, as in score_heads
    for (; d + 4 * kVec <= head_dim; d += 4 * kVec) value_block<H, 4>(probs, inv_sum, n, values, head_dim, d, context);
  }
  if constexpr (C > 2) {
    for (; d + 2 * kVec <= head_dim; d += 2 * kVec) value_block<H, 2>(probs, inv_sum, n, values, head_dim, d, context);
  }
  for (; d + kVec <= head_dim; d += kVec) value_block<H, 1>(probs, inv_sum, n, values, head_dim, d, context);
  for (; d < head_dim; ++d) {  // head_dim not a multiple of the vector width
    for (int h = 0; h < H; ++h) {
      float sum = 0.0f;
      for (int64_t l = 0; l < n; ++l) sum = std::fma(probs[h * n + l], values[l * head_dim + d], sum);
      context[h * head_dim + d] = sum * inv_sum[h];
    }
  }
}

void weighted_values(const float* probs, const float* inv_sum, int64_t group, int64_t n, const float* values,
                     int64_t head_dim, float* context) {
  int64_t h = 0;
  for (; h + 2 <= group; h += 2) {
    value_heads<2>(probs + h * n, inv_sum + h, n, values, head_dim, context + h * head_dim);
  }
  for (; h < group; ++h) value_heads<1>(probs + h * n, inv_sum + h, n, values, head_dim, context + h * head_dim);
}

void check_inputs(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                  const at::Tensor& values, int64_t column, const std::optional<at::Tensor>& start,
                  int64_t num_heads) {
  for (const at::Tensor* t : {&qkv, &cos, &sin, &keys, &values}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "decode_attention: every tensor must be contiguous fp32");
  }
  TORCH_CHECK(qkv.dim() == 2 && keys.dim() == 4 && values.dim() == 4, "decode_attention: bad ranks");
  const int64_t batch = qkv.size(0), kv_heads = keys.size(1), head_dim = keys.size(2), max_len = keys.size(3);
  TORCH_CHECK(kv_heads > 0 && num_heads % kv_heads == 0, "num_heads must be a multiple of the KV heads");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv_heads) * head_dim, "qkv must be [b, (h + 2 kv) * head_dim]");
  TORCH_CHECK(keys.size(0) >= batch && values.size(0) >= batch, "the cache has fewer rows than the batch");
  TORCH_CHECK(values.size(1) == kv_heads && values.size(2) == max_len && values.size(3) == head_dim,
              "values must be [rows, kv, max_len, head_dim] matching keys [rows, kv, head_dim, max_len]");
  TORCH_CHECK(0 <= column && column < max_len, "column ", column, " outside the cache (", max_len, ")");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && (cos.size(0) == 1 || cos.size(0) == batch),
              "cos / sin must be [b or 1, rotary_dim]");
  TORCH_CHECK(cos.size(1) <= head_dim && cos.size(1) % 2 == 0, "rotary_dim must be even and <= head_dim");
  if (start.has_value()) {
    TORCH_CHECK(start->scalar_type() == at::kLong && start->dim() == 1 && start->size(0) == batch &&
                    start->is_contiguous(),
                "start must be a contiguous int64 [b]");
  }
}

at::Tensor decode_attention_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& keys, at::Tensor& values, int64_t column,
                                const std::optional<at::Tensor>& start, int64_t num_heads, double scale) {
  check_inputs(qkv, cos, sin, keys, values, column, start, num_heads);
  const int64_t batch = qkv.size(0), kv_heads = keys.size(1), head_dim = keys.size(2), max_len = keys.size(3);
  const int64_t group = num_heads / kv_heads, rot = cos.size(1), width = qkv.size(1);
  const int64_t* first_visible = start.has_value() ? start->data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; first_visible != nullptr && r < batch; ++r) {
    TORCH_CHECK(0 <= first_visible[r] && first_visible[r] <= column, "start[", r, "] must be in [0, column]");
  }
  at::Tensor context = at::empty({batch, num_heads * head_dim}, qkv.options());
  const float *qkv_ptr = qkv.data_ptr<float>(), *cos_ptr = cos.data_ptr<float>(), *sin_ptr = sin.data_ptr<float>();
  float *key_ptr = keys.data_ptr<float>(), *value_ptr = values.data_ptr<float>();
  float* out_ptr = context.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const bool wide = use_avx512();  // the products on AVX-512 (csrc/decode_attention_avx512.cpp): same bits
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), scores(group * (column + 1)), inv_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const float* row = qkv_ptr + r * width;
      const float* c = cos_ptr + (cos.size(0) == 1 ? 0 : r) * rot;
      const float* s = sin_ptr + (cos.size(0) == 1 ? 0 : r) * rot;
      float* k_cache = key_ptr + (r * kv_heads + g) * head_dim * max_len;  // [head_dim, max_len]
      float* v_cache = value_ptr + (r * kv_heads + g) * max_len * head_dim;  // [max_len, head_dim]
      // The new token's key (rotated) and value go into cache column `column` first: it attends to itself.
      rotate(row + (num_heads + g) * head_dim, c, s, rot, head_dim, q.data());
      for (int64_t d = 0; d < head_dim; ++d) k_cache[d * max_len + column] = q[d];
      std::memcpy(v_cache + column * head_dim, row + (num_heads + kv_heads + g) * head_dim,
                  head_dim * sizeof(float));
      for (int64_t h = 0; h < group; ++h) {
        rotate(row + (g * group + h) * head_dim, c, s, rot, head_dim, q.data() + h * head_dim);
      }
      const int64_t first = first_visible != nullptr ? first_visible[r] : 0, n = column + 1 - first;
      float* context = out_ptr + r * num_heads * head_dim + g * group * head_dim;
      if (wide) {
        query_key_scores_avx512(q.data(), group, head_dim, k_cache + first, max_len, n, scores.data());
      } else {
        query_key_scores(q.data(), group, head_dim, k_cache + first, max_len, n, scores.data());
      }
      for (int64_t h = 0; h < group; ++h) inv_sum[h] = scaled_softmax_numerator(scores.data() + h * n, n, fscale);
      if (wide) {
        weighted_values_avx512(scores.data(), inv_sum.data(), group, n, v_cache + first * head_dim, head_dim, context);
      } else {
        weighted_values(scores.data(), inv_sum.data(), group, n, v_cache + first * head_dim, head_dim, context);
      }
    }
  });
  return context;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, name,
              " must be a contiguous fp32 [rows, columns] tensor");
}

// x * rsqrt(mean(x * x) + eps) * weight per row (torch.nn.RMSNorm), one pass to sum and one to scale.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == cols,
              "weight must be a contiguous fp32 [", cols, "]");
  at::Tensor out = at::empty_like(x);
  const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * cols;
      const float sum_sq = at::vec::map_reduce_all<float>([](Vec v) { return v * v; },
                                                          [](Vec a, Vec b) { return a + b; }, row, cols);
      const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + static_cast<float>(eps));
      at::vec::map2([inv_rms](Vec v, Vec g) { return v * Vec(inv_rms) * g; }, dst + r * cols, row, w, cols);
    }
  });
  return out;
}

// The columns of a row that ATen's elementwise loops leave to their scalar code: they run two vectors at a
// time and the remainder one element at a time, with std::exp where the vectors use Sleef's. So the vector
// width of the kernels ATen dispatches to on this CPU (not of this build) decides which columns those are.
// ATen's DEFAULT build spells its vectors as arrays of scalars, std::exp included: all scalar here.
int64_t aten_scalar_tail(int64_t width) {
  static const std::string capability = at::get_cpu_capability();
  if (capability == "DEFAULT") return width;
  return width % (capability == "AVX512" ? 32 : 16);
}

// [rows, 2f] = [gate | up] -> silu(gate) * up, [rows, f]; bitwise what ATen's F.silu(gate) * up computes
// (megatron's SwiGLU, so prefill and training may run it): the same vector formula, and the same scalar one
// on the columns ATen runs scalar (aten_scalar_tail).
at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t vector_cols = width - aten_scalar_tail(width);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * width;
      const float* up = gate + width;
      float* row = dst + r * width;
      at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.0f) + g.neg().exp()) * u; }, row, gate, up,
                    vector_cols);
      for (int64_t c = vector_cols; c < width; ++c) {
        const float silu = gate[c] / (1.0f + std::exp(-gate[c]));
        row[c] = silu * up[c];
      }
    }
  });
  return out;
}

// --- decode_layers: a whole decode step through the layers, one call (TP1) --------------------------------
// The same sequence of kernels the Python loop of RolloutDecoder.decode runs per layer, so the same results
// bit for bit, without ~10 Python-level op calls per layer and step: RMSNorm, QKV projection (+ bias), fused
// attention, output projection + residual, RMSNorm, gate/up projection, SiLU-gate, down projection + residual.
constexpr int64_t kPerLayer = 11;  // see the schema

// `packed`: empty, column panels (decode_linear), or MKL's packed GEMM operand (an MKL-DNN tensor from
// mkl::_mkl_reorder_linear_weight for `packed_rows` >= x's rows; fewer rows run zero-padded to that count), as
// RolloutDecoder._linear runs them.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight_t, const at::Tensor& packed,
                   const std::optional<at::Tensor>& add, int64_t packed_rows) {
  if (packed.is_mkldnn()) {
    static const auto mkl_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkl::_mkl_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                              int64_t)>();
    const int64_t rows = x.size(0);
    at::Tensor input = x;
    if (packed_rows > rows) {
      input = at::zeros({packed_rows, x.size(1)}, x.options());
      input.narrow(0, 0, rows).copy_(x);
    }
    at::Tensor out = mkl_linear.call(input, packed, weight_t.t(), std::nullopt, input.size(0)).narrow(0, 0, rows);
    return add.has_value() ? out.add_(*add) : out;
  }
  if (packed.numel() > 0) return decode_linear_cpu(x, packed, weight_t.size(1), add);
  return add.has_value() ? at::addmm(*add, x, weight_t) : at::mm(x, weight_t);
}

at::Tensor decode_layers_cpu(const at::Tensor& x_in, at::TensorList weights, at::TensorList keys,
                             at::TensorList values, const at::Tensor& cos, const at::Tensor& sin, int64_t column,
                             const std::optional<at::Tensor>& start, int64_t num_heads, double scale, double eps,
                             int64_t packed_rows) {
  const int64_t layers = static_cast<int64_t>(keys.size()), batch = x_in.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer && values.size() == keys.size(),
              "decode_layers: ", kPerLayer, " weights per layer and one key and value cache each");
  at::Tensor x = x_in;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    const std::optional<at::Tensor> bias = w[2].numel() > 0 ? std::optional<at::Tensor>(w[2]) : std::nullopt;
    at::Tensor k_cache = keys[l], v_cache = values[l];
    if (k_cache.size(0) != batch) k_cache = k_cache.narrow(0, 0, batch), v_cache = v_cache.narrow(0, 0, batch);
    const at::Tensor qkv = project(rms_norm_cpu(x, w[0], eps), w[3], w[4], bias, packed_rows);
    const at::Tensor context = decode_attention_cpu(qkv, cos, sin, k_cache, v_cache, column, start, num_heads, scale);
    x = project(context, w[5], w[6], x, packed_rows);
    const at::Tensor gate_up = project(rms_norm_cpu(x, w[1], eps), w[7], w[8], std::nullopt, packed_rows);
    x = project(silu_mul_cpu(gate_up), w[9], w[10], x, packed_rows);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_rl, m) {
  // The decode step's layers at TP1 (CPU only): x [b, hidden] through every layer; `weights` holds 11 tensors
  // per layer: input norm, post-attention norm, QKV bias (empty: none), then for the QKV, output, gate/up and
  // down projections each its [in, out] weight and its packed form (column panels, or MKL's packed operand for
  // packed_rows rows; empty: none); caches as in
  // decode_attention. Returns the hidden states before the final norm.
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor cos, Tensor sin, "
      "int column, Tensor? start, int num_heads, float scale, float eps, int packed_rows=0) -> Tensor");
}

// A decode step whose weights include MKL-packed operands dispatches on their MKL-DNN key: the same kernel.
TORCH_LIBRARY_IMPL(mcore_rl, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers_cpu); }

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) {
  m.impl("decode_layers", &decode_layers_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
}

}  // namespace mcore_rl
