// CPU kernels of causal attention over shared-prompt rows (mcore_rl/ops/row_attention.py), forward and
// backward, fp32. Packed tokens q [T, heads, d], k / v [T, kv_heads, d] are read in row layout through
// `source` [rows * row_len] (the packed token at each row position), and each token's output is its home row
// position's (`home` [T]). The semantics and the pure-PyTorch oracle are row_attention_reference there.
//
// Why a kernel: the reference gathers q, k and v into [rows, heads, row_len, d] copies, runs torch's fused
// attention on every row position (a shared prompt's queries once per row of its group) and gathers the
// outputs back, with a scatter-add per gather in backward. For rows of a few dozen positions and head_dim 32,
// those passes and the fused kernel's block set-up cost several times the arithmetic. Here only each token's
// home query is computed, keys and values are read straight from the packed tensors, and every product is a
// small dense one (a chunk of a row's queries against the row's keys) on a register-blocked micro-kernel:
// - forward: one task per (row, KV head). The row's keys are gathered transposed and its values once for all
//   the group's query heads; each chunk of home queries runs scores -> causal softmax -> probabilities x
//   values, and saves its log-sum-exp.
// - backward: one task per (packed segment, KV head). A segment's rows read only that segment's tokens
//   (shared_prefix_packing packs a prompt's group as one segment), so each task owns its tokens' key and
//   value gradients and sums them without atomics. Probabilities are recomputed from the log-sum-exp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace mcore_rl {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kRows = 6;       // rows of a micro-kernel tile: 6 x 2 vectors of accumulators fit AVX2's registers
constexpr int64_t kChunk = 64;     // home queries per chunk: bounds the [chunk, row_len] score buffers
constexpr int64_t kColumns = 2 * kVec;

