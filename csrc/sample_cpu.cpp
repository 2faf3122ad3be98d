// CPU kernel of the rollout's unfiltered sampling step (mcore_rl/engine/rollout/sampling.py, where the
// pure-PyTorch spelling is the reference and the fallback): per row of z [n, V] (logits / temperature), one
// token drawn from softmax(z) by inverting the CDF with the row's uniform number u, and its log-prob. The
// torch spelling is ~15 small ops per decode step (max, exp, a float64 cumsum, searchsorted, gathers); here
// one pass per row, same arithmetic: e = exp(z - max) in fp32, the CDF summed sequentially in float64, the
// first index whose CDF exceeds u * total, log-prob (z[token] - max) - log(total).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace mcore_rl {
namespace {

using Vec = at::vec::Vectorized<float>;

std::tuple<at::Tensor, at::Tensor> sample_unfiltered_cpu(const at::Tensor& z, const at::Tensor& u) {
  TORCH_CHECK(z.scalar_type() == at::kFloat && z.is_contiguous() && z.dim() == 2 && z.size(1) > 0,
              "z must be a contiguous fp32 [n, V] tensor");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == z.size(0),
              "u must be a contiguous float64 tensor of one number per row of z");
  const int64_t rows = z.size(0), vocab = z.size(1);
  at::Tensor tokens = at::empty({rows}, z.options().dtype(at::kLong));
  at::Tensor log_probs = at::empty({rows}, z.options());
  const float* in = z.data_ptr<float>();
  const double* draws = u.data_ptr<double>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* log_prob_out = log_probs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(vocab);
    std::vector<double> cdf(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * vocab;
      const float top =
          at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, vocab);
      at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, e.data(), row, vocab);
      double total = 0.0;
      for (int64_t j = 0; j < vocab; ++j) cdf[j] = total += static_cast<double>(e[j]);
      // searchsorted(right=True): the first index whose CDF exceeds the target (a zero-probability entry
      // never does: its CDF equals its predecessor's); the clamp guards u * total rounding up to total.
      const double target = draws[r] * total;
      const int64_t token = std::min<int64_t>(std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin(),
                                              vocab - 1);
      token_out[r] = token;
      log_prob_out[r] = static_cast<float>(static_cast<double>(row[token] - top) - std::log(total));
    }
  });
  return {tokens, log_probs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_rl, m) {
  // One token per row of z [n, V] fp32 drawn from softmax(z) with the row's uniform number u [n] float64, and
  // its log-prob: (tokens [n] int64, log_probs [n] fp32). CPU only.
  m.def("sample_unfiltered(Tensor z, Tensor u) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) { m.impl("sample_unfiltered", &sample_unfiltered_cpu); }

}  // namespace mcore_rl
