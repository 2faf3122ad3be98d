// CPU kernels of the fused vocab-parallel log-prob + entropy; the maths is in mcore_rl/ops/logprob.py.
//
// Each row of the logits shard is streamed once, kBlock columns at a time: a block is upcast to fp32 and
// scaled by 1/T into a buffer that stays in L1 while its maximum is taken, then every element is
// exponentiated exactly once. The row's running statistics are rebased whenever the maximum grows (an
// online softmax at block granularity), so nothing of size [N, V] is written besides the caller's output.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace mcore_rl {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kBlock = 2048;  // 8 KiB of fp32: the block is read twice, so it must stay in L1
constexpr int64_t kStatsCols = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp() is exactly 0 in fp32 below about -104. Clamping log-space values at -200 changes no probability but
// keeps masked (-inf) logits from producing 0 * -inf = NaN in p * (z - max) and in the gradient.
constexpr float kLogFloor = -200.0f;

int64_t round_up(int64_t n) { return (n + kVec - 1) / kVec * kVec; }

float reduce_max(const Vec& v) {
  alignas(64) float lanes[kVec];
  v.store(lanes);
  float m = lanes[0];
  for (int64_t i = 1; i < kVec; ++i) m = std::isnan(lanes[i]) ? lanes[i] : std::max(m, lanes[i]);
  return m;
}

double reduce_sum(const Vec& v) {
  alignas(64) float lanes[kVec];
  v.store(lanes);
  double s = 0.0;
  for (int64_t i = 0; i < kVec; ++i) s += lanes[i];
  return s;
}

// Writes z = float(src) * inv_t for n columns into buf, pads buf with -inf up to whole vectors (so the
// vector loops need no tail), and returns the block's maximum (NaN if any z is NaN).
template <typename scalar_t>
float load_scaled(const scalar_t* src, int64_t n, float inv_t, float* buf) {
  const float* in = buf;
  if constexpr (std::is_same_v<scalar_t, float>) {
    in = src;
  } else {
    at::vec::convert(src, buf, n);  // bf16 / fp16 -> fp32
  }
  const Vec scale(inv_t);
  Vec vmax(kNegInf);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const Vec z = Vec::loadu(in + i) * scale;
    z.store(buf + i);
    vmax = at::vec::maximum(vmax, z);
  }
  const int64_t whole = i;  // the columns the vector loop has folded into vmax
  for (; i < n; ++i) buf[i] = in[i] * inv_t;
  for (int64_t j = n; j < round_up(n); ++j) buf[j] = kNegInf;
  // The tail (under kVec columns, padded with -inf) is one more vector: leaving it out of the maximum
  // dropped a block of fewer than kVec columns and overflowed exp where a tail logit led its block.
  if (whole < n) vmax = at::vec::maximum(vmax, Vec::loadu(buf + whole));
  return reduce_max(vmax);
}

// Running softmax statistics of one row, relative to its running maximum (double: they are updated once
// per block, so the precision is free).
struct RowStats {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0.0;   // sum exp(z - max)
  double wsum = 0.0;  // sum exp(z - max) * (z - max), <= 0
};

// Adds statistics taken relative to `max` to `acc`, rebasing both onto the larger maximum:
// sum e^(z-M) = e^(m-M) sum e^(z-m) and sum e^(z-M)(z-M) = e^(m-M) [sum e^(z-m)(z-m) + (m-M) sum e^(z-m)].
// Every term is <= 0, so the rebasing adds no cancellation.
void add_rebased(RowStats& acc, double max, double sum, double wsum) {
  if (sum == 0.0) return;  // only masked logits on that side
  if (acc.sum == 0.0) {
    acc = RowStats{max, sum, wsum};
    return;
  }
  const double m = std::max(acc.max, max);
  const double da = acc.max - m, db = max - m;
  const double fa = std::exp(da), fb = std::exp(db);
  acc.wsum = fa * (acc.wsum + da * acc.sum) + fb * (wsum + db * sum);
  acc.sum = fa * acc.sum + fb * sum;
  acc.max = m;
}