// c[r][0 : NV vectors] (+)= sum_k a(r, k) * b[k][0 : NV vectors] for r < MR, with a(r, k) = a[r * a_row + k *
// a_k]: each b vector is loaded once per k for all MR rows, and the MR x NV accumulators stay in registers.
template <int MR, int NV>
void tile(const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb, int64_t k_dim, float* c,
          int64_t ldc, bool accumulate) {
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? Vec::loadu(c + r * ldc + v * kVec) : Vec(0.0f);
  for (int64_t k = 0; k < k_dim; ++k) {
    Vec bk[NV];
    for (int v = 0; v < NV; ++v) bk[v] = Vec::loadu(b + k * ldb + v * kVec);
    for (int r = 0; r < MR; ++r) {
      const Vec ak(a[r * a_row + k * a_k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(ak, bk[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(c + r * ldc + v * kVec);
}

template <int MR>
void tile_row(const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb, int64_t k_dim, float* c,
              int64_t ldc, int64_t cols, bool accumulate) {
  int64_t col = 0;
  for (; col + kColumns <= cols; col += kColumns) {
    tile<MR, 2>(a, a_row, a_k, b + col, ldb, k_dim, c + col, ldc, accumulate);
  }
  for (; col + kVec <= cols; col += kVec) tile<MR, 1>(a, a_row, a_k, b + col, ldb, k_dim, c + col, ldc, accumulate);
  for (; col < cols; ++col) {  // a width that is not a multiple of the vector (an odd head_dim)
    for (int r = 0; r < MR; ++r) {
      float sum = accumulate ? c[r * ldc + col] : 0.0f;
      for (int64_t k = 0; k < k_dim; ++k) sum += a[r * a_row + k * a_k] * b[k * ldb + col];
      c[r * ldc + col] = sum;
    }
  }
}

// Rows [row, row + count) of c (count <= kRows) times `cols` columns, through the tile of that height.
void tile_rows(int64_t count, const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb,
               int64_t k_dim, float* c, int64_t ldc, int64_t cols, bool accumulate) {
  switch (count) {
    case 6: tile_row<6>(a, a_row, a_k, b, ldb, k_dim, c, ldc, cols, accumulate); break;
    case 5: tile_row<5>(a, a_row, a_k, b, ldb, k_dim, c, ldc, cols, accumulate); break;
    case 4: tile_row<4>(a, a_row, a_k, b, ldb, k_dim, c, ldc, cols, accumulate); break;
    case 3: tile_row<3>(a, a_row, a_k, b, ldb, k_dim, c, ldc, cols, accumulate); break;
    case 2: tile_row<2>(a, a_row, a_k, b, ldb, k_dim, c, ldc, cols, accumulate); break;
    case 1: tile_row<1>(a, a_row, a_k, b, ldb, k_dim, c, ldc, cols, accumulate); break;
    default: break;
  }
}

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// A [T, heads, d] tensor with unit stride along d (megatron hands the attention views of its QKV projection).
struct Heads {
  const float* data;
  int64_t token_stride, head_stride;
  const float* at(int64_t token, int64_t head) const { return data + token * token_stride + head * head_stride; }
};

Heads heads_of(const at::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1)}; }

// The maps and sizes shared by both directions (`source` and `home` already range-checked).
struct Rows {
  const int64_t* source;
  const int64_t* home;
  int64_t count, len, heads, kv_heads, head_dim;
  float scale;

  int64_t group() const { return heads / kv_heads; }
  bool is_home(int64_t row, int64_t i) const { return home[source[row * len + i]] == row * len + i; }
  // The row's home query positions, ascending. Every position before one of them is the row's.
  std::vector<int64_t> home_positions(int64_t row) const {
    std::vector<int64_t> out;
    for (int64_t i = 0; i < len; ++i) {
      if (is_home(row, i)) out.push_back(i);
    }
    return out;
  }
};

// dst[e * ld + j] = rows[j][e] for j < n, e < d (`rows[j]` points at position j's d floats): 8 x 8 blocks
// through registers where AVX2 is compiled in.
void transpose_rows(const float* const* rows, int64_t n, int64_t d, float* dst, int64_t ld) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2)
  for (; j + 8 <= n; j += 8) {
    int64_t e = 0;
    for (; e + 8 <= d; e += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[j + i] + e);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + (e + i) * ld + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (e + i + 4) * ld + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
    for (; e < d; ++e) {
      for (int i = 0; i < 8; ++i) dst[e * ld + j + i] = rows[j + i][e];
    }
  }
#endif
  for (; j < n; ++j) {
    for (int64_t e = 0; e < d; ++e) dst[e * ld + j] = rows[j][e];
  }
}

// One (row, KV head): its first n positions' keys (and values) transposed [d, ld], zero past n (score tiles
// read whole vectors of columns), and its keys or values as rows [n, d].
struct RowOperands {
  int64_t n = 0, ld = 0;
  std::vector<float> keys_t, values_t, rows;
  std::vector<const float*> pointers;

  void gather_t(const Heads& x, const int64_t* src, int64_t kv_head, int64_t d, std::vector<float>& out) {
    for (int64_t j = 0; j < n; ++j) pointers[j] = x.at(src[j], kv_head);
    out.resize(d * ld);
    transpose_rows(pointers.data(), n, d, out.data(), ld);
    for (int64_t e = 0; e < d; ++e) std::fill(out.data() + e * ld + n, out.data() + (e + 1) * ld, 0.0f);
  }

  // keys_t always; values_t when `values_t_of` is given; rows of `rows_of` (k or v).
  void gather(const Rows& r, int64_t row, int64_t count, const Heads& k, const Heads* v_t, const Heads& rows_of,
              int64_t kv_head) {
    const int64_t d = r.head_dim, *src = r.source + row * r.len;
    n = count, ld = round_up(std::max<int64_t>(count, 1), kColumns);
    pointers.resize(n);
    gather_t(k, src, kv_head, d, keys_t);
    if (v_t != nullptr) gather_t(*v_t, src, kv_head, d, values_t);
    rows.resize(n * d);
    for (int64_t j = 0; j < n; ++j) std::memcpy(rows.data() + j * d, rows_of.at(src[j], kv_head), d * sizeof(float));
  }
};

// out [m, width] = x [m, d] times transposed [d, ld] for queries at ascending positions `pos`: each tile of
// rows stops at the columns its last query sees.
void scores(const float* x, int64_t m, const int64_t* pos, int64_t d, const float* transposed, int64_t ld,
            float* out, int64_t width) {
  for (int64_t i = 0; i < m; i += kRows) {
    const int64_t count = std::min(kRows, m - i), cols = round_up(pos[i + count - 1] + 1, kColumns);
    tile_rows(count, x + i * d, d, 1, transposed, ld, d, out + i * width, width, cols, false);
  }
}

// out [m, d] (+)= p [m, width] times rows [*, d], each tile summing over the columns its last query sees.
void weighted_rows(const float* p, int64_t m, const int64_t* pos, int64_t width, const float* rows, int64_t d,
                   float* out, bool accumulate) {
  for (int64_t i = 0; i < m; i += kRows) {
    const int64_t count = std::min(kRows, m - i);
    tile_rows(count, p + i * width, width, 1, rows, d, pos[i + count - 1] + 1, out + i * d, d, d, accumulate);
  }
}

// out [n, d] += p^T x for p [m, width], x [m, d]: row j sums over the queries that see it (pos >= j).
void transposed_rows(const float* p, int64_t m, const int64_t* pos, int64_t width, const float* x, int64_t d,
                     int64_t n, float* out) {
  for (int64_t j = 0; j < n; j += kRows) {
    const int64_t count = std::min(kRows, n - j);
    const int64_t first = std::lower_bound(pos, pos + m, j) - pos;
    if (first == m) break;
    tile_rows(count, p + first * width + j, 1, width, x + first * d, d, m - first, out + j * d, d, d, true);
  }
}

void gather_head(const Heads& x, const std::vector<int64_t>& tokens, int64_t head, int64_t d, float* out) {
  for (size_t i = 0; i < tokens.size(); ++i) std::memcpy(out + i * d, x.at(tokens[i], head), d * sizeof(float));
}

void check_maps(const at::Tensor& source, const at::Tensor& home, int64_t tokens, int64_t rows, int64_t len) {
  for (const at::Tensor* t : {&source, &home}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "row_attention: source and home must be contiguous int64 vectors");
  }
  TORCH_CHECK(source.size(0) == rows * len, "row_attention: source must have rows * row_len entries");
  TORCH_CHECK(home.size(0) == tokens, "row_attention: home must have one entry per packed token");
  const int64_t *s = source.data_ptr<int64_t>(), *h = home.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(s, s + rows * len, [&](int64_t i) { return 0 <= i && i < tokens; }),
              "row_attention: source entries must be packed token indices");
  TORCH_CHECK(std::all_of(h, h + tokens, [&](int64_t i) { return 0 <= i && i < rows * len; }),
              "row_attention: home entries must be row positions");
}

