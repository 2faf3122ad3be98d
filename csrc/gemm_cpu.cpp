// gemm: add + a @ b in fp32 through oneDNN, the GEMM library torch already carries, for the CPUs where it
// beats ATen's own fp32 GEMM (mcore_rl/ops/gemm.py decides where).
//
// Why: ATen's fp32 GEMM is MKL's sgemm, and MKL picks its kernels by CPU vendor: on AMD CPUs with AVX-512 it
// runs its AVX2 code. oneDNN's AVX-512 kernels run on any vendor; measured 2026-12-06 on an AMD EPYC (Zen 5,
// two threads) at a rollout prefill's and a training step's shapes they reach 2.2-2.4x MKL's rate ([1024,
// 512] x [512, 2752]: 470 vs 200 GFLOP/s). torch itself calls oneDNN for fp32 products only when reduced
// precision (bf32, tf32) is allowed, so the full-fp32 path is reached through ATen's exported
// at::native::mkldnn_matmul, declared below since its header is not installed. The reference is weak: a
// torch without the symbol leaves it null, and the op then refuses with a message rather than failing to load.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>

namespace at::native {
// result = beta * result + alpha * mat1 @ mat2 (2-D, any strides): aten/src/ATen/native/mkldnn/Matmul.h
TORCH_API void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result, float beta,
                             float alpha) __attribute__((weak));
}  // namespace at::native

namespace mcore_rl {
namespace {

// Both ops' preconditions: oneDNN's matmul present, fp32 a [M, K] and b [K, N].
void check_operands(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(&at::native::mkldnn_matmul != nullptr, "gemm: this torch build exports no oneDNN matmul");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "gemm: a [M, K] and b [K, N] expected");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, "gemm: fp32 operands expected");
}

at::Tensor gemm_cpu(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& add) {
  check_operands(a, b);
  const int64_t rows = a.size(0), cols = b.size(1);
  TORCH_CHECK(!add.has_value() || (add->scalar_type() == at::kFloat &&
                                   ((add->dim() == 1 && add->size(0) == cols) ||
                                    (add->dim() == 2 && add->size(0) == rows && add->size(1) == cols))),
              "gemm: add must be fp32 [N] or [M, N]");
  if (rows == 0 || cols == 0 || a.size(1) == 0) {  // oneDNN leaves K = 0 unwritten and faults on M = 0
    at::Tensor out = at::zeros({rows, cols}, a.options());
    return add.has_value() ? out.add_(*add) : out;
  }
  if (!add.has_value()) {
    at::Tensor out = at::empty({rows, cols}, a.options());
    at::native::mkldnn_matmul(a, b, out, 0.0f, 1.0f);
    return out;
  }
  // The addend becomes the output and oneDNN accumulates onto it (beta = 1): no second pass to add it.
  at::Tensor out = add->expand({rows, cols}).contiguous();
  if (out.data_ptr() == add->data_ptr()) out = out.clone();  // never write into the caller's tensor
  at::native::mkldnn_matmul(a, b, out, 1.0f, 1.0f);
  return out;
}

// out = beta * out + a @ b in place (beta 0: overwritten, 1: accumulated), out a contiguous fp32 [M, N]: a
// weight gradient added into its gradient buffer, logits written into a reused block.
void gemm_into_cpu(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double beta) {
  check_operands(a, b);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == a.size(0) &&
                  out.size(1) == b.size(1),
              "gemm: out must be a contiguous fp32 [M, N]");
  TORCH_CHECK(beta == 0.0 || beta == 1.0, "gemm: beta must be 0 or 1");
  if (out.numel() == 0) return;
  if (a.size(1) == 0) {  // an empty sum: oneDNN would leave out unwritten
    if (beta == 0.0) out.zero_();
    return;
  }
  at::native::mkldnn_matmul(a, b, out, static_cast<float>(beta), 1.0f);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcore_rl, m) {
  // add + a @ b for fp32 a [M, K], b [K, N] (any strides), add None, [N] or [M, N], on oneDNN (CPU only).
  m.def("gemm(Tensor a, Tensor b, Tensor? add) -> Tensor");
  // out = beta * out + a @ b in place, beta 0 or 1, out contiguous [M, N] (CPU only).
  m.def("gemm_into(Tensor(a!) out, Tensor a, Tensor b, float beta) -> ()");
}

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) {
  m.impl("gemm", &gemm_cpu);
  m.impl("gemm_into", &gemm_into_cpu);
}

}  // namespace mcore_rl
