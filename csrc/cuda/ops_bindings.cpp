// CUDA implementations of the mcore_rl ops: tensor checks, device guard and current stream around the
// C-ABI launchers of csrc/cuda/*.cu. Compiled only when torch is a CUDA build (see setup.py), since it needs
// the c10/cuda headers that CPU wheels of torch do not ship.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../pack_table.h"
#include "kernels.h"

namespace mcore_rl {
namespace {

int kernel_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return MCORE_RL_FLOAT32;
    case at::kBFloat16:
      return MCORE_RL_BFLOAT16;
    case at::kHalf:
      return MCORE_RL_FLOAT16;
    default:
      TORCH_CHECK(false, "mcore_rl: CUDA kernels support float32, bfloat16 and float16, got ", dtype);
  }
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "mcore_rl: ", what, " kernel launch failed: ", cudaGetErrorString(err));
}

void check_rows(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
              "mcore_rl: logits must be a CUDA [N, V] tensor with unit column stride");
  TORCH_CHECK(targets.device() == logits.device() && targets.dim() == 1 && targets.size(0) == logits.size(0) &&
                  targets.scalar_type() == at::kLong && targets.is_contiguous(),
              "mcore_rl: targets must be a contiguous int64 [N] on the logits' device");
}

void check_row_floats(const at::Tensor& t, const at::Tensor& logits, int64_t cols, const char* name) {
  TORCH_CHECK(t.device() == logits.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == logits.size(0) * cols,
              "mcore_rl: ", name, " must be a contiguous float32 tensor of ", logits.size(0) * cols,
              " elements on the logits' device");
}

at::Tensor logprob_stats_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                              int64_t vocab_size, double inv_temperature) {
  check_rows(logits, targets);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor stats = at::empty({logits.size(0), 4}, logits.options().dtype(at::kFloat));
  check_launch(mcore_rl_logprob_stats_cuda(logits.const_data_ptr(), kernel_dtype(logits.scalar_type()),
                                           logits.size(0), logits.size(1), logits.stride(0),
                                           targets.const_data_ptr<int64_t>(), vocab_start, vocab_size,
                                           static_cast<float>(inv_temperature), stats.mutable_data_ptr<float>(),
                                           c10::cuda::getCurrentCUDAStream().stream()),
               "logprob_stats");
  return stats;
}

void logprob_entropy_backward_cuda(const at::Tensor& grad_logprob, const at::Tensor& grad_entropy,
                                   const at::Tensor& logits, const at::Tensor& targets,
                                   const at::Tensor& softmax_stats, int64_t vocab_start, int64_t vocab_size,
                                   double inv_temperature, at::Tensor& grad_logits) {
  check_rows(logits, targets);
  check_row_floats(grad_logprob, logits, 1, "grad_logprob");
  check_row_floats(grad_entropy, logits, 1, "grad_entropy");
  check_row_floats(softmax_stats, logits, 2, "softmax_stats");
  TORCH_CHECK(grad_logits.device() == logits.device() && grad_logits.sizes() == logits.sizes() &&
                  grad_logits.scalar_type() == logits.scalar_type() && grad_logits.stride(1) == 1,
              "mcore_rl: grad_logits must match logits in device, shape and dtype, with unit column stride");
  const c10::cuda::CUDAGuard guard(logits.device());
  check_launch(mcore_rl_logprob_entropy_backward_cuda(
                   grad_logprob.const_data_ptr<float>(), grad_entropy.const_data_ptr<float>(),
                   logits.const_data_ptr(), kernel_dtype(logits.scalar_type()), logits.size(0), logits.size(1),
                   logits.stride(0), targets.const_data_ptr<int64_t>(), softmax_stats.const_data_ptr<float>(),
                   vocab_start, vocab_size, static_cast<float>(inv_temperature), grad_logits.mutable_data_ptr(),
                   grad_logits.stride(0), c10::cuda::getCurrentCUDAStream().stream()),
               "logprob_entropy_backward");
}

// Resolves and bounds-checks the table on the host, ships the [K, 6] address table to the device (on the
// current stream, so the kernel sees it) and launches one copy kernel for every block. The host table is
// pinned so that the copy is asynchronous: from pageable memory it would wait for the stream to drain, once
// per call, and a reshard makes hundreds of calls. The caching host allocator keeps the pinned block until
// the copy has run; the device copy is freed after the launch and only reused by later work on this stream.
void run_block_copies(const std::vector<BlockCopy>& blocks, const Side& src, const Side& dst,
                      const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(blocks.size()), 6},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* row = host.mutable_data_ptr<int64_t>();
  int64_t max_numel = 0;
  for (const BlockCopy& b : blocks) {
    row[0] = reinterpret_cast<int64_t>(b.src);
    row[1] = reinterpret_cast<int64_t>(b.dst);
    row[2] = b.rows, row[3] = b.cols, row[4] = b.src_stride, row[5] = b.dst_stride;
    max_numel = std::max(max_numel, b.rows * b.cols);
    row += 6;
  }
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor on_device = host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
  check_launch(mcore_rl_block_copy_cuda(on_device.const_data_ptr<int64_t>(), static_cast<int64_t>(blocks.size()),
                                        max_numel, kernel_dtype(src.dtype), kernel_dtype(dst.dtype),
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "pack_copy");
}

void pack_copy_cuda(at::TensorList sources, const at::Tensor& table, at::Tensor& out) {
  const Side src = make_side(sources, "source", out.device());
  const Side dst = make_side({out}, "output", out.device());
  run_block_copies(resolve(table, src, dst, /*unpack=*/false), src, dst, out.device());
}

void unpack_copy_cuda(const at::Tensor& packed, const at::Tensor& table, at::TensorList outs) {
  const Side dst = make_side(outs, "output", packed.device());
  const Side src = make_side({packed}, "packed", packed.device());
  run_block_copies(resolve(table, dst, src, /*unpack=*/true), src, dst, packed.device());
}

}  // namespace

TORCH_LIBRARY_IMPL(mcore_rl, CUDA, m) {
  m.impl("logprob_stats", &logprob_stats_cuda);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward_cuda);
  m.impl("pack_copy", &pack_copy_cuda);
  m.impl("unpack_copy", &unpack_copy_cuda);
}

}  // namespace mcore_rl