Rows check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& source,
                  const at::Tensor& home, int64_t rows, int64_t len, double scale) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1,
                "row_attention: q, k and v must be fp32 [T, heads, d] with unit stride along d");
  }
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == tokens && k.size(2) == d,
              "row_attention: k and v must be [T, kv_heads, d] for q [T, heads, d]");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "row_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(rows >= 0 && len > 0, "row_attention: bad row shape");
  check_maps(source, home, tokens, rows, len);
  return {source.data_ptr<int64_t>(), home.data_ptr<int64_t>(), rows, len, heads, kv_heads, d,
          static_cast<float>(scale)};
}

// The largest of the first n entries (n > 0).
float row_max(const float* row, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) best = at::vec::maximum(best, Vec::loadu(row + j));
  if (j < n) best = at::vec::maximum(best, Vec::set(best, Vec::loadu(row + j), n - j));
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
}

// row[j] <- exp((row[j] - shift) * scale) for j < n, zero from n to width (a multiple of the vector); returns the
// sum. torch's fused CPU attention uses the same exp (exp_u20).
float exp_row(float* row, int64_t n, int64_t width, float shift, float scale) {
  const Vec vshift(shift), vscale(scale);
  Vec sum(0.0f);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) {
    const Vec e = ((Vec::loadu(row + j) - vshift) * vscale).exp_u20();
    e.store(row + j);
    sum = sum + e;
  }
  if (j < n) {
    const Vec e = Vec::set(Vec(0.0f), ((Vec::loadu(row + j) - vshift) * vscale).exp_u20(), n - j);
    e.store(row + j);
    sum = sum + e;
    j += kVec;
  }
  std::fill(row + j, row + width, 0.0f);
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// In place over s [m, width]: row i <- softmax numerator exp(scale * (s - max)) over its pos[i] + 1 visible
// columns, zero past them; lse[i] = its log-sum-exp (of scale * s) and inv_sum[i] = 1 / its sum.
void causal_softmax(float* s, int64_t m, const int64_t* pos, int64_t width, float scale, float* lse, float* inv_sum) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = s + i * width;
    const int64_t n = pos[i] + 1;
    const float max = row_max(row, n);
    lse[i] = max * scale;
    inv_sum[i] = exp_row(row, n, width, max, scale);  // the sum, for now
  }
  at::vec::map2([](Vec shift, Vec sum) { return shift + sum.log(); }, lse, lse, inv_sum, m);
  at::vec::map([](Vec sum) { return Vec(1.0f) / sum; }, inv_sum, inv_sum, m);
}