// Folds one loaded block (padded with -inf to `padded` columns) into the row statistics.
void fold_block(const float* buf, int64_t padded, float block_max, RowStats& acc) {
  if (block_max == kNegInf) return;  // every logit of the block is masked
  const Vec vmax(block_max), floor(kLogFloor);
  Vec sum(0.0f), wsum(0.0f);
  for (int64_t i = 0; i < padded; i += kVec) {
    const Vec d = at::vec::maximum(Vec::loadu(buf + i) - vmax, floor);
    const Vec e = d.exp();
    sum = sum + e;
    wsum = at::vec::fmadd(e, d, wsum);
  }
  add_rebased(acc, block_max, reduce_sum(sum), reduce_sum(wsum));
}

int64_t valid_columns(int64_t vocab_start, int64_t vocab_size, int64_t n_cols) {
  return std::clamp<int64_t>(vocab_size - vocab_start, 0, n_cols);
}

int64_t checked_target(const int64_t* targets, int64_t row, int64_t vocab_size) {
  const int64_t t = targets[row];
  TORCH_CHECK(t >= 0 && t < vocab_size, "mcore_rl: target id ", t, " of row ", row,
              " is outside [0, vocab_size=", vocab_size, "); targets must be real token ids");
  return t;
}

// Rows per parallel task: at least ~32k columns of work, so thread start-up stays negligible.
int64_t grain_rows(int64_t n_cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n_cols, 1)); }

template <typename scalar_t>
void stats_kernel(const at::Tensor& logits, const at::Tensor& targets, at::Tensor& stats,
                  int64_t vocab_start, int64_t vocab_size, float inv_t) {
  const int64_t n_rows = logits.size(0), row_stride = logits.stride(0);
  const int64_t n_valid = valid_columns(vocab_start, vocab_size, logits.size(1));
  const scalar_t* x = logits.const_data_ptr<scalar_t>();
  const int64_t* tgt = targets.const_data_ptr<int64_t>();
  float* out = stats.mutable_data_ptr<float>();
  at::parallel_for(0, n_rows, grain_rows(n_valid), [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = x + r * row_stride;
      RowStats acc;
      for (int64_t c = 0; c < n_valid; c += kBlock) {
        const int64_t n = std::min(kBlock, n_valid - c);
        const float block_max = load_scaled(row + c, n, inv_t, buf);
        fold_block(buf, round_up(n), block_max, acc);
      }
      const int64_t local = checked_target(tgt, r, vocab_size) - vocab_start;
      float* o = out + r * kStatsCols;
      o[0] = static_cast<float>(acc.max);
      o[1] = static_cast<float>(acc.sum);
      o[2] = static_cast<float>(acc.wsum);
      o[3] = (local >= 0 && local < n_valid) ? static_cast<float>(row[local]) * inv_t : 0.0f;
    }
  });
}

// In place on a loaded block: dz = -p (g1 + g2 (log p + H)) / T with log p = z - lse; the target's
// +g1 / T is added by the caller. Derivation in mcore_rl/ops/logprob.py.
void grad_block(float* buf, int64_t padded, float lse, float entropy, float g1, float g2, float inv_t) {
  const Vec vlse(lse), vent(entropy), vg1(g1), vg2(g2), vneg_inv_t(-inv_t), floor(kLogFloor);
  for (int64_t i = 0; i < padded; i += kVec) {
    const Vec logp = at::vec::maximum(Vec::loadu(buf + i) - vlse, floor);
    const Vec p = logp.exp();
    (p * at::vec::fmadd(vg2, logp + vent, vg1) * vneg_inv_t).store(buf + i);
  }
}

template <typename scalar_t>
void store_block(const float* buf, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, buf, n * sizeof(float));
  } else {
    at::vec::convert(buf, dst, n);  // round to nearest even, as Tensor.to() does
  }
}