// Buffers of one chunk of home queries of one head.
struct Chunk {
  std::vector<int64_t> pos, tokens;
  std::vector<float> x, y, s, t, lse, inv_sum, dot;
  explicit Chunk(int64_t len, int64_t d)
      : x(kChunk * d), y(kChunk * d), s(kChunk * round_up(len, kColumns)), t(kChunk * round_up(len, kColumns)),
        lse(kChunk), inv_sum(kChunk), dot(kChunk) {}
  // The chunk [first, first + kChunk) of the row's home positions.
  int64_t take(const Rows& r, int64_t row, const std::vector<int64_t>& home, size_t first) {
    const size_t end = std::min(home.size(), first + kChunk);
    pos.assign(home.begin() + first, home.begin() + end);
    tokens.resize(pos.size());
    for (size_t i = 0; i < pos.size(); ++i) tokens[i] = r.source[row * r.len + pos[i]];
    return static_cast<int64_t>(pos.size());
  }
};

void forward_row(const Rows& r, int64_t row, int64_t g, const Heads& q, const Heads& k, const Heads& v,
                 RowOperands& ops, Chunk& c, float* out, float* lse) {
  const std::vector<int64_t> home = r.home_positions(row);
  if (home.empty()) return;
  const int64_t d = r.head_dim;
  ops.gather(r, row, home.back() + 1, k, nullptr, v, g);
  for (size_t first = 0; first < home.size(); first += kChunk) {
    const int64_t m = c.take(r, row, home, first);
    for (int64_t h = g * r.group(); h < (g + 1) * r.group(); ++h) {
      gather_head(q, c.tokens, h, d, c.x.data());
      scores(c.x.data(), m, c.pos.data(), d, ops.keys_t.data(), ops.ld, c.s.data(), ops.ld);
      causal_softmax(c.s.data(), m, c.pos.data(), ops.ld, r.scale, c.lse.data(), c.inv_sum.data());
      weighted_rows(c.s.data(), m, c.pos.data(), ops.ld, ops.rows.data(), d, c.y.data(), false);
      for (int64_t i = 0; i < m; ++i) {
        float* dst = out + (c.tokens[i] * r.heads + h) * d;
        at::vec::map([s = c.inv_sum[i]](Vec x) { return x * Vec(s); }, dst, c.y.data() + i * d, d);
        lse[c.tokens[i] * r.heads + h] = c.lse[i];
      }
    }
  }
}

// -> (out [T, heads, d], lse [T, heads]); tokens that are no row's home query (filler) get zeros.
std::tuple<at::Tensor, at::Tensor> row_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& source, const at::Tensor& home, int64_t rows,
                                                     int64_t row_len, double scale) {
  const Rows r = check_inputs(q, k, v, source, home, rows, row_len, scale);
  at::Tensor out = at::zeros(q.sizes(), q.options());
  at::Tensor lse = at::zeros({q.size(0), r.heads}, q.options());
  const Heads qh = heads_of(q), kh = heads_of(k), vh = heads_of(v);
  float *out_ptr = out.data_ptr<float>(), *lse_ptr = lse.data_ptr<float>();
  at::parallel_for(0, rows * r.kv_heads, 1, [&](int64_t begin, int64_t end) {
    RowOperands ops;
    Chunk chunk(row_len, r.head_dim);
    for (int64_t task = begin; task < end; ++task) {
      forward_row(r, task / r.kv_heads, task % r.kv_heads, qh, kh, vh, ops, chunk, out_ptr, lse_ptr);
    }
  });
  return {out, lse};
}

struct Grads {
  Heads grad_out, out;
  const float* lse;
  float* dq;
};

// One row's share of its KV head's gradients: dq of its home queries directly, dk / dv [n, d] into row_dk /
// row_dv (in row positions, summed over the group's heads), for the caller to add to its tokens.
void backward_row(const Rows& r, int64_t row, int64_t g, const Heads& q, const Heads& k, const Heads& v,
                  const Grads& grads, RowOperands& ops, Chunk& c, std::vector<float>& row_dk,
                  std::vector<float>& row_dv) {
  const std::vector<int64_t> home = r.home_positions(row);
  const int64_t d = r.head_dim, n = home.empty() ? 0 : home.back() + 1;
  row_dk.assign(n * d, 0.0f);
  row_dv.assign(n * d, 0.0f);
  if (n == 0) return;
  ops.gather(r, row, n, k, &v, k, g);
  for (size_t first = 0; first < home.size(); first += kChunk) {
    const int64_t m = c.take(r, row, home, first);
    for (int64_t h = g * r.group(); h < (g + 1) * r.group(); ++h) {
      gather_head(q, c.tokens, h, d, c.x.data());
      gather_head(grads.grad_out, c.tokens, h, d, c.y.data());
      scores(c.x.data(), m, c.pos.data(), d, ops.keys_t.data(), ops.ld, c.s.data(), ops.ld);
      scores(c.y.data(), m, c.pos.data(), d, ops.values_t.data(), ops.ld, c.t.data(), ops.ld);
      for (int64_t i = 0; i < m; ++i) {  // p = exp(s * scale - lse); ds = p * (dp - dout . out) * scale
        const float lse = grads.lse[c.tokens[i] * r.heads + h];
        const float dot = at::vec::map2_reduce_all<float>([](Vec a, Vec b) { return a * b; },
                                                          [](Vec a, Vec b) { return a + b; }, c.y.data() + i * d,
                                                          grads.out.at(c.tokens[i], h), d);
        float *p = c.s.data() + i * ops.ld, *ds = c.t.data() + i * ops.ld;
        const int64_t visible = c.pos[i] + 1;
        exp_row(p, visible, ops.ld, lse / r.scale, r.scale);
        at::vec::map2([&](Vec pv, Vec dp) { return pv * (dp - Vec(dot)) * Vec(r.scale); }, ds, p, ds, visible);
        std::fill(ds + visible, ds + ops.ld, 0.0f);
      }
      transposed_rows(c.s.data(), m, c.pos.data(), ops.ld, c.y.data(), d, n, row_dv.data());
      transposed_rows(c.t.data(), m, c.pos.data(), ops.ld, c.x.data(), d, n, row_dk.data());
      weighted_rows(c.t.data(), m, c.pos.data(), ops.ld, ops.rows.data(), d, c.x.data(), false);  // dq
      for (int64_t i = 0; i < m; ++i) {
        std::memcpy(grads.dq + (c.tokens[i] * r.heads + h) * d, c.x.data() + i * d, d * sizeof(float));
      }
    }
  }
}

// The rows of each segment [starts[s], starts[s + 1]) that hold a home query: a row belongs to the segment of
// its first token, and must read only that segment's tokens (what lets a task own its tokens' gradients).
std::vector<std::vector<int64_t>> rows_by_segment(const Rows& r, const int64_t* starts, int64_t segments) {
  std::vector<std::vector<int64_t>> out(segments);
  for (int64_t row = 0; row < r.count; ++row) {
    const std::vector<int64_t> home = r.home_positions(row);
    if (home.empty()) continue;
    const int64_t* src = r.source + row * r.len;
    const int64_t s = std::upper_bound(starts, starts + segments + 1, src[0]) - starts - 1;
    TORCH_CHECK(s < segments && std::all_of(src, src + home.back() + 1,
                                            [&](int64_t t) { return starts[s] <= t && t < starts[s + 1]; }),
                "row_attention_backward: row ", row, " reads tokens outside its packed segment");
    out[s].push_back(row);
  }
  return out;
}