template <typename scalar_t>
void backward_kernel(const at::Tensor& grad_logprob, const at::Tensor& grad_entropy, const at::Tensor& logits,
                     const at::Tensor& targets, const at::Tensor& softmax_stats, int64_t vocab_start,
                     int64_t vocab_size, float inv_t, const at::Tensor& grad_logits) {
  const int64_t n_rows = logits.size(0), n_cols = logits.size(1);
  const int64_t n_valid = valid_columns(vocab_start, vocab_size, n_cols);
  const int64_t row_stride = logits.stride(0), grad_stride = grad_logits.stride(0);
  const scalar_t* x = logits.const_data_ptr<scalar_t>();
  scalar_t* gx = grad_logits.mutable_data_ptr<scalar_t>();
  const float* g1s = grad_logprob.const_data_ptr<float>();
  const float* g2s = grad_entropy.const_data_ptr<float>();
  const float* st = softmax_stats.const_data_ptr<float>();
  const int64_t* tgt = targets.const_data_ptr<int64_t>();
  at::parallel_for(0, n_rows, grain_rows(n_cols), [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t local = checked_target(tgt, r, vocab_size) - vocab_start;
      for (int64_t c = 0; c < n_valid; c += kBlock) {
        const int64_t n = std::min(kBlock, n_valid - c);
        load_scaled(x + r * row_stride + c, n, inv_t, buf);
        grad_block(buf, round_up(n), st[2 * r], st[2 * r + 1], g1s[r], g2s[r], inv_t);
        if (local >= c && local < c + n) buf[local - c] += g1s[r] * inv_t;
        store_block(buf, gx + r * grad_stride + c, n);
      }
      // Padding columns (global id >= vocab_size) never entered the softmax.
      std::fill(gx + r * grad_stride + n_valid, gx + r * grad_stride + n_cols, scalar_t(0));
    }
  });
}

void check_rows_input(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                      int64_t vocab_size, double inv_temperature) {
  TORCH_CHECK(logits.device().is_cpu() && targets.device().is_cpu(), "mcore_rl: CPU kernel given non-CPU tensors");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "mcore_rl: logits must be [N, V] with unit column stride");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous(),
              "mcore_rl: targets must be a contiguous int64 [N] matching logits");
  TORCH_CHECK(vocab_start >= 0 && vocab_size > 0, "mcore_rl: need vocab_start >= 0 and vocab_size > 0");
  TORCH_CHECK(inv_temperature > 0.0, "mcore_rl: inv_temperature must be > 0");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "mcore_rl: logits must be float32, bfloat16 or float16, got ", dtype);
}

void check_stats(const at::Tensor& t, int64_t n_rows, int64_t n_cols, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n_rows * n_cols &&
                  t.device().is_cpu(),
              "mcore_rl: ", name, " must be a contiguous float32 CPU tensor with ", n_rows * n_cols, " elements");
}

#define MCORE_RL_DISPATCH_LOGITS(TYPE, NAME, ...)                   \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                    \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)      \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

at::Tensor logprob_stats_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                             int64_t vocab_size, double inv_temperature) {
  check_rows_input(logits, targets, vocab_start, vocab_size, inv_temperature);
  at::Tensor stats = at::empty({logits.size(0), kStatsCols}, logits.options().dtype(at::kFloat));
  MCORE_RL_DISPATCH_LOGITS(logits.scalar_type(), "logprob_stats_cpu", [&] {
    stats_kernel<scalar_t>(logits, targets, stats, vocab_start, vocab_size, static_cast<float>(inv_temperature));
  });
  return stats;
}

void logprob_entropy_backward_cpu(const at::Tensor& grad_logprob, const at::Tensor& grad_entropy,
                                  const at::Tensor& logits, const at::Tensor& targets,
                                  const at::Tensor& softmax_stats, int64_t vocab_start, int64_t vocab_size,
                                  double inv_temperature, at::Tensor& grad_logits) {
  check_rows_input(logits, targets, vocab_start, vocab_size, inv_temperature);
  const int64_t n_rows = logits.size(0);
  check_stats(grad_logprob, n_rows, 1, "grad_logprob");
  check_stats(grad_entropy, n_rows, 1, "grad_entropy");
  check_stats(softmax_stats, n_rows, 2, "softmax_stats");
  TORCH_CHECK(grad_logits.sizes() == logits.sizes() && grad_logits.scalar_type() == logits.scalar_type() &&
                  grad_logits.stride(1) == 1 && grad_logits.device().is_cpu(),
              "mcore_rl: grad_logits must match logits in shape and dtype, with unit column stride");
  MCORE_RL_DISPATCH_LOGITS(logits.scalar_type(), "logprob_entropy_backward_cpu", [&] {
    backward_kernel<scalar_t>(grad_logprob, grad_entropy, logits, targets, softmax_stats, vocab_start, vocab_size,
                              static_cast<float>(inv_temperature), grad_logits);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) {
  m.impl("logprob_stats", &logprob_stats_cpu);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward_cpu);
}

}  // namespace mcore_rl