void check_backward(const Rows& r, const at::Tensor& q, const at::Tensor& grad_out, const at::Tensor& out,
                    const at::Tensor& lse, const at::Tensor& starts) {
  for (const at::Tensor* t : {&grad_out, &out}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == q.sizes() && t->stride(2) == 1,
                "row_attention_backward: grad_out and out must be fp32 like q");
  }
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == q.size(0) &&
                  lse.size(1) == r.heads,
              "row_attention_backward: lse must be contiguous fp32 [T, heads]");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.dim() == 1 && starts.size(0) >= 2,
              "row_attention_backward: segment_starts must be contiguous int64 [segments + 1]");
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t segments = starts.size(0) - 1;
  TORCH_CHECK(s[0] == 0 && std::is_sorted(s, s + segments + 1) && s[segments] <= q.size(0),
              "row_attention_backward: segment_starts must rise from 0 to at most T");
}

// -> (dq, dk, dv), contiguous, for grad_out [T, heads, d] of the forward's (out, lse).
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& source, const at::Tensor& home, const at::Tensor& segment_starts,
    int64_t rows, int64_t row_len, double scale) {
  const Rows r = check_inputs(q, k, v, source, home, rows, row_len, scale);
  check_backward(r, q, grad_out, out, lse, segment_starts);
  const int64_t segments = segment_starts.size(0) - 1, d = r.head_dim;
  const int64_t* starts = segment_starts.data_ptr<int64_t>();
  const std::vector<std::vector<int64_t>> members = rows_by_segment(r, starts, segments);
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options()), dv = at::zeros(v.sizes(), v.options());
  const Heads qh = heads_of(q), kh = heads_of(k), vh = heads_of(v);
  const Grads grads{heads_of(grad_out), heads_of(out), lse.data_ptr<float>(), dq.data_ptr<float>()};
  float *dk_ptr = dk.data_ptr<float>(), *dv_ptr = dv.data_ptr<float>();
  at::parallel_for(0, segments * r.kv_heads, 1, [&](int64_t begin, int64_t end) {
    RowOperands ops;
    Chunk chunk(row_len, d);
    std::vector<float> row_dk, row_dv;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / r.kv_heads, g = task % r.kv_heads;
      for (const int64_t row : members[s]) {
        backward_row(r, row, g, qh, kh, vh, grads, ops, chunk, row_dk, row_dv);
        for (int64_t j = 0; j < static_cast<int64_t>(row_dk.size()) / d; ++j) {  // rows -> their tokens
          const int64_t offset = (r.source[row * row_len + j] * r.kv_heads + g) * d;
          at::vec::map2([](Vec a, Vec b) { return a + b; }, dk_ptr + offset, dk_ptr + offset, row_dk.data() + j * d, d);
          at::vec::map2([](Vec a, Vec b) { return a + b; }, dv_ptr + offset, dv_ptr + offset, row_dv.data() + j * d, d);
        }
      }
    }
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_rl, m) {
  // Causal attention of packed q [T, heads, d], k / v [T, kv_heads, d] in row layout: row position p reads token
  // source[p] (rows x row_len positions), token t's output is row position home[t]'s. -> (out [T, heads, d],
  // lse [T, heads]).
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor source, Tensor home, int rows, int row_len, "
        "float scale) -> (Tensor, Tensor)");
  // Its backward: (dq, dk, dv); segment_starts [segments + 1] bounds the packed segments, whose rows read only
  // their own tokens.
  m.def("row_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor source, Tensor home, Tensor segment_starts, int rows, int row_len, float scale) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) {
  m.impl("row_attention", &row_attention_cpu);
  m.impl("row_attention_backward", &row_attention_backward_cpu);
}

}  // namespace mcore_rl
